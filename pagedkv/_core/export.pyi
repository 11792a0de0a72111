# export has no Python-level API: BlockTables.block_table/csr/slot_mapping/seq_lens call it.
