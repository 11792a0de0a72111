"""How many threads pagedkv's CPU loops use (see docs/threads.md).

The compiled loops (``pagedkv.ops._cpu_copy``, ``_cpu_quant`` and ``_cpu_attention``, all
through one policy, ``pagedkv.ops._threads``) follow OpenMP's thread count, which
``torch.set_num_threads`` and ``OMP_NUM_THREADS`` set, unless pagedkv has its own:
``set_num_threads(n)`` or ``PAGEDKV_NUM_THREADS=n`` (read at import). ``0`` means
"follow torch". A call never uses more threads than it has work for (one thread per
64 KiB moved, 16,384 elements quantized, or 2**18 multiply-adds of attention).
"""
from __future__ import annotations

import os

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected

ENV = "PAGEDKV_NUM_THREADS"


def _policy():
    try:
        from pagedkv.ops import _threads
    except ImportError:   # not built: the reference ops are single-threaded torch code
        return None
    return _threads


def set_num_threads(n: int) -> None:
    """Use at most ``n`` threads in pagedkv's CPU loops (``0``: follow torch's count)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ArgumentTypeError(expected("n", "an int >= 0", type(n).__name__))
    if n < 0:
        raise InvalidArgumentError(expected("n", "an int >= 0 (0: follow torch.get_num_threads())", n))
    policy = _policy()
    if policy is not None:
        policy.set_num_threads(n)


def get_num_threads() -> int:
    """pagedkv's own thread count, or ``0`` when it follows torch's (OpenMP's) count."""
    policy = _policy()
    return policy.get_num_threads() if policy is not None else 0


def _from_env() -> None:
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise InvalidArgumentError(expected(ENV, "an int >= 0 (0: follow torch.get_num_threads())", repr(raw)))
    set_num_threads(n)
