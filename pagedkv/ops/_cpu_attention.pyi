"""Typing stub of the CPU paged-attention loops (see _cpu_attention.pyx): the arguments
are raw addresses (``tensor.data_ptr()``), sizes and codes that
:mod:`pagedkv.ops.attention_cpu` prepares and checks; it is the only caller."""
from typing import Any

ROW_ISA: str

def attend(*args: Any, **kwargs: Any) -> None: ...
def hadamard_rows(y_ptr: int, rows: int, head_dim: int, signs_ptr: int, inverse: bool) -> None: ...

PREFETCH_MODES: dict[str, int]

def tune(prefetch: str | None = None, key_cache: bool | None = None, fused: bool | str | None = None) -> tuple[str, bool, bool | str]: ...

def planned_threads(work: int) -> int: ...
