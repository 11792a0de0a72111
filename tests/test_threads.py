"""Thread safety: 8 threads on one PagedKVCache, and on the seed 000/001/002 adapters.

Each worker drives its own sequences at random (so its expectations are exact) while
sharing the cache, its pool and its prefix cache with the others: prompts are drawn
from a few shared prefixes, so threads hit each other's cached blocks. The only
exception a worker may meet is OutOfBlocksError (the pool is kept small so it does).
At the end every count must be conserved (``check_invariants``) and, once everything
is freed, every block must be free again. The GIL switch interval is shortened so the
threads interleave inside the managers' Python code.
"""
import random
import sys
import threading
import traceback

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.compat.block_manager import KVCacheBlockManager
from pagedkv.compat.continuous_batching import ContinuousBatchKVCacheManager, KVCacheConfiguration
from pagedkv.compat.cortex import KVCache
from pagedkv.errors import OutOfBlocksError

THREADS = 8
BS, H, D, LAYERS = 4, 2, 4, 2


@pytest.fixture(autouse=True)
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def run_threads(target, n=THREADS, checker=None):
    """Run ``target(tid, rng)`` on n threads (and ``checker()`` in a loop beside them);
    returns the failures (thread id, traceback) of any exception they let out."""
    errors, stop = [], threading.Event()
    barrier = threading.Barrier(n + (checker is not None))

    def guard(fn, *args):
        try:
            barrier.wait()
            fn(*args)
        except BaseException:
            errors.append((args[0] if args else "checker", traceback.format_exc()))

    def check_loop():
        while not stop.is_set():
            checker()

    threads = [threading.Thread(target=guard, args=(target, t, random.Random(1000 + t))) for t in range(n)]
    if checker is not None:
        threads.append(threading.Thread(target=guard, args=(check_loop,)))
    for t in threads[:n]:
        t.start()
    if checker is not None:
        threads[n].start()
    for t in threads[:n]:
        t.join()
    stop.set()
    for t in threads[n:]:
        t.join()
    return errors


# ---- PagedKVCache ------------------------------------------------------------------------------
PREFIXES = [[(7 * p + i) % 97 + 1 for i in range(4 * BS)] for p in range(3)]


def kv_value(token, pos):
    """K of token ``token`` at position ``pos``: [H, D], exact in float32 (distinct per head)."""
    base = float((token * 1024 + pos) * 8)
    return base + torch.arange(H, dtype=torch.float32).reshape(H, 1).expand(H, D)


class Seq:
    def __init__(self, tokens, computed):
        self.tokens = list(tokens)      # known ids: the prompt, then decoded ones
        self.computed = computed        # == reserved between operations


def cache_worker(cache, tid, rng, ops, with_data, ooms):
    mine = {}
    made = 0

    def grow(sid, n):
        s = mine[sid]
        while len(s.tokens) < s.computed + n:
            s.tokens.append(rng.randrange(1, 200))
        ids = s.tokens[s.computed:s.computed + n]
        slots = cache.reserve([sid], [n])
        if with_data:
            k = torch.stack([kv_value(t, s.computed + i) for i, t in enumerate(ids)])
            for layer in range(LAYERS):
                cache.write(layer, slots, k, -k)
        cache.commit([sid], [n], np.asarray(ids, dtype=np.int32))
        s.computed += n

    def verify(sid):
        s = mine[sid]
        k, v = cache.gather(sid, rng.randrange(LAYERS))
        want = torch.stack([kv_value(t, p) for p, t in enumerate(s.tokens[:s.computed])]) if s.computed \
            else torch.empty(0, H, D)
        assert torch.equal(k, want) and torch.equal(v, -want), f"thread {tid}: KV of {sid!r} corrupted"

    for _ in range(ops):
        op = rng.random()
        try:
            if op < 0.2 or not mine:
                sid = f"t{tid}-{made}" if tid % 2 else tid * 100_000 + made   # interned and int ids
                made += 1
                prompt = rng.choice(PREFIXES)[:rng.randrange(1, 4 * BS)] + [rng.randrange(1, 200)]
                hit = cache.add_sequence(sid, prompt)
                mine[sid] = Seq(prompt, hit)
                assert cache.num_tokens(sid) == hit
                if with_data:
                    verify(sid)           # the cached prefix holds exactly what this thread would write
                grow(sid, len(prompt) - hit)
            elif op < 0.55:
                grow(rng.choice(list(mine)), rng.randrange(1, 2 * BS))
            elif op < 0.65:
                sids = rng.sample(list(mine), min(len(mine), 3))
                counts = [rng.randrange(0, BS) for _ in sids]
                slots = cache.reserve(sids, counts)
                assert len(slots) == sum(counts)
                for sid, n in zip(sids, counts):
                    mine[sid].computed += n
                    while len(mine[sid].tokens) < mine[sid].computed:
                        mine[sid].tokens.append(rng.randrange(1, 200))
                if with_data:
                    start = 0
                    for sid, n in zip(sids, counts):
                        s = mine[sid]
                        first = s.computed - n
                        k = torch.stack([kv_value(s.tokens[first + i], first + i) for i in range(n)]) if n \
                            else torch.empty(0, H, D)
                        for layer in range(LAYERS):
                            cache.write(layer, slots[start:start + n], k, -k)
                        start += n
                ids = [t for sid, n in zip(sids, counts) for t in mine[sid].tokens[mine[sid].computed - n:mine[sid].computed]]
                cache.commit(sids, counts, np.asarray(ids, dtype=np.int32))
            elif op < 0.75:
                src = rng.choice(list(mine))
                dst = f"t{tid}-{made}" if tid % 2 else tid * 100_000 + made
                made += 1
                cache.fork(src, dst)
                mine[dst] = Seq(mine[src].tokens[:mine[src].computed], mine[src].computed)
            elif op < 0.85 and with_data:
                verify(rng.choice(list(mine)))
            else:
                sid = rng.choice(list(mine))
                cache.free([sid])
                del mine[sid]
        except OutOfBlocksError:
            ooms.append(tid)   # all or nothing: the model is unchanged too
    if with_data:
        for sid in list(mine):
            verify(sid)
    for sid in list(mine):
        assert cache.num_tokens(sid) == cache.num_reserved(sid) == mine[sid].computed
    cache.free(list(mine))


@pytest.mark.parametrize("with_store", [False, True], ids=["bookkeeping", "store"])
def test_paged_kv_cache_under_eight_threads(with_store):
    cfg = CacheConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=40,
                      dtype="float32")
    cache = PagedKVCache(cfg, allocate_store=with_store)
    ooms = []

    def checker():
        cache.check_invariants()
        s = cache.stats()
        assert s.allocated_blocks + s.empty_blocks + s.cached_free_blocks == 40

    errors = run_threads(lambda tid, rng: cache_worker(cache, tid, rng, 150, with_store, ooms), checker=checker)
    assert not errors, "\n".join(f"thread {t}:\n{tb}" for t, tb in errors)
    assert ooms, "the pool never ran out: the test did not exercise the failure path"
    cache.check_invariants()
    assert len(cache) == 0 and cache.pool.num_in_use_blocks == 0
    assert cache.pool.num_free_blocks == 40      # every block free again (empty or evictable)
    s = cache.stats()
    assert s.hit_tokens > 0 and s.cow_copies > 0
    assert cache.take_copies().shape[1] == 2


# ---- seed 001: KVCacheBlockManager -----------------------------------------------------------------
def test_block_manager_under_eight_threads():
    m = KVCacheBlockManager(48, BS, D, LAYERS, H, dtype="float32")

    def worker(tid, rng):
        held = {}                                  # block -> marker written into it
        seqs = [tid * 10 + i for i in range(3)]

        def claim(blocks):
            for b in blocks:
                view = m.get_block(b)
                assert view.sequence_id in seqs and view.key_tensor.abs().sum() == 0, f"block {b} not fresh"
                marker = float(tid * 1000 + b)
                view.key_tensor.fill_(marker)
                held[b] = marker

        for _ in range(300):
            op, seq = rng.random(), rng.choice(seqs)
            if op < 0.3:
                r = m.allocate_block(seq)
                if r.success:
                    claim([r.block_id])
            elif op < 0.5:
                claim(m.allocate_blocks(seq, rng.randrange(1, 5)))
            elif op < 0.7 and held:
                b = rng.choice(list(held))
                # (Not a second free here: another thread may own the block by then.)
                assert m.free_block(b)
                del held[b]
            elif op < 0.8:
                for b in m.get_sequence_blocks(seq):
                    del held[b]
                m.free_sequence_blocks(seq)
            else:
                for b, marker in held.items():     # nobody else was handed my blocks
                    assert m.get_block(b).key_tensor.eq(marker).all(), f"block {b} overwritten"
        assert sorted(b for s in seqs for b in m.get_sequence_blocks(s)) == sorted(held)
        for s in seqs:
            m.free_sequence_blocks(s)

    errors = run_threads(worker, checker=m.check_invariants)
    assert not errors, "\n".join(f"thread {t}:\n{tb}" for t, tb in errors)
    m.check_invariants()
    s = m.get_stats()
    assert s.allocated_blocks == 0 and s.active_sequences == 0 and s.total_tokens == 0
    assert s.allocation_count == s.deallocation_count > 0


# ---- seed 000: ContinuousBatchKVCacheManager ----------------------------------------------------------
def test_continuous_batching_manager_under_eight_threads():
    cache = PagedKVCache(CacheConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=BS,
                                     num_blocks=64, dtype="float32"))
    m = ContinuousBatchKVCacheManager(cache, KVCacheConfiguration.for_cache(
        cache, initial_pages_per_request=1, max_pages_per_request=6, target_utilization=0.9))
    ooms, compactions = [], []

    def worker(tid, rng):
        pages = {}                                 # request -> pages it should have
        for i in range(200):
            op = rng.random()
            if op < 0.3 or not pages:
                rid = (tid, i)
                try:
                    m.allocate_cache(rid, rng.randrange(0, 5 * BS))
                except OutOfBlocksError:
                    ooms.append(tid)
                    assert m.get_allocation(rid) is None
                    continue
                pages[rid] = m.get_allocation(rid).page_count
            elif op < 0.55:
                rid = rng.choice(list(pages))
                if m.try_extend_cache(rid, rng.randrange(1, 2 * BS)):
                    assert m.get_allocation(rid).page_count > pages[rid]
                pages[rid] = m.get_allocation(rid).page_count
            elif op < 0.75:
                rid = rng.choice(list(pages))
                assert m.release_cache(rid)
                del pages[rid]
            elif op < 0.85:
                compactions.append(len(m.compact_cache()))
            else:
                for rid, n in pages.items():
                    a = m.get_allocation(rid)
                    assert a.page_count == n and len({p.block_index for p in a.pages}) == n
        for rid in pages:
            assert m.release_cache(rid)

    errors = run_threads(worker, checker=cache.check_invariants)
    assert not errors, "\n".join(f"thread {t}:\n{tb}" for t, tb in errors)
    assert ooms and any(compactions), "the run never ran out of blocks or never compacted"
    cache.check_invariants()
    assert m.get_current_usage_bytes() == 0 and m.requests() == [] and len(cache) == 0
    assert cache.pool.num_free_blocks == 64


# ---- seed 002: CortexStream KVCache ---------------------------------------------------------------------
def test_cortex_cache_under_eight_threads():
    c = KVCache(LAYERS, H, D, BS, 48 * BS, dtype="float32")

    def worker(tid, rng):
        mine = {}
        for i in range(200):
            op = rng.random()
            if op < 0.35 or not mine:
                rid = f"{tid}-{i}"
                if c.allocate_for(rid, rng.randrange(1, 4 * BS)):
                    mine[rid] = float(tid * 1000 + i)
                    c.get_k_view(rid, 0).fill_(mine[rid])
            elif op < 0.6:
                rid = rng.choice(list(mine))
                if c.append_token(rid):
                    c.get_k_view(rid, 0)[:, -1] = mine[rid]
            elif op < 0.8:
                rid = rng.choice(list(mine))
                assert c.free_for(rid)
                del mine[rid]
            else:
                for rid, marker in mine.items():   # runs never overlap another thread's
                    assert c.get_k_view(rid, 0).eq(marker).all(), f"run of {rid} overwritten"
        for rid in mine:
            c.free_for(rid)

    errors = run_threads(worker)
    assert not errors, "\n".join(f"thread {t}:\n{tb}" for t, tb in errors)
    assert c.get_num_allocated_sequences() == 0 and c.allocator.used_blocks() == 0
    assert c.get_fragmentation() == 0.0
