"""Typing stub of the fast CPU loops (see _cpu_copy.pyx). Pointers are ``int`` addresses
(``tensor.data_ptr()``), strides and sizes are in bytes unless named in elements."""

PARALLEL_BYTES: int

def max_threads() -> int: ...
def write_rows(
    layer_ptr: int,
    key_ptr: int,
    value_ptr: int,
    slots_ptr: int,
    num_tokens: int,
    key_tok_stride: int,
    key_head_stride: int,
    value_tok_stride: int,
    value_head_stride: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    row_bytes: int,
    hnd: bool,
) -> tuple[int, int]: ...
def validate_csr(
    indptr_ptr: int,
    indices_ptr: int,
    seq_lens_ptr: int,
    batch: int,
    nnz: int,
    block_size: int,
    num_blocks: int,
) -> tuple[int, int, int, int]: ...
def validate_padded(
    table_ptr: int,
    seq_lens_ptr: int,
    batch: int,
    width: int,
    block_size: int,
    num_blocks: int,
) -> tuple[int, int, int, int]: ...
def gather_csr(
    layer_ptr: int,
    indptr_ptr: int,
    indices_ptr: int,
    seq_lens_ptr: int,
    batch: int,
    total: int,
    out_k_ptr: int,
    out_v_ptr: int,
    block_size: int,
    num_heads: int,
    row_bytes: int,
    hnd: bool,
) -> None: ...
def gather_padded(
    layer_ptr: int,
    table_ptr: int,
    seq_lens_ptr: int,
    batch: int,
    width: int,
    total: int,
    out_k_ptr: int,
    out_v_ptr: int,
    block_size: int,
    num_heads: int,
    row_bytes: int,
    hnd: bool,
) -> None: ...
def copy_block_pairs(
    src_ptr: int,
    dst_ptr: int,
    num_layers: int,
    src_layer_bytes: int,
    dst_layer_bytes: int,
    block_bytes: int,
    pairs_ptr: int,
    num_pairs: int,
    pairs_int32: bool,
) -> None: ...
