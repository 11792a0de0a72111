# Shared C types of the bookkeeping core. Every .pxd cimports from here so that a
# block id or a hash has one width everywhere.
from libc.stdint cimport int8_t, uint8_t, int32_t, uint32_t, int64_t, uint64_t

ctypedef int32_t block_id_t   # physical block index in [0, num_blocks); -1 = none
ctypedef int32_t token_t      # token id as the model sees it
ctypedef int64_t slot_t       # block_id * block_size + offset; negative = skip (padding)
ctypedef uint64_t hash_t      # chained block hash (64-bit, seeded per process)
ctypedef int64_t seq_key_t    # sequence key as the core sees it (user int id, or an interned key)
