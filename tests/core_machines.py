"""Hypothesis state machines: the Cython core against the pure-Python model.

Used by tests/test_stateful.py (short runs) and fuzz/core_fuzz.py (long runs). Every
step applies the same operation to both implementations, demands the same outcome
(result, or the same error type with the state unchanged), and then checks the
invariants of DESIGN.md.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.errors import PagedKVError
from pagedkv.testing.core_model import PyBlockPool, PyTables

POLICIES = ["lru", "priority", "adaptive", "frequency"]


def same_outcome(fast, slow):
    """Run both; both must succeed with equal results or raise the same error type."""
    try:
        a = fast()
        ea = None
    except PagedKVError as e:  # typed errors only: anything else fails the test
        a, ea = None, type(e)
    try:
        b = slow()
        eb = None
    except PagedKVError as e:
        b, eb = None, type(e)
    assert ea == eb, f"core raised {ea}, model raised {eb}"
    return a, b, ea


def pool_snapshot(pool):
    return (np.asarray(pool.ref_cnt).tolist(), pool.free_lists(),
            [pool.is_cached(b) for b in range(pool.num_blocks)])


def model_snapshot(m):
    return (list(m.ref), [list(lst) for lst in m.lists], list(m.cached))


class PoolMachine(RuleBasedStateMachine):
    """BlockPool vs PyBlockPool under allocate/free/touch/mark_cached/pin/unpin/reset."""

    num_blocks = 24

    def __init__(self):
        super().__init__()
        self.held = []  # block ids, one entry per reference the test holds

    @initialize(policy=st.sampled_from(POLICIES), seed=st.integers(0, 3))
    def setup(self, policy, seed):
        order = np.random.default_rng(seed).permutation(self.num_blocks).tolist()
        self.pool = BlockPool(self.num_blocks, policy, priority_classes=3, low_watermark=0.2,
                              high_watermark=0.4, shuffle_seed=seed)
        self.model = PyBlockPool(self.num_blocks, policy, priority_classes=3, low_watermark=0.2,
                                 high_watermark=0.4, order=order)

    def apply(self, fast, slow):
        before = pool_snapshot(self.pool)
        a, b, err = same_outcome(fast, slow)
        if err is not None:
            assert pool_snapshot(self.pool) == before, "a failed call changed the pool"
        return a, b, err

    @rule(n=st.integers(0, 10))
    def allocate(self, n):
        a, b, err = self.apply(lambda: self.pool.allocate(n).tolist(), lambda: self.model.allocate(n))
        if err is None:
            assert a == b
            self.held += a

    @rule(data=st.data(), cls=st.integers(0, 4))
    def free_some(self, data, cls):
        if not self.held:
            return
        idx = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, max_size=8))
        ids = [self.held[i] for i in idx]
        _, _, err = self.apply(lambda: self.pool.free(np.array(ids, np.int32), cls),
                               lambda: self.model.free(ids, cls))
        assert err is None
        for i in sorted(idx, reverse=True):
            del self.held[i]

    @rule(ids=st.lists(st.integers(-2, 26), min_size=1, max_size=6))
    def free_hostile(self, ids):
        # Random ids: double frees, out of range, duplicates beyond ref_cnt.
        _, _, err = self.apply(lambda: self.pool.free(ids), lambda: self.model.free(ids))
        if err is None:
            for b in ids:
                self.held.remove(b)

    @rule(ids=st.lists(st.integers(-1, 25), max_size=6))
    def touch(self, ids):
        _, _, err = self.apply(lambda: self.pool.touch(ids), lambda: self.model.touch(ids))
        if err is None:
            self.held += ids

    @rule(data=st.data())
    def mark_cached(self, data):
        if not self.held:
            return
        ids = data.draw(st.lists(st.sampled_from(self.held), max_size=4))
        self.apply(lambda: self.pool.mark_cached(ids), lambda: self.model.mark_cached(ids))

    @rule(ids=st.lists(st.integers(0, 23), max_size=4))
    def pin(self, ids):
        self.apply(lambda: self.pool.pin(ids), lambda: self.model.pin(ids))

    @rule(ids=st.lists(st.integers(0, 23), max_size=4))
    def unpin(self, ids):
        self.apply(lambda: self.pool.unpin(ids), lambda: self.model.unpin(ids))

    @rule()
    def reset(self):
        self.apply(self.pool.reset_cache, self.model.reset_cache)

    @rule(bad=st.sampled_from([np.array([1, 2], np.int64), np.array([[1]], np.int32), "x", [1.5], -1]))
    def wrong_types(self, bad):
        before = pool_snapshot(self.pool)
        try:
            if isinstance(bad, int):
                self.pool.allocate(bad)
            else:
                self.pool.free(bad)
        except (TypeError, ValueError) as e:
            assert isinstance(e, PagedKVError), f"untyped error {e!r}"
        else:
            raise AssertionError(f"bad input {bad!r} was accepted")
        assert pool_snapshot(self.pool) == before

    @invariant()
    def agree(self):
        if not hasattr(self, "pool"):
            return
        assert pool_snapshot(self.pool) == model_snapshot(self.model)
        self.pool.check_invariants()
        held = np.bincount(np.asarray(self.held, dtype=np.int64), minlength=self.num_blocks)
        assert held.tolist() == np.asarray(self.pool.ref_cnt).tolist(), "ref_cnt != references held"
        p = self.pool
        assert p.num_empty_blocks + p.num_in_use_blocks + p.num_cached_free_blocks == p.num_blocks
        assert (p.num_allocations, p.num_frees, p.num_touches, p.num_evictions) == (
            self.model.num_allocations, self.model.num_frees, self.model.num_touches, self.model.num_evictions)


# ---------------------------------------------------------------------------------------
ALPHABET = st.integers(0, 2)   # tiny vocabulary: prompts share prefixes constantly


class TablesMachine(RuleBasedStateMachine):
    """BlockTables + PrefixIndex + BlockPool vs PyTables, with a ground-truth KV check.

    Each slot's "KV" is modelled as the (namespace, token prefix) it was computed for;
    copy-on-write copies it. Every prefix hit must land on blocks whose KV equals the
    query's, which is the property "a hit never returns wrong KV".
    """

    num_blocks = 40
    block_size = 4

    @initialize(policy=st.sampled_from(POLICIES), weak=st.booleans(), seed=st.integers(0, 3))
    def setup(self, policy, weak, seed):
        self.build(policy, weak, seed)

    def build(self, policy, weak, seed, window=0, sinks=0):
        nb, bs = self.num_blocks, self.block_size
        self.weak = weak
        self.window, self.sinks = window, sinks
        self.index = PrefixIndex(bs, nb, hash_seed=seed, weak_hash=weak)
        self.pool = BlockPool(nb, policy, priority_classes=3, low_watermark=0.2, high_watermark=0.4,
                              shuffle_seed=seed, index=self.index)
        self.tables = BlockTables(self.pool, bs, self.index, window=window, sinks=sinks)
        order = np.random.default_rng(seed).permutation(nb).tolist()
        self.mpool = PyBlockPool(nb, policy, priority_classes=3, low_watermark=0.2, high_watermark=0.4, order=order)
        self.model = PyTables(self.mpool, bs, window=window, sinks=sinks)
        self.next_key = 0
        self.kv = {}          # slot -> (ns, prefix tuple) actually stored
        self.pending = {}     # key -> list of (slot, position) reserved, not committed
        self.seq_tokens = {}  # key -> planned token list (prompt + future tokens)
        self.seq_ns = {}

    def keys(self):
        return sorted(self.seq_tokens)

    def same(self, fast, slow):
        before = (pool_snapshot(self.pool), {k: self.tables.blocks(k).tolist() for k in self.keys()})
        if self.weak:
            # Collisions make the core legitimately miss where the model hits, so the
            # two diverge; run the core alone and keep the safety and invariant checks.
            slow = lambda: None  # noqa: E731
            try:
                a, err = fast(), None
            except PagedKVError as e:
                a, err = None, type(e)
            b = None
        else:
            a, b, err = same_outcome(fast, slow)
        if err is not None:
            after = (pool_snapshot(self.pool), {k: self.tables.blocks(k).tolist() for k in self.keys()})
            assert after == before, "a failed call changed the tables"
        return a, b, err

    def check_hits(self, key, tokens, ns, cached):
        blocks = self.tables.blocks(key).tolist()
        bs = self.block_size
        for p in range(cached):
            if blocks[p // bs] < 0:
                continue     # released at once: outside the sliding window of the next query
            slot = blocks[p // bs] * bs + p % bs
            assert self.kv.get(slot) == (ns, tuple(tokens[:p + 1])), f"prefix hit returned wrong KV at position {p}"

    @rule(prompt=st.lists(ALPHABET, min_size=0, max_size=14), tail=st.lists(ALPHABET, max_size=8),
          ns=st.integers(0, 1), priority=st.sampled_from([-1, -1, 0, 2]))
    def add(self, prompt, tail, ns, priority):
        key = self.next_key
        self.next_key += 1
        a, b, err = self.same(lambda: self.tables.add(key, np.array(prompt, np.int32), ns, ns * 7919, priority),
                              lambda: self.model.add(key, prompt, ns, priority))
        assert err is None
        self.seq_tokens[key] = list(prompt) + list(tail)
        self.seq_ns[key] = ns
        self.pending[key] = []
        self.check_hits(key, prompt, ns, a)
        assert self.weak or a == b, "prefix hits differ from the model"

    @rule(data=st.data())
    def reserve(self, data):
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=4))
        counts = data.draw(st.lists(st.integers(0, 6), min_size=len(keys), max_size=len(keys)))
        before_res = {k: self.tables.num_reserved(k) for k in keys}
        a, b, err = self.same(lambda: self.tables.reserve(np.array(keys, np.int64), np.array(counts, np.int64)).tolist(),
                              lambda: self.model.reserve(keys, counts))
        if err is not None:
            return
        copies = self.tables.take_copies().tolist()
        if not self.weak:
            assert a == b, "slot mappings differ"
            assert [tuple(c) for c in copies] == self.model.copies
            self.model.copies.clear()
        bs = self.block_size
        for src, dst in copies:     # the manager copies the KV of a CoW block
            for o in range(bs):
                if src * bs + o in self.kv:
                    self.kv[dst * bs + o] = self.kv[src * bs + o]
                else:
                    self.kv.pop(dst * bs + o, None)
        off = 0
        for k, n in zip(keys, counts):
            for j in range(n):
                self.pending[k].append((a[off + j], before_res[k] + j))
            off += n

    @rule(data=st.data())
    def advance(self, data):
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=4))
        before = {k: (self.tables.num_computed(k), self.tables.num_reserved(k)) for k in keys}
        ids = []
        for k in keys:
            pos = before[k][1]
            toks = self.seq_tokens[k]
            known = self.tables.tokens(k).tolist()
            ids.append(known[pos] if pos < len(known) else (toks[pos] if pos < len(toks) else 1))
        # the previous step's KV is written before the step advances
        for k in keys:
            known = self.tables.tokens(k).tolist()
            for slot, pos in self.pending[k]:
                self.kv[slot] = (self.seq_ns[k], tuple(known[:pos + 1])) if pos < len(known) else ("unknown", slot, pos)
        a, b, err = self.same(lambda: self.tables.advance(np.array(keys, np.int64), np.array(ids, np.int32)).tolist(),
                              lambda: self.model.advance(keys, ids))
        if err is not None:
            return
        for k in keys:
            self.pending[k] = []
        copies = self.tables.take_copies().tolist()
        if not self.weak:
            assert a == b, "advance slots differ"
            assert [tuple(c) for c in copies] == self.model.copies
            self.model.copies.clear()
        bs = self.block_size
        for src, dst in copies:
            for o in range(bs):
                if src * bs + o in self.kv:
                    self.kv[dst * bs + o] = self.kv[src * bs + o]
                else:
                    self.kv.pop(dst * bs + o, None)
        for k, slot in zip(keys, a):
            self.pending[k].append((slot, before[k][1]))
            toks = self.seq_tokens[k]
            pos = before[k][1]
            if pos >= len(toks):
                toks += [1] * (pos + 1 - len(toks))
            toks[pos] = ids[keys.index(k)]

    @rule(data=st.data(), with_ids=st.booleans())
    def commit(self, data, with_ids):
        live = [k for k in self.keys() if self.tables.num_reserved(k) > self.tables.num_computed(k)]
        if not live:
            return
        keys = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=3))
        counts = [data.draw(st.integers(1, self.tables.num_reserved(k) - self.tables.num_computed(k))) for k in keys]
        ids = None
        if with_ids:
            ids = []
            for k, n in zip(keys, counts):
                start = self.tables.num_computed(k)
                toks = self.seq_tokens[k]
                ids += [toks[p] if p < len(toks) else 1 for p in range(start, start + n)]
        # the forward pass writes KV for exactly these positions before the commit
        for k, n in zip(keys, counts):
            known = self.seq_tokens[k] + [1] * 64 if with_ids else list(self.tables.tokens(k))
            for slot, pos in self.pending[k][:n]:
                if pos < len(known):
                    self.kv[slot] = (self.seq_ns[k], tuple(known[:pos + 1]))
                else:
                    self.kv[slot] = ("unknown", slot, pos)   # never equal to any query
            del self.pending[k][:n]
        a, b, err = self.same(lambda: self.tables.commit(np.array(keys, np.int64), np.array(counts, np.int64),
                                                         None if ids is None else np.array(ids, np.int32)),
                              lambda: self.model.commit(keys, counts, ids))
        assert err is None
        if with_ids:
            for k, n in zip(keys, counts):
                toks = self.seq_tokens[k]
                while len(toks) < self.tables.num_computed(k):
                    toks.append(1)

    @rule(data=st.data())
    def unreserve(self, data):
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=3))
        counts = [data.draw(st.integers(0, self.tables.num_reserved(k) - self.tables.num_computed(k) + 1)) for k in keys]
        _, _, err = self.same(lambda: self.tables.unreserve(np.array(keys, np.int64), np.array(counts, np.int64)),
                              lambda: self.model.unreserve(keys, counts))
        if err is None:
            for k, n in zip(keys, counts):
                if n:
                    del self.pending[k][-n:]

    @rule(data=st.data(), tail=st.lists(ALPHABET, max_size=6))
    def truncate(self, data, tail):
        """Roll back committed tokens (rejected draft tokens); a later continuation differs."""
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=3))
        counts = [data.draw(st.integers(0, self.tables.num_computed(k) + 1)) for k in keys]
        lengths = {k: self.tables.num_computed(k) - n for k, n in zip(keys, counts)}
        _, _, err = self.same(lambda: self.tables.truncate(np.array(keys, np.int64), np.array(counts, np.int64)),
                              lambda: self.model.truncate(keys, counts))
        if err is not None:
            assert any(n > self.tables.num_computed(k) or self.window_lost(k, n) for k, n in zip(keys, counts))
            return
        for k in keys:
            assert self.tables.num_computed(k) == self.tables.num_reserved(k) == lengths[k]
            assert len(self.tables.tokens(k)) <= lengths[k]
            self.pending[k] = []
            self.seq_tokens[k] = self.seq_tokens[k][:lengths[k]] + list(tail)

    def window_lost(self, k, n):
        """Would dropping n tokens need KV that already left the sliding window?"""
        dropped = self.tables.info(k)["num_dropped_blocks"]
        first_held = (self.tables.sink_blocks + dropped) * self.block_size
        return dropped > 0 and self.tables.num_computed(k) - n - self.window + 1 < first_held

    @rule(data=st.data())
    def fork(self, data):
        if not self.seq_tokens:
            return
        src = data.draw(st.sampled_from(self.keys()))
        dst = self.next_key
        self.next_key += 1
        self.same(lambda: self.tables.fork(src, dst), lambda: self.model.fork(src, dst))
        computed = self.tables.num_computed(src)
        self.seq_tokens[dst] = list(self.seq_tokens[src][:computed]) + [2, 0, 1]
        self.seq_ns[dst] = self.seq_ns[src]
        self.pending[dst] = []

    @rule(data=st.data())
    def remove(self, data):
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=3))
        self.same(lambda: self.tables.remove(np.array(keys, np.int64)), lambda: self.model.remove(keys))
        for k in keys:
            del self.seq_tokens[k], self.seq_ns[k], self.pending[k]

    @rule(keys=st.lists(st.integers(-3, 60), min_size=1, max_size=3))
    def remove_hostile(self, keys):
        if all(k in self.seq_tokens for k in keys) and len(set(keys)) == len(keys):
            return
        self.same(lambda: self.tables.remove(np.array(keys, np.int64)), lambda: self.model.remove(keys))

    @rule(data=st.data(), cls=st.integers(0, 2))
    def set_priority(self, data, cls):
        if not self.seq_tokens:
            return
        k = data.draw(st.sampled_from(self.keys()))
        self.same(lambda: self.tables.set_priority(k, cls, 0, self.block_size * 2),
                  lambda: self.model.set_priority(k, cls, 0, self.block_size * 2))

    @rule(prompt=st.lists(ALPHABET, min_size=4, max_size=12), ns=st.integers(0, 1), pin=st.booleans())
    def pin_prefix(self, prompt, ns, pin):
        blocks = self.index.match(np.array(prompt, np.int32), ns, ns * 7919).tolist()
        if not self.weak:
            assert blocks == self.model.match(prompt, ns)
        bs = self.block_size
        for i, blk in enumerate(blocks):
            for o in range(bs):
                assert self.kv.get(blk * bs + o) == (ns, tuple(prompt[:i * bs + o + 1])), "match() returned wrong KV"
        op = self.pool.pin if pin else self.pool.unpin
        mop = self.mpool.pin if pin else self.mpool.unpin
        self.same(lambda: op(np.array(blocks, np.int32)), lambda: mop(blocks))

    @rule()
    def reset_prefix_cache(self):
        def slow():
            self.mpool.reset_cache()
            for b in list(self.model.reg):
                self.model._unregister(b)
        self.same(self.pool.reset_cache, slow)

    @invariant()
    def agree(self):
        if not hasattr(self, "tables"):
            return
        self.tables.check_invariants()
        if self.weak:
            return   # collisions legitimately cost hits; safety is checked on every add
        assert pool_snapshot(self.pool) == model_snapshot(self.mpool)
        for k in self.keys():
            assert self.tables.blocks(k).tolist() == self.model.rows[k].blocks
            assert self.tables.num_computed(k) == self.model.rows[k].computed
        assert sorted(self.index.cached_blocks().tolist()) == sorted(self.model.reg)


class SlidingTablesMachine(TablesMachine):
    """The same machine over a sliding-window table (optionally with sink tokens).

    Every rule that advances committed tokens releases leading blocks; ``stream``
    drives one sequence far past the window. Besides agreeing with the model, a sliding
    row must hold exactly the blocks its window (plus sinks) needs.
    """

    @initialize(policy=st.sampled_from(POLICIES), weak=st.booleans(), seed=st.integers(0, 3),
                window=st.integers(1, 10), sinks=st.integers(0, 9))
    def setup(self, policy, weak, seed, window, sinks):
        self.build(policy, weak, seed, window, sinks % window)

    @rule(data=st.data(), steps=st.integers(1, 24))
    def stream(self, data, steps):
        """Decode steps of one sequence: reserve one token, write its KV, commit it."""
        if not self.seq_tokens:
            return
        k = data.draw(st.sampled_from(self.keys()))
        for _ in range(steps):
            if self.tables.num_reserved(k) == self.tables.num_computed(k):
                pos = self.tables.num_reserved(k)
                a, b, err = self.same(lambda: self.tables.reserve(k, 1).tolist(), lambda: self.model.reserve([k], 1))
                if err is not None:
                    return
                copies = self.tables.take_copies().tolist()
                if not self.weak:
                    assert a == b and [tuple(c) for c in copies] == self.model.copies
                self.model.copies.clear()
                self.pending[k].append((a[0], pos))
            n = self.tables.num_reserved(k) - self.tables.num_computed(k)
            known = list(self.tables.tokens(k))
            for slot, pos in self.pending[k]:
                self.kv[slot] = (self.seq_ns[k], tuple(known[:pos + 1])) if pos < len(known) else ("unknown", slot, pos)
            self.pending[k] = []
            self.same(lambda: self.tables.commit(k, n), lambda: self.model.commit([k], n))

    @rule(data=st.data(), hold=st.booleans())
    def hold_window(self, data, hold):
        """Speculative decoding: hold released blocks for a rollback, or stop holding."""
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=3))
        self.same(lambda: self.tables.hold_window(np.array(keys, np.int64), hold),
                  lambda: self.model.hold_window(keys, hold))

    @rule(data=st.data())
    def slide(self, data):
        if not self.seq_tokens:
            return
        keys = data.draw(st.lists(st.sampled_from(self.keys()), unique=True, min_size=1, max_size=3))
        self.same(lambda: self.tables.slide(np.array(keys, np.int64)), lambda: self.model.slide(keys))

    @invariant()
    def window_held(self):
        if not hasattr(self, "tables"):
            return
        bs, w = self.block_size, self.window
        for k in self.keys():
            blocks = self.tables.blocks(k).tolist()
            c = self.tables.num_computed(k)
            holding = self.tables.info(k)["holding"]
            first = max(c - w + 1, 0)       # the next query's first visible position
            for i, b in enumerate(blocks):
                needed = i * bs < self.sinks or (i + 1) * bs > first
                if holding:
                    assert b >= 0 or not needed, f"sequence {k}: block {i} released but needed"
                else:
                    assert (b >= 0) == needed, f"sequence {k}: block {i} held={b >= 0}, needed={needed}"
