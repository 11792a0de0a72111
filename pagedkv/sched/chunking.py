"""Chunk-size policy for chunked prefill (seed 004, "Dynamic chunk sizing").

A :class:`ChunkPolicy` picks the size of the next prefill chunk from what the driver
knows just before the chunk runs (:class:`ChunkState`): the context already
committed, the tokens left, the free KV blocks, and, when configured, the memory
headroom for the chunk's activations.

Memory model. The KV arena is allocated once, so a chunk costs no new device memory
for its K/V; what spikes during prefill is the chunk's *activations* (hidden states,
MLP intermediates, and with eager attention the ``chunk x context`` score matrix).
The policy estimates them as::

    fixed_bytes + n * activation_bytes_per_token + n * (context + n) * attention_bytes_per_pair

(or with a caller's ``activation_bytes(n, context)``) and keeps that estimate within
the headroom: ``memory_limit``, further capped by ``memory_probe() - probe_margin``
when a probe is given (free device bytes now, e.g. :func:`cuda_memory_probe`; on CPU
any function). So peak memory stays within the limit as long as the estimate is an
upper bound of what the forward step allocates.

Sizing order (see :meth:`ChunkPolicy.next_chunk_size`): the largest chunk within
``max_tokens``, the tokens left, the KV capacity and the memory headroom; when
memory-aware, growth is also limited to ``growth`` x the previous chunk, so a chunk
grows back gradually after pressure and shrinks at once under it. Chunk ends are
rounded down to block boundaries when that keeps the chunk >= ``min_tokens``.
Only the last chunk of a prompt may be shorter than ``min_tokens``; when even
``min_tokens`` does not fit the headroom (:class:`PrefillMemoryError`) or the free
blocks (:class:`~pagedkv.errors.OutOfBlocksError`), the policy raises before any
work on that chunk, and the committed chunks stay resumable.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.config.options import parse_bytes
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PrefillMemoryError, expected

__all__ = [
    "ChunkState",
    "ChunkPolicy",
    "PrefillMemoryError",
    "cuda_memory_probe",
    "DEFAULT_MIN_TOKENS",
    "DEFAULT_MAX_TOKENS",
]

#: Seed 004: "chunk size SHALL be between 512 and 2048 tokens".
DEFAULT_MIN_TOKENS = 512
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class ChunkState:
    """What the prefill driver knows before choosing the next chunk.

    Attributes:
        position: prompt tokens already committed (the context this chunk attends to).
        remaining: prompt tokens still to compute (>= 1).
        free_blocks: blocks the pool can allocate now (free or evictable).
        held_slots: slots the sequence already holds past ``position`` (its partial
            last block, plus slots reserved by a chunk whose forward failed); a chunk
            of up to this many tokens needs no new block.
        block_size: tokens per block.
        last_chunk: size of the previous chunk of this run; 0 before the first.
    """

    position: int
    remaining: int
    free_blocks: int
    held_slots: int
    block_size: int
    last_chunk: int = 0

    def kv_capacity(self, reserve_blocks: int = 0) -> int:
        """Tokens a chunk may hold without dipping into ``reserve_blocks`` free blocks."""
        return self.held_slots + max(0, self.free_blocks - reserve_blocks) * self.block_size


def _int_arg(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", repr(value)))
    return int(value)


class ChunkPolicy:
    """Chooses the next chunk size in ``[min_tokens, max_tokens]`` (the last may be less).

    Args:
        min_tokens: the smallest chunk (default 512, seed 004).
        max_tokens: the largest chunk (default 2048).
        memory_limit: bytes the chunk's activations may use at peak (int or a string
            like ``"512MiB"``): the configured limit.
        memory_probe: ``() -> int`` free bytes now (the device's headroom); the budget
            is ``min(memory_limit, memory_probe() - probe_margin)``.
        probe_margin: bytes of the probed headroom left untouched (allocator slack).
        activation_bytes_per_token: the linear activation estimate's bytes per chunk
            token (see the module docstring).
        attention_bytes_per_pair: its bytes per (query, key) pair: 0 for
            flash/memory-efficient attention.
        fixed_bytes: its constant bytes.
        activation_bytes: ``(n, context) -> int`` replacing the linear estimate; must
            grow with ``n``.
        kv_reserve_blocks: free blocks a chunk leaves to other sequences (decodes
            running beside the prefill); the chunk shrinks to respect it.
        growth: memory-aware runs start at ``min_tokens`` and grow at most by this
            factor per chunk; ``None`` jumps straight to the largest safe size.
        align_to_blocks: end chunks on block boundaries where the bounds allow, so
            each commit leaves only full blocks (registered for prefix reuse at once).

    The policy is stateless (the previous chunk size comes in :class:`ChunkState`),
    so one instance may serve many concurrent prefills.
    """

    def __init__(self, min_tokens: int = DEFAULT_MIN_TOKENS, max_tokens: int = DEFAULT_MAX_TOKENS, *,
                 memory_limit: int | str | None = None,
                 memory_probe: Callable[[], int] | None = None,
                 probe_margin: int = 0,
                 activation_bytes_per_token: int = 0,
                 attention_bytes_per_pair: int = 0,
                 fixed_bytes: int = 0,
                 activation_bytes: Callable[[int, int], int] | None = None,
                 kv_reserve_blocks: int = 0,
                 growth: float | None = 2.0,
                 align_to_blocks: bool = True):
        self.min_tokens = _int_arg("min_tokens", min_tokens, 1)
        self.max_tokens = _int_arg("max_tokens", max_tokens, 1)
        if self.max_tokens < self.min_tokens:
            raise InvalidArgumentError(expected("max_tokens", f">= min_tokens ({self.min_tokens})", max_tokens))
        self.memory_limit = None if memory_limit is None else parse_bytes(memory_limit, "memory_limit")
        if memory_probe is not None and not callable(memory_probe):
            raise InvalidArgumentError(expected("memory_probe", "a callable returning free bytes",
                                                type(memory_probe).__name__))
        self.memory_probe = memory_probe
        self.probe_margin = _int_arg("probe_margin", probe_margin, 0)
        self.activation_bytes_per_token = _int_arg("activation_bytes_per_token", activation_bytes_per_token, 0)
        self.attention_bytes_per_pair = _int_arg("attention_bytes_per_pair", attention_bytes_per_pair, 0)
        self.fixed_bytes = _int_arg("fixed_bytes", fixed_bytes, 0)
        if activation_bytes is not None and not callable(activation_bytes):
            raise InvalidArgumentError(expected("activation_bytes", "a callable (n, context) -> bytes",
                                                type(activation_bytes).__name__))
        self.activation_bytes = activation_bytes
        self.kv_reserve_blocks = _int_arg("kv_reserve_blocks", kv_reserve_blocks, 0)
        if growth is not None and (isinstance(growth, bool) or not isinstance(growth, numbers.Real)
                                   or not float(growth) >= 1.0):
            raise InvalidArgumentError(expected("growth", "None or a number >= 1", repr(growth)))
        self.growth = None if growth is None else float(growth)
        if not isinstance(align_to_blocks, bool):
            raise InvalidArgumentError(expected("align_to_blocks", "True or False", repr(align_to_blocks)))
        self.align_to_blocks = align_to_blocks
        has_estimate = activation_bytes is not None or self.activation_bytes_per_token or self.attention_bytes_per_pair
        if self.memory_aware and not has_estimate:
            # A limit with a zero estimate would admit any chunk: the limit would be a lie.
            raise InvalidArgumentError(expected(
                "activation_bytes_per_token", "an activation estimate (or activation_bytes) with "
                "memory_limit/memory_probe", 0))

    @classmethod
    def fixed(cls, tokens: int, *, align_to_blocks: bool = False) -> ChunkPolicy:
        """Every chunk ``tokens`` long (the last one the remainder)."""
        tokens = _int_arg("tokens", tokens, 1)
        return cls(tokens, tokens, align_to_blocks=align_to_blocks)

    @property
    def memory_aware(self) -> bool:
        return self.memory_limit is not None or self.memory_probe is not None

    def estimate(self, n: int, context: int) -> int:
        """Estimated activation bytes of an ``n``-token chunk attending to ``context`` earlier tokens."""
        if self.activation_bytes is not None:
            got = self.activation_bytes(n, context)
            if isinstance(got, bool) or not isinstance(got, numbers.Real) or got < 0:
                raise InvalidArgumentError(expected("activation_bytes()", "a byte count >= 0", repr(got)))
            return int(got)
        return (self.fixed_bytes + n * self.activation_bytes_per_token
                + n * (context + n) * self.attention_bytes_per_pair)

    def headroom(self) -> int | None:
        """Bytes the next chunk's activations may use; None when not memory-aware."""
        budget = self.memory_limit
        if self.memory_probe is not None:
            free = self.memory_probe()
            if isinstance(free, bool) or not isinstance(free, numbers.Real):
                raise InvalidArgumentError(expected("memory_probe()", "free bytes as a number", repr(free)))
            free = int(free) - self.probe_margin
            budget = free if budget is None else min(budget, free)
        return None if budget is None else max(0, budget)

    def _largest_fitting(self, hi: int, context: int, budget: int) -> int:
        """Largest n in [0, hi] whose estimate fits ``budget`` (binary search; estimate grows with n)."""
        if self.estimate(hi, context) <= budget:
            return hi
        lo = 0  # invariant: lo fits (0 tokens cost nothing new), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.estimate(mid, context) <= budget:
                lo = mid
            else:
                hi = mid
        return lo

    def next_chunk_size(self, state: ChunkState) -> int:
        """Tokens of the next chunk, in ``[1, state.remaining]``; raises when none fits."""
        lower = min(self.min_tokens, state.remaining)
        n = min(self.max_tokens, state.remaining)
        kv_cap = state.kv_capacity(self.kv_reserve_blocks)
        if kv_cap < lower:
            bs = state.block_size
            raise OutOfBlocksError(-(-(lower - state.held_slots) // bs),
                                   max(0, state.free_blocks - self.kv_reserve_blocks),
                                   f"a prefill chunk of {lower} token(s)"
                                   + (f" (keeping {self.kv_reserve_blocks} in reserve)" if self.kv_reserve_blocks else ""))
        n = min(n, kv_cap)
        if self.memory_aware:
            if self.growth is not None:
                ramp = self.min_tokens if state.last_chunk <= 0 else int(state.last_chunk * self.growth)
                n = min(n, max(lower, ramp))
            budget = self.headroom()
            if budget is not None:     # always: a memory-aware policy has a limit or a probe
                fit = self._largest_fitting(n, state.position, budget)
                if fit < lower:
                    raise PrefillMemoryError(self.estimate(lower, state.position), budget, lower, state.position)
                n = fit
        if self.align_to_blocks and n < state.remaining:
            end = state.position + n
            aligned = n - end % state.block_size
            if aligned >= lower:
                n = aligned
        return n

    def __repr__(self) -> str:
        mem = ""
        if self.memory_aware:
            mem = (f", memory_limit={self.memory_limit}, probe={'yes' if self.memory_probe else 'no'}, "
                   f"growth={self.growth}")
        return f"ChunkPolicy(min_tokens={self.min_tokens}, max_tokens={self.max_tokens}{mem})"


def cuda_memory_probe(device=None) -> Callable[[], int]:
    """A ``memory_probe`` for a CUDA device: bytes torch could allocate there now.

    The driver's free bytes (``torch.cuda.mem_get_info``) plus what torch's caching
    allocator holds but does not use: that memory is free to torch although the
    driver counts it as taken.
    """
    import torch

    def probe() -> int:
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))

    return probe
