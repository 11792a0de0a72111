"""Chunked prefill over a :class:`~pagedkv.manager.cache.PagedKVCache` (seed 004).

A long prompt is computed in chunks (512-2048 tokens by default, see
:mod:`pagedkv.sched.chunking`), one after the other. For each chunk the driver reserves
slots, calls the caller's forward step, and commits the chunk, so blocks are taken
chunk by chunk (never for the whole prompt up front) and a cancelled or failed
prefill leaves every finished chunk in the cache::

    def forward(chunk: PrefillChunk):
        for layer in range(num_layers):
            ...                                     # q, k, v for chunk.token_ids at chunk.positions
            cache.write(layer, chunk.slot_mapping, k, v)
            k_all, v_all = chunk.gather(layer, k, v)   # positions [0, chunk.end), the chunk's own as computed
            ...                                     # causal attention of the chunk over them
        return logits_of_last_token

    result = chunked_prefill(cache, "req-1", prompt_ids, forward,
                             on_progress=lambda p: print(f"{p.fraction:.0%}"), cancel=event)

Cancellation: ``cancel`` is any object with ``is_set()`` (a ``threading.Event``),
checked before every chunk, so setting it from another thread or from
``on_progress`` stops the prefill after the chunk that is running (clearing it and
calling ``step()``/``run()`` again continues). The driver then
*raises* :class:`~pagedkv.errors.PrefillCancelledError` (with ``.progress``) rather
than returning a result marked cancelled: a cancelled prompt has no next-token
logits, and an exception cannot be mistaken for a finished prefill by code that goes
on to decode.

Resume: a new :class:`ChunkedPrefill` (or :func:`chunked_prefill`) on a sequence the
cache already holds continues at ``cache.num_tokens(seq_id)``; at admission, tokens
found in the prefix cache are skipped the same way.

A forward step that raises leaves its chunk uncommitted; the slots reserved for it
stay with the sequence and the next attempt (``step()`` again, or a new driver)
reuses them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError, PrefillCancelledError, expected
from pagedkv.manager.cache import PagedKVCache, as_token_ids
from pagedkv.sched.chunking import ChunkPolicy, ChunkState

__all__ = ["PrefillChunk", "PrefillProgress", "PrefillResult", "ChunkedPrefill", "chunked_prefill"]


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """One chunk handed to the forward step.

    Attributes:
        seq_id: the sequence.
        index: chunk number within this run (0-based).
        start: position of the chunk's first token; the chunk covers ``[start, end)``.
        token_ids: int32 ``[n]`` prompt ids of the chunk.
        positions: int64 ``[n]``, ``start .. end - 1`` (rotary positions).
        slot_mapping: int64 ``[n]`` slots from ``reserve``: pass to ``cache.write``.
        total_tokens: prompt length.
    """

    seq_id: Hashable
    index: int
    start: int
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    total_tokens: int
    cache: PagedKVCache = field(repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_last(self) -> bool:
        return self.end == self.total_tokens

    def gather(self, layer: int, key=None, value=None):
        """K, V ``[end, num_kv_heads, head_dim]`` of positions ``[0, end)`` in ``layer``.

        ``key``/``value``: the chunk's own K/V ``[len(token_ids), H, D]`` as computed, read
        in place of its rows in the cache (one definition of what a read returns: a pass's
        own rows are read at model precision; a quantized cache refuses to read them back
        from its arena before they are committed). Without them, the chunk's rows are
        read from the cache. Sliced to ``end`` because the sequence may hold more reserved
        slots than this chunk (left by a chunk whose forward failed); those hold no valid
        KV yet.
        """
        if key is None and value is None:
            k, v = self.cache.gather(self.seq_id, layer)
            return k[: self.end], v[: self.end]
        import torch

        k, v = self.cache.gather(self.seq_id, layer, self.start)
        return torch.cat([k, key.to(k.dtype)]), torch.cat([v, value.to(v.dtype)])


@dataclass(frozen=True)
class PrefillProgress:
    """Where a chunked prefill stands, after each chunk (passed to ``on_progress``).

    ``tokens_processed`` counts every committed prompt token, including the prefix
    hit at admission and earlier runs; ``tokens_computed`` only those this run
    computed, which is what ``tokens_per_s`` divides by ``elapsed_s``.
    """

    seq_id: Hashable
    chunks_done: int
    tokens_processed: int
    total_tokens: int
    tokens_computed: int
    cached_tokens: int
    resumed_from: int
    last_chunk_tokens: int
    elapsed_s: float
    tokens_per_s: float
    kv_blocks: int

    @property
    def fraction(self) -> float:
        """``tokens_processed / total_tokens``."""
        return self.tokens_processed / self.total_tokens

    @property
    def done(self) -> bool:
        return self.tokens_processed == self.total_tokens


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill.

    Attributes:
        output: what the forward step returned for the last chunk (e.g. the next-token
            logits); None when this run computed nothing (already fully prefilled).
        chunk_sizes: tokens of each chunk this run computed.
        blocks_after_chunk: blocks the sequence held after each chunk: they grow
            chunk by chunk, never allocated for the whole prompt up front.
        kv_bytes: bytes of the blocks the sequence holds (``blocks * bytes_per_block``).
    """

    seq_id: Hashable
    total_tokens: int
    cached_tokens: int
    resumed_from: int
    tokens_computed: int
    chunk_sizes: tuple[int, ...]
    blocks_after_chunk: tuple[int, ...]
    kv_blocks: int
    kv_bytes: int
    elapsed_s: float
    tokens_per_s: float
    output: Any = field(default=None, repr=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sizes)


class ChunkedPrefill:
    """Drives one sequence's prompt through the cache chunk by chunk.

    Construction admits the sequence (``add_sequence`` with the prompt, so prefix
    hits are skipped), or, when the cache already holds ``seq_id``, checks that
    ``prompt_token_ids`` extends what it holds and resumes at its committed tokens
    (``cache_salt``, ``adapter_id`` and ``priority`` then keep their admitted values).
    :meth:`step` runs one chunk (an engine can interleave it with decode steps);
    :meth:`run` runs them all.

    Args:
        cache: the paged cache; a bookkeeping-only cache works with a forward step
            that keeps its KV elsewhere (or none, for planning).
        seq_id: the sequence.
        prompt_token_ids: the whole prompt (ids fitting int32).
        forward: ``forward(chunk: PrefillChunk) -> Any``; must write every layer's
            K/V of the chunk at ``chunk.slot_mapping`` before returning.
        policy: chunk sizing (default ``ChunkPolicy()``: 512-2048 tokens).
        on_progress: ``on_progress(PrefillProgress)`` after each committed chunk.
        cancel: an object with ``is_set()`` checked before each chunk.
        clock: seconds as a float (tests pass a fake one).

    One thread drives a ``ChunkedPrefill``; ``cancel`` may be set from any thread.
    """

    def __init__(self, cache: PagedKVCache, seq_id: Hashable, prompt_token_ids: Iterable[int],
                 forward: Callable[[PrefillChunk], Any], *, policy: ChunkPolicy | None = None,
                 on_progress: Callable[[PrefillProgress], Any] | None = None, cancel: Any = None,
                 cache_salt: str | None = None, adapter_id: Any = None, priority: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgumentError(expected("cache", "a PagedKVCache", type(cache).__name__))
        if not callable(forward):
            raise InvalidArgumentError(expected("forward", "a callable forward(chunk)", type(forward).__name__))
        if on_progress is not None and not callable(on_progress):
            raise InvalidArgumentError(expected("on_progress", "None or a callable", type(on_progress).__name__))
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise InvalidArgumentError(expected("cancel", "None or an object with is_set() (threading.Event)",
                                                type(cancel).__name__))
        if policy is None:
            policy = ChunkPolicy()
        elif not callable(getattr(policy, "next_chunk_size", None)):
            raise InvalidArgumentError(expected("policy", "a ChunkPolicy (an object with next_chunk_size(state))",
                                                type(policy).__name__))
        prompt = as_token_ids(prompt_token_ids)
        if prompt is prompt_token_ids:
            prompt = prompt.copy()  # the caller's array may change while chunks still read it
        prompt.flags.writeable = False  # chunk.token_ids are views of it
        if len(prompt) == 0:
            raise InvalidArgumentError(expected("prompt_token_ids", "at least one token", "an empty prompt"))
        self.cache, self.seq_id, self.forward = cache, seq_id, forward
        self.policy, self.on_progress, self.cancel, self._clock = policy, on_progress, cancel, clock
        self.prompt = prompt
        self.total_tokens = len(prompt)
        self._block_size = cache.config.block_size
        if seq_id in cache:
            self.cached_tokens = 0
            self.resumed_from = self._check_resumable()
        else:
            self.cached_tokens = cache.add_sequence(seq_id, prompt, cache_salt=cache_salt,
                                                    adapter_id=adapter_id, priority=priority)
            self.resumed_from = self.cached_tokens
        self.chunk_sizes: list = []
        self.blocks_after_chunk: list = []
        self.output: Any = None
        self._computed = 0
        self._elapsed = 0.0

    def _check_resumable(self) -> int:
        """Committed tokens of the held sequence, after checking the prompt extends them."""
        committed = self.cache.num_tokens(self.seq_id)
        if committed > self.total_tokens:
            raise InvalidArgumentError(expected(
                "prompt_token_ids", f"at least the {committed} tokens sequence {self.seq_id!r} has committed",
                f"{self.total_tokens} tokens"))
        known = self.cache.token_ids(self.seq_id)
        n = min(len(known), self.total_tokens)
        diff = np.flatnonzero(known[:n] != self.prompt[:n])
        if diff.size:
            p = int(diff[0])
            raise InvalidArgumentError(expected(
                "prompt_token_ids", f"the prompt sequence {self.seq_id!r} holds (id {int(known[p])} at position {p})",
                f"id {int(self.prompt[p])}"))
        return committed

    # ---- state --------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Committed prompt tokens (where the next chunk starts)."""
        return self.cache.num_tokens(self.seq_id)

    @property
    def done(self) -> bool:
        return self.position >= self.total_tokens

    def _kv_blocks(self) -> int:
        # Block tables cover the reserved tokens exactly: ceil(num_reserved / block_size).
        return -(-self.cache.num_reserved(self.seq_id) // self._block_size)

    def progress(self) -> PrefillProgress:
        """A snapshot of the progress now."""
        pos = self.position
        computed = self._computed
        elapsed = self._elapsed
        return PrefillProgress(
            seq_id=self.seq_id, chunks_done=len(self.chunk_sizes), tokens_processed=pos,
            total_tokens=self.total_tokens, tokens_computed=computed, cached_tokens=self.cached_tokens,
            resumed_from=self.resumed_from, last_chunk_tokens=self.chunk_sizes[-1] if self.chunk_sizes else 0,
            elapsed_s=elapsed, tokens_per_s=computed / elapsed if elapsed > 0 else 0.0,
            kv_blocks=self._kv_blocks())

    # ---- driving ------------------------------------------------------------------
    def _raise_if_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            progress = self.progress()
            err = PrefillCancelledError(
                f"prefill of sequence {self.seq_id!r} cancelled after {progress.chunks_done} chunk(s): "
                f"{progress.tokens_processed}/{self.total_tokens} tokens committed; a new chunked prefill "
                f"of the same sequence resumes at token {progress.tokens_processed}")
            err.progress = progress
            err.seq_id = self.seq_id
            raise err

    def step(self) -> PrefillProgress | None:
        """Compute and commit the next chunk; None when the prompt is already done.

        Raises :class:`~pagedkv.errors.PrefillCancelledError` (before any work) when
        ``cancel`` is set; whatever the forward step raises propagates with the chunk
        uncommitted.
        """
        cache, seq = self.cache, self.seq_id
        pos = cache.num_tokens(seq)
        if pos >= self.total_tokens:
            return None
        self._raise_if_cancelled()
        t0 = self._clock()
        try:
            reserved = cache.num_reserved(seq)
            bs = self._block_size
            state = ChunkState(position=pos, remaining=self.total_tokens - pos,
                               free_blocks=cache.pool.num_free_blocks,
                               held_slots=-(-reserved // bs) * bs - pos, block_size=bs,
                               last_chunk=self.chunk_sizes[-1] if self.chunk_sizes else 0)
            n = self.policy.next_chunk_size(state)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= state.remaining:
                raise InvalidArgumentError(expected("policy.next_chunk_size()", f"an int in [1, {state.remaining}]",
                                                    repr(n)))
            n = int(n)
            pending = reserved - pos  # reserved by a failed attempt: reuse before taking more
            if pending == 0:
                slots = cache.reserve(seq, n)
            else:
                if n > pending:
                    cache.reserve(seq, n - pending)
                slots = cache.slot_mapping(seq, pos, n)
            chunk = PrefillChunk(seq_id=seq, index=len(self.chunk_sizes), start=pos,
                                 token_ids=self.prompt[pos:pos + n],
                                 positions=np.arange(pos, pos + n, dtype=np.int64),
                                 slot_mapping=slots, total_tokens=self.total_tokens, cache=cache)
            out = self.forward(chunk)
            cache.commit(seq, n, token_ids=chunk.token_ids)
        finally:
            self._elapsed += self._clock() - t0
        self.output = out
        self.chunk_sizes.append(n)
        self._computed += n
        self.blocks_after_chunk.append(self._kv_blocks())
        progress = self.progress()
        if self.on_progress is not None:
            self.on_progress(progress)
        return progress

    def run(self) -> PrefillResult:
        """Run the remaining chunks; returns the result (raises when cancelled)."""
        while self.step() is not None:
            pass
        return self.result()

    def result(self) -> PrefillResult:
        """The result so far (complete once :attr:`done`)."""
        p = self.progress()
        return PrefillResult(
            seq_id=self.seq_id, total_tokens=self.total_tokens, cached_tokens=self.cached_tokens,
            resumed_from=self.resumed_from, tokens_computed=p.tokens_computed,
            chunk_sizes=tuple(self.chunk_sizes), blocks_after_chunk=tuple(self.blocks_after_chunk),
            kv_blocks=p.kv_blocks, kv_bytes=p.kv_blocks * self.cache.config.bytes_per_block,
            elapsed_s=p.elapsed_s, tokens_per_s=p.tokens_per_s, output=self.output)


def chunked_prefill(cache: PagedKVCache, seq_id: Hashable, prompt_token_ids: Iterable[int],
                    forward: Callable[[PrefillChunk], Any], **options: Any) -> PrefillResult:
    """Prefill ``prompt_token_ids`` chunk by chunk; see :class:`ChunkedPrefill` for ``options``."""
    return ChunkedPrefill(cache, seq_id, prompt_token_ids, forward, **options).run()
