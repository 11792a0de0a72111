"""Chunked prefill (seed 004): the chunk policy, the driver, and real models.

Bookkeeping-only caches cover the 200k and short-sequence scenarios; tiny_llama and
SmolLM2 check that chunked logits equal a single full prefill, also across a
cancel + resume. The SmolLM2 test fails (never skips) when the model is missing.
"""
from __future__ import annotations

import math
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.sched.chunking import ChunkPolicy, ChunkState, PrefillMemoryError, cuda_memory_probe
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PrefillCancelledError
from pagedkv.testing.models import load_smollm2, tiny_llama
from pagedkv.config.planner import plan_config
from pagedkv.sched.prefill import ChunkedPrefill, PrefillChunk, chunked_prefill

# Qwen3-0.6B: 28 layers, 8 KV heads, head_dim 128 (seed 004's 200k example).
QWEN3_SHAPE = dict(num_layers=28, num_kv_heads=8, head_dim=128, dtype="bfloat16")


@pytest.fixture(autouse=True)
def _free_prefilled_sequences(monkeypatch):
    """A prefill leaves its sequence live, ready to decode, and these tests end there.
    Free what every cache made by the test still holds, so that the suite's leak check
    (tests/conftest.py) then finds only blocks no sequence accounts for."""
    made = []
    init = PagedKVCache.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(PagedKVCache, "__init__", recording_init)
    yield
    for cache in made:
        live = cache.sequences()
        if live:
            cache.free(live)


def bookkeeping_cache(num_blocks=64, block_size=16, **shape):
    shape = shape or dict(num_layers=2, num_kv_heads=2, head_dim=8)
    return PagedKVCache(CacheConfig(num_blocks=num_blocks, block_size=block_size, **shape), allocate_store=False)


def noop(chunk):
    return chunk.end


def state(position=0, remaining=10_000, free_blocks=10_000, held_slots=0, block_size=16, last_chunk=0):
    return ChunkState(position, remaining, free_blocks, held_slots, block_size, last_chunk)


# ---------------------------------------------------------------- chunk policy
class TestChunkPolicy:
    def test_default_bounds_are_512_to_2048(self):
        p = ChunkPolicy()
        assert (p.min_tokens, p.max_tokens) == (512, 2048)
        assert p.next_chunk_size(state()) == 2048
        assert p.next_chunk_size(state(remaining=700)) == 700   # the last chunk: the remainder
        assert p.next_chunk_size(state(remaining=100)) == 100

    def test_fixed(self):
        p = ChunkPolicy.fixed(7)
        assert [p.next_chunk_size(state(position=i, remaining=r)) for i, r in ((0, 20), (7, 13), (14, 6))] == [7, 7, 6]

    def test_chunks_end_on_block_boundaries_when_bounds_allow(self):
        p = ChunkPolicy(32, 64)
        assert p.next_chunk_size(state(position=5)) == 59      # 5 + 59 = 64
        assert p.next_chunk_size(state(position=64)) == 64
        # rounding down would go below min_tokens: keep the unaligned size
        assert ChunkPolicy(60, 64).next_chunk_size(state(position=5)) == 64
        assert ChunkPolicy(32, 64, align_to_blocks=False).next_chunk_size(state(position=5)) == 64

    def test_kv_capacity_shrinks_the_chunk(self):
        p = ChunkPolicy(32, 256)
        assert p.next_chunk_size(state(position=13, free_blocks=4, held_slots=3)) == 3 + 64
        # a reserve of free blocks for other sequences is respected
        assert ChunkPolicy(32, 256, kv_reserve_blocks=2).next_chunk_size(state(free_blocks=6)) == 64

    def test_out_of_blocks_below_min_tokens(self):
        p = ChunkPolicy(512, 2048, kv_reserve_blocks=3)
        with pytest.raises(OutOfBlocksError, match=re.escape(
                "out of KV blocks: a prefill chunk of 512 token(s) (keeping 3 in reserve) needs 32 block(s), 7 free")):
            p.next_chunk_size(state(free_blocks=10))

    def test_memory_fit_is_the_largest_chunk_within_headroom(self):
        p = ChunkPolicy(16, 4096, memory_limit=1000 * 100 + 50, activation_bytes_per_token=100, growth=None,
                        align_to_blocks=False)
        assert p.next_chunk_size(state()) == 1000
        assert p.estimate(1000, 0) <= p.memory_limit < p.estimate(1001, 0)

    def test_attention_term_shrinks_chunks_as_context_grows(self):
        # eager attention: a chunk x context score matrix per head (16 heads, fp32)
        p = ChunkPolicy(32, 2048, memory_limit="64MiB", attention_bytes_per_pair=4 * 16, growth=None)
        contexts = (0, 2048, 8192, 16384)
        sizes = [p.next_chunk_size(state(position=ctx)) for ctx in contexts]
        assert sizes == [1024, 416, 112, 48]
        for ctx, n in zip(contexts, sizes):
            assert p.estimate(n, ctx) <= 64 * 2**20 < p.estimate(n + 16, ctx)
        with pytest.raises(PrefillMemoryError, match="chunk of 32 token"):
            p.next_chunk_size(state(position=200_000))

    def test_grows_with_headroom_and_shrinks_under_pressure(self):
        free = [10**12]
        p = ChunkPolicy(512, 2048, memory_probe=lambda: free[0], activation_bytes_per_token=1000)
        first = p.next_chunk_size(state())
        second = p.next_chunk_size(state(position=first, last_chunk=first))
        third = p.next_chunk_size(state(position=first + second, last_chunk=second))
        assert (first, second, third) == (512, 1024, 2048)
        free[0] = 700 * 1000
        assert p.next_chunk_size(state(position=4096, last_chunk=2048)) == 688   # aligned down from 700
        free[0] = 10**12
        assert p.next_chunk_size(state(position=4784, last_chunk=688)) == 1376

    def test_memory_error_when_min_chunk_does_not_fit(self):
        p = ChunkPolicy(512, 2048, memory_limit=1000, memory_probe=lambda: 10**9, activation_bytes_per_token=10)
        with pytest.raises(PrefillMemoryError, match=re.escape(
                "memory headroom: expected room for a prefill chunk of 512 token(s) at context 0 "
                "(5120 bytes of activations), got 1000 bytes")) as info:
            p.next_chunk_size(state())
        assert isinstance(info.value, MemoryError)
        assert (info.value.needed_bytes, info.value.available_bytes) == (5120, 1000)

    def test_probe_margin_and_negative_headroom(self):
        p = ChunkPolicy(1, 64, memory_probe=lambda: 500, probe_margin=100, activation_bytes_per_token=10, growth=None,
                        align_to_blocks=False)
        assert p.headroom() == 400 and p.next_chunk_size(state()) == 40
        p = ChunkPolicy(1, 64, memory_probe=lambda: 50, probe_margin=100, activation_bytes_per_token=10)
        assert p.headroom() == 0
        with pytest.raises(PrefillMemoryError, match="got 0 bytes"):
            p.next_chunk_size(state())

    def test_custom_activation_estimate(self):
        p = ChunkPolicy(1, 100, memory_limit=1000, activation_bytes=lambda n, ctx: n * n, growth=None,
                        align_to_blocks=False)
        assert p.next_chunk_size(state()) == 31

    @pytest.mark.parametrize("kwargs, message", [
        (dict(min_tokens=0), "min_tokens: expected an int >= 1, got 0"),
        (dict(min_tokens=True), "min_tokens: expected an int >= 1, got True"),
        (dict(max_tokens=100), "max_tokens: expected >= min_tokens (512), got 100"),
        (dict(memory_limit="lots"), "memory_limit: expected a byte count like '4GiB'"),
        (dict(memory_limit="1GiB"), "activation_bytes_per_token: expected an activation estimate (or "
                                    "activation_bytes) with memory_limit/memory_probe, got 0"),
        (dict(memory_probe=5), "memory_probe: expected a callable returning free bytes, got int"),
        (dict(activation_bytes_per_token=-1), "activation_bytes_per_token: expected an int >= 0, got -1"),
        (dict(activation_bytes=3), "activation_bytes: expected a callable (n, context) -> bytes, got int"),
        (dict(growth=0.5), "growth: expected None or a number >= 1, got 0.5"),
        (dict(kv_reserve_blocks=-2), "kv_reserve_blocks: expected an int >= 0, got -2"),
        (dict(align_to_blocks=1), "align_to_blocks: expected True or False, got 1"),
    ])
    def test_invalid_arguments(self, kwargs, message):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            ChunkPolicy(**kwargs)

    def test_bad_probe_and_estimate_results(self):
        p = ChunkPolicy(1, 8, memory_probe=lambda: "lots", activation_bytes_per_token=1)
        with pytest.raises(InvalidArgumentError, match=re.escape("memory_probe(): expected free bytes as a number, got 'lots'")):
            p.next_chunk_size(state())
        p = ChunkPolicy(1, 8, memory_limit=100, activation_bytes=lambda n, c: -1)
        with pytest.raises(InvalidArgumentError, match=re.escape("activation_bytes(): expected a byte count >= 0, got -1")):
            p.next_chunk_size(state())


def test_cuda_memory_probe_counts_torch_cached_blocks_as_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 8000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 600)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 450)
    assert cuda_memory_probe()() == 1000 + 600 - 450


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")
def test_cuda_memory_probe_sees_an_allocation():
    probe = cuda_memory_probe()
    before = probe()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert before - probe() >= 256 * 2**20
    del block


# ------------------------------------------------------------------ fake device
class FakeDevice:
    """Device memory with a hard capacity; a forward step allocates its activations here."""

    def __init__(self, capacity):
        self.capacity, self.used, self.peak = capacity, 0, 0

    def set_other_usage(self, n):
        self.used = n

    def alloc(self, n):
        self.used += n
        self.peak = max(self.peak, self.used)
        if self.used > self.capacity:
            raise MemoryError(f"fake OOM: {self.used} > {self.capacity}")

    def free(self, n):
        self.used -= n

    def free_bytes(self):
        return self.capacity - self.used


def test_peak_memory_stays_within_the_limit_under_changing_pressure():
    """Other work on the device (a decode batch) grows and shrinks while a long prompt
    prefills; the chunk follows the headroom and the peak never passes capacity."""
    per_token, per_pair = 60_000, 1
    dev = FakeDevice(capacity=400 * 2**20)
    # other usage before each chunk: low, then pressure, then relief
    other = iter([50, 50, 50, 50, 300, 330, 340, 300, 100, 50, 50, 50] + [50] * 200)
    policy = ChunkPolicy(512, 2048, memory_probe=dev.free_bytes, memory_limit="300MiB",
                         activation_bytes_per_token=per_token, attention_bytes_per_pair=per_pair)
    cache = bookkeeping_cache(num_blocks=3000, **QWEN3_SHAPE)
    seen = []

    def forward(chunk):
        true_bytes = int(0.9 * (chunk.num_tokens * per_token + chunk.num_tokens * chunk.end * per_pair))
        dev.alloc(true_bytes)
        seen.append((chunk.num_tokens, dev.used))
        dev.free(true_bytes)

    prefill = ChunkedPrefill(cache, "p", np.arange(40_000) % 30_000, forward, policy=policy)
    while not prefill.done:
        dev.set_other_usage(next(other) * 2**20)
        prefill.step()
    sizes = prefill.chunk_sizes
    assert dev.peak <= dev.capacity
    assert all(512 <= n <= 2048 for n in sizes[:-1])
    assert sizes[:4] == [512, 1024, 2048, 2048]             # ramps up with headroom
    assert sizes[4] < 2048 and sizes[5] <= sizes[4]          # shrinks under pressure
    assert max(sizes[9:12]) == 2048                          # grows back after relief
    assert max(used for _, used in seen[4:8]) > 0.95 * dev.capacity   # the headroom was used, not wasted


def test_configured_limit_binds_even_with_ample_headroom():
    dev = FakeDevice(capacity=64 * 2**30)
    policy = ChunkPolicy(512, 2048, memory_limit="100MiB", memory_probe=dev.free_bytes,
                         activation_bytes_per_token=80_000, attention_bytes_per_pair=2)
    activations = []

    def forward(chunk):
        need = policy.estimate(chunk.num_tokens, chunk.start)   # the forward uses exactly the estimate
        dev.alloc(need)
        activations.append(need)
        dev.free(need)

    result = chunked_prefill(bookkeeping_cache(num_blocks=2000), "p", np.arange(30_000) % 1000, forward,
                             policy=policy)
    assert max(activations) <= 100 * 2**20 < policy.estimate(2048, 0)
    assert max(result.chunk_sizes) < 2048 and min(result.chunk_sizes[:-1]) >= 512


def test_memory_error_keeps_committed_chunks_resumable():
    dev = FakeDevice(capacity=10**9)
    policy = ChunkPolicy(64, 64, memory_probe=dev.free_bytes, activation_bytes_per_token=1000)
    cache = bookkeeping_cache()
    prefill = ChunkedPrefill(cache, "s", range(300), noop, policy=policy)
    prefill.step()
    dev.set_other_usage(10**9 - 1000)
    with pytest.raises(PrefillMemoryError):
        prefill.step()
    assert cache.num_tokens("s") == 64 and cache.num_reserved("s") == 64
    dev.set_other_usage(0)
    assert prefill.run().chunk_sizes == (64, 64, 64, 64, 44)


# ---------------------------------------------------------- seed 004 scenarios
def test_200k_prompt_prefills_in_chunks_with_incremental_blocks():
    total = 200_000
    cache = bookkeeping_cache(num_blocks=13_000, **QWEN3_SHAPE)
    bs = cache.config.block_size
    held_during_forward = []

    def forward(chunk):
        # the previous chunk is committed before the next one runs
        assert cache.num_tokens("long") == chunk.start
        held_during_forward.append(len(cache.block_table("long")))
        assert np.array_equal(chunk.positions, np.arange(chunk.start, chunk.end))
        assert chunk.slot_mapping.dtype == np.int64 and len(chunk.slot_mapping) == chunk.num_tokens

    prompt = (np.arange(total) * 7919) % 151_000
    result = chunked_prefill(cache, "long", prompt, forward)
    assert result.num_chunks == math.ceil(total / 2048)
    assert all(512 <= n <= 2048 for n in result.chunk_sizes)
    ends = np.cumsum(result.chunk_sizes)
    assert result.blocks_after_chunk == tuple(-(-int(e) // bs) for e in ends)   # one chunk's blocks at a time
    assert held_during_forward[0] == 2048 // bs                                  # no upfront allocation
    assert np.all(np.diff(held_during_forward)[:-1] == 2048 // bs)
    assert result.kv_blocks == math.ceil(total / 16) == 12_500
    planned = plan_config(cache.config, max_seq_len=total)
    assert result.kv_bytes == planned.bytes_per_sequence == 12_500 * 16 * 114_688
    assert cache.stats().bytes_in_use == result.kv_bytes
    cache.check_invariants()


def test_short_sequence_takes_seven_blocks_under_50_mb():
    """100 tokens in a cache planned for max_seq_len=200k: blocks for 100 tokens only."""
    cfg = CacheConfig(num_blocks=CacheConfig(num_blocks=1, **QWEN3_SHAPE).blocks_for_tokens(200_000), **QWEN3_SHAPE)
    cache = PagedKVCache(cfg, allocate_store=False)
    result = chunked_prefill(cache, "short", range(100), noop)
    assert result.chunk_sizes == (100,)
    assert result.kv_blocks == 7 == len(cache.block_table("short"))
    assert cache.stats().bytes_in_use == result.kv_bytes == 7 * cfg.bytes_per_block < 50 * 10**6


# ------------------------------------------------------------ progress / cancel
class FakeClock:
    def __init__(self, step=0.5):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_progress_reports_fraction_and_rates():
    cache = bookkeeping_cache()
    seen = []
    result = chunked_prefill(cache, 1, range(100), noop, policy=ChunkPolicy.fixed(32), on_progress=seen.append,
                             clock=FakeClock(0.5))
    assert [p.tokens_processed for p in seen] == [32, 64, 96, 100]
    assert [p.fraction for p in seen] == [0.32, 0.64, 0.96, 1.0]
    assert [p.chunks_done for p in seen] == [1, 2, 3, 4] and seen[-1].done and not seen[0].done
    assert [p.elapsed_s for p in seen] == [0.5, 1.0, 1.5, 2.0]      # one fake tick per chunk
    assert seen[-1].tokens_per_s == 50.0 and seen[-1].kv_blocks == 7
    assert (result.tokens_computed, result.elapsed_s, result.tokens_per_s, result.output) == (100, 2.0, 50.0, 100)


def test_cancel_from_progress_callback_then_resume():
    cache = bookkeeping_cache()
    cancel = threading.Event()
    starts = []

    def forward(chunk):
        starts.append(chunk.start)

    def on_progress(p):
        if p.chunks_done == 1:
            cancel.set()

    prompt = list(range(1000, 1100))
    first = ChunkedPrefill(cache, "c", prompt, forward, policy=ChunkPolicy.fixed(32), on_progress=on_progress,
                           cancel=cancel)
    with pytest.raises(PrefillCancelledError, match=re.escape(
            "prefill of sequence 'c' cancelled after 1 chunk(s): 32/100 tokens committed; a new chunked prefill "
            "of the same sequence resumes at token 32")) as info:
        first.run()
    assert info.value.progress.tokens_processed == 32 and info.value.seq_id == "c"
    assert cache.num_tokens("c") == 32 and len(cache.block_table("c")) == 2   # the chunk stays committed
    cancel.clear()                          # the same driver continues once the token is clear
    assert first.step().tokens_processed == 64
    resumed = chunked_prefill(cache, "c", prompt, forward, policy=ChunkPolicy.fixed(32))
    assert starts == [0, 32, 64, 96]
    assert (resumed.resumed_from, resumed.cached_tokens, resumed.tokens_computed) == (64, 0, 36)
    assert cache.token_ids("c").tolist() == prompt
    cache.check_invariants()


def test_cancel_from_another_thread_stops_after_the_running_chunk():
    cache = bookkeeping_cache()
    cancel, inside, release = threading.Event(), threading.Event(), threading.Event()

    def forward(chunk):
        if chunk.index == 1:
            inside.set()
            release.wait(5)

    errors = []

    def worker():
        try:
            chunked_prefill(cache, "t", range(200), forward, policy=ChunkPolicy.fixed(40), cancel=cancel)
        except PrefillCancelledError as e:
            errors.append(e)

    th = threading.Thread(target=worker)
    th.start()
    assert inside.wait(5)
    cancel.set()          # while chunk 1 runs
    release.set()
    th.join(5)
    assert len(errors) == 1 and errors[0].progress.chunks_done == 2
    assert cache.num_tokens("t") == 80      # chunk 1 finished and committed, nothing after it


def test_cancel_before_start_computes_nothing():
    cache = bookkeeping_cache()
    cancel = threading.Event()
    cancel.set()
    calls = []
    with pytest.raises(PrefillCancelledError, match="after 0 chunk"):
        chunked_prefill(cache, "x", range(50), calls.append, cancel=cancel)
    assert calls == [] and cache.num_tokens("x") == 0 and cache.num_reserved("x") == 0


def test_prefix_hit_at_admission_is_skipped():
    cache = bookkeeping_cache()
    prompt = list(range(500, 600))
    chunked_prefill(cache, "a", prompt, noop, policy=ChunkPolicy.fixed(40))
    cache.free("a")
    starts = []
    result = chunked_prefill(cache, "b", prompt, lambda c: starts.append(c.start), policy=ChunkPolicy.fixed(40))
    assert result.cached_tokens == result.resumed_from == 96 and starts == [96]
    assert result.tokens_computed == 4


def test_failed_forward_leaves_chunk_uncommitted_and_retry_reuses_its_slots():
    cache = bookkeeping_cache()
    fail = [True]
    slots = []

    def forward(chunk):
        slots.append(chunk.slot_mapping.copy())
        if chunk.index == 1 and fail[0]:
            raise RuntimeError("kernel launch failed")

    prefill = ChunkedPrefill(cache, "f", range(100), forward, policy=ChunkPolicy.fixed(32))
    prefill.step()
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        prefill.step()
    assert (cache.num_tokens("f"), cache.num_reserved("f")) == (32, 64)
    allocated = cache.stats().allocation_count
    fail[0] = False
    prefill.step()
    assert np.array_equal(slots[1], slots[2])                  # the same slots, no new blocks
    assert cache.stats().allocation_count == allocated
    # a smaller chunk after a failed bigger one: gather is sliced to the chunk's end
    prefill2 = ChunkedPrefill(cache, "f", range(100), noop, policy=ChunkPolicy.fixed(8))
    assert prefill2.run().chunk_sizes == (8, 8, 8, 8, 4)
    cache.check_invariants()


def test_prompt_is_copied_and_chunks_cannot_write_it():
    cache = bookkeeping_cache()
    prompt = np.arange(40, dtype=np.int32)
    prefill = ChunkedPrefill(cache, "w", prompt, lambda c: c.token_ids.__setitem__(0, 7),
                             policy=ChunkPolicy.fixed(8))
    prompt[:] = 0
    with pytest.raises(ValueError, match="read-only"):
        prefill.step()
    assert prefill.prompt.tolist() == list(range(40))


def test_already_prefilled_sequence_returns_at_once():
    cache = bookkeeping_cache()
    chunked_prefill(cache, 3, range(20), noop)
    result = chunked_prefill(cache, 3, range(20), lambda c: pytest.fail("nothing to compute"))
    assert result.num_chunks == 0 and result.output is None and result.resumed_from == 20


def test_resume_checks_the_prompt():
    cache = bookkeeping_cache()
    chunked_prefill(cache, "r", range(40), noop)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "prompt_token_ids: expected the prompt sequence 'r' holds (id 5 at position 5), got id 99")):
        ChunkedPrefill(cache, "r", [0, 1, 2, 3, 4, 99] + list(range(6, 40)), noop)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "prompt_token_ids: expected at least the 40 tokens sequence 'r' has committed, got 10 tokens")):
        ChunkedPrefill(cache, "r", range(10), noop)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache=None), "cache: expected a PagedKVCache, got NoneType"),
    (dict(forward=3), "forward: expected a callable forward(chunk), got int"),
    (dict(prompt=[]), "prompt_token_ids: expected at least one token, got an empty prompt"),
    (dict(on_progress="x"), "on_progress: expected None or a callable, got str"),
    (dict(cancel=True), "cancel: expected None or an object with is_set() (threading.Event), got bool"),
    (dict(policy=512), "policy: expected a ChunkPolicy (an object with next_chunk_size(state)), got int"),
])
def test_invalid_driver_arguments(kwargs, message):
    cache = bookkeeping_cache()
    args = dict(cache=cache, prompt=range(10), forward=noop)
    args.update(kwargs)
    extra = {k: v for k, v in args.items() if k not in ("cache", "prompt", "forward")}
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        ChunkedPrefill(args["cache"], "s", args["prompt"], args["forward"], **extra)
    assert "s" not in cache    # nothing admitted


@pytest.mark.parametrize("size", [0, 11, 2.5, True])
def test_policy_returning_a_bad_size_is_rejected(size):
    class Bad:
        def next_chunk_size(self, state):
            return size

    cache = bookkeeping_cache()
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"policy.next_chunk_size(): expected an int in [1, 10], got {size!r}")):
        chunked_prefill(cache, "s", range(10), noop, policy=Bad())
    assert cache.num_reserved("s") == 0


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 1500), lo=st.integers(1, 200), span=st.integers(0, 300),
       block_size=st.sampled_from([1, 4, 16]), cancel_at=st.integers(0, 8), align=st.booleans())
def test_property_chunks_commit_incrementally_and_resume_exactly(total, lo, span, block_size, cancel_at, align):
    cache = bookkeeping_cache(num_blocks=-(-total // block_size) + 2, block_size=block_size)
    prompt = (np.arange(total) * 31 + 7) % 5000
    policy = ChunkPolicy(lo, lo + span, align_to_blocks=align)
    cancel = threading.Event()
    trace = []

    def forward(chunk):
        assert cache.num_tokens("p") == chunk.start
        assert len(cache.block_table("p")) == -(-chunk.end // block_size)   # blocks for this chunk only
        trace.append(chunk.num_tokens)

    def on_progress(p):
        if p.chunks_done == cancel_at:
            cancel.set()

    try:
        chunked_prefill(cache, "p", prompt, forward, policy=policy, cancel=cancel, on_progress=on_progress)
    except PrefillCancelledError as e:
        assert cache.num_tokens("p") == e.progress.tokens_processed == sum(trace)
        cache.check_invariants()
        chunked_prefill(cache, "p", prompt, forward, policy=policy)
    assert sum(trace) == total and cache.num_tokens("p") == total
    assert all(lo <= n <= lo + span for n in trace[:-1]) and 1 <= trace[-1] <= lo + span
    assert np.array_equal(cache.token_ids("p"), prompt)
    cache.check_invariants()


# ------------------------------------------------------------------ real models
def hf_forward(model, cache):
    """A forward step for a transformers model: past KV read with ``chunk.gather``,
    the chunk's new KV written with ``cache.write``; returns the last token's logits."""
    num_layers = cache.config.num_layers

    @torch.no_grad()
    def forward(chunk: PrefillChunk):
        past = DynamicCache(config=model.config)
        if chunk.start:
            for layer in range(num_layers):
                k, v = chunk.gather(layer)
                past.update(k[: chunk.start].transpose(0, 1)[None], v[: chunk.start].transpose(0, 1)[None], layer)
        ids = torch.from_numpy(chunk.token_ids.astype(np.int64))[None]
        out = model(ids, position_ids=torch.from_numpy(chunk.positions)[None], past_key_values=past,
                    use_cache=True, logits_to_keep=1)
        for layer in range(num_layers):
            lay = past.layers[layer]
            k_new = lay.keys[0, :, chunk.start:].transpose(0, 1).contiguous()
            v_new = lay.values[0, :, chunk.start:].transpose(0, 1).contiguous()
            cache.write(layer, chunk.slot_mapping, k_new, v_new)
        return out.logits[0, -1].float()

    return forward


def model_cache(model, num_blocks):
    return PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, dtype=torch.float32))


@torch.no_grad()
def full_logits(model, ids):
    return model(torch.as_tensor(ids)[None], logits_to_keep=1).logits[0, -1].float()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)[0]


@pytest.mark.parametrize("chunk, length", [(1, 40), (7, 300), (16, 300), (50, 300), (300, 300)])
def test_tiny_llama_chunked_equals_full_prefill(tiny, chunk, length):
    ids = (np.arange(length) * 37) % 256
    cache = model_cache(tiny, 32)
    result = chunked_prefill(cache, "t", ids, hf_forward(tiny, cache), policy=ChunkPolicy.fixed(chunk))
    torch.testing.assert_close(result.output, full_logits(tiny, ids), rtol=0, atol=1e-5)
    assert result.num_chunks == math.ceil(length / chunk)


def test_tiny_llama_dynamic_policy_and_interleaved_sequences(tiny):
    """Two prompts prefilled by alternating step() calls (an engine between decode
    steps) with a memory-aware policy whose headroom shrinks mid-run."""
    cache = model_cache(tiny, 64)
    headroom = [10**9]
    policy = ChunkPolicy(16, 128, memory_probe=lambda: headroom[0], activation_bytes_per_token=1000)
    a_ids, b_ids = (np.arange(400) * 13) % 256, (np.arange(333) * 101 + 5) % 256
    a = ChunkedPrefill(cache, "a", a_ids, hf_forward(tiny, cache), policy=policy)
    b = ChunkedPrefill(cache, "b", b_ids, hf_forward(tiny, cache), policy=policy)
    while not (a.done and b.done):
        a.step()
        b.step()
        headroom[0] = 40_000 if len(a.chunk_sizes) == 3 else 10**9
    assert a.chunk_sizes[:3] == [16, 32, 64] and min(a.chunk_sizes[3:-1]) <= 48
    torch.testing.assert_close(a.result().output, full_logits(tiny, a_ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(b.result().output, full_logits(tiny, b_ids), rtol=0, atol=1e-5)


def test_tiny_llama_cancel_and_resume_equals_uninterrupted(tiny):
    ids = (np.arange(250) * 11) % 256
    cache = model_cache(tiny, 64)
    cancel = threading.Event()
    with pytest.raises(PrefillCancelledError):
        chunked_prefill(cache, "x", ids, hf_forward(tiny, cache), policy=ChunkPolicy.fixed(64), cancel=cancel,
                        on_progress=lambda p: cancel.set())
    resumed = chunked_prefill(cache, "x", ids, hf_forward(tiny, cache), policy=ChunkPolicy.fixed(64))
    straight_cache = model_cache(tiny, 64)
    straight = chunked_prefill(straight_cache, "x", ids, hf_forward(tiny, straight_cache),
                               policy=ChunkPolicy.fixed(64))
    assert resumed.resumed_from == 64 and resumed.chunk_sizes == (64, 64, 58)
    assert torch.equal(resumed.output, straight.output)
    for layer in range(2):
        for got, want in zip(cache.gather("x", layer), straight_cache.gather("x", layer)):
            assert torch.equal(got, want)


# SmolLM2-135M: a ~1,500-token prompt in chunks of 512 (3 chunks).
SMOL_TOKENS = 1500


@pytest.fixture(scope="module")
def smol():
    # No skip: a missing model fails with the loader's error, which says how to fetch it.
    model, tokenizer = load_smollm2()
    sys.path.insert(0, str(Path(__file__).parent))
    from model_fixtures import perplexity_ids

    ids = perplexity_ids(tokenizer, SMOL_TOKENS)[0].numpy()
    return model, ids, full_logits(model, ids)


@pytest.mark.model
def test_smollm2_chunked_prefill_matches_full_prefill(smol):
    model, ids, want = smol
    cache = model_cache(model, 128)
    result = chunked_prefill(cache, "smol", ids, hf_forward(model, cache), policy=ChunkPolicy.fixed(512))
    assert result.chunk_sizes == (512, 512, 476)
    assert result.blocks_after_chunk == (32, 64, 94)
    torch.testing.assert_close(result.output, want, rtol=0, atol=1e-4)
    assert int(result.output.argmax()) == int(want.argmax())


@pytest.mark.model
def test_smollm2_cancel_after_first_chunk_then_resume(smol):
    model, ids, want = smol
    cache = model_cache(model, 128)
    cancel = threading.Event()
    with pytest.raises(PrefillCancelledError, match="cancelled after 1 chunk"):
        chunked_prefill(cache, "smol", ids, hf_forward(model, cache), policy=ChunkPolicy.fixed(512),
                        cancel=cancel, on_progress=lambda p: cancel.set())
    assert cache.num_tokens("smol") == 512
    result = chunked_prefill(cache, "smol", ids, hf_forward(model, cache), policy=ChunkPolicy.fixed(512))
    assert result.resumed_from == 512 and result.chunk_sizes == (512, 476)
    torch.testing.assert_close(result.output, want, rtol=0, atol=1e-4)
