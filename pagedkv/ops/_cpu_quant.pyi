"""Typing stub of the quantized CPU loops (see _cpu_quant.pyx). Pointers are ``int``
addresses (``tensor.data_ptr()``, 0 for an absent zero view or no rotation signs), strides are in bytes."""
from typing import Dict, Tuple

MODEL_CODES: Dict[str, int]
QUANT_CODES: Dict[str, int]
ROW_ISA: str

def write_quant(
    layer_ptr: int,
    scale_ptr: int,
    zero_ptr: int,
    key_ptr: int,
    value_ptr: int,
    slots_ptr: int,
    num_tokens: int,
    key_tok_stride: int,
    key_head_stride: int,
    value_tok_stride: int,
    value_head_stride: int,
    in_type: int,
    qtype: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    groups: int,
    hnd: bool,
    signs_ptr: int = 0,
) -> Tuple[int, int]: ...
def gather_quant(
    layer_ptr: int,
    scale_ptr: int,
    zero_ptr: int,
    starts_ptr: int,
    start_stride: int,
    blocks_ptr: int,
    seq_lens_ptr: int,
    batch: int,
    total: int,
    out_k_ptr: int,
    out_v_ptr: int,
    qtype: int,
    out_type: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    groups: int,
    hnd: bool,
    signs_ptr: int = 0,
    key_scale_ptr: int = 0,
    key_zero_ptr: int = 0,
) -> None: ...
