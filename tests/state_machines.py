"""Hypothesis state machine: a cache with recurrent-state layers against its ground truth.

Used by tests/test_stateful.py. Every sequence's state is written as a function of the
tokens it covers (:func:`pagedkv.testing.state_model.state_of`), so after every step
each sequence's state must read back as the state of exactly its committed tokens: a
prefix hit, a fork, a rollback or an eviction that handed out the wrong state shows.
While nothing was evicted, admissions must resume exactly where the oracle says (the
longest prefix with a snapshot the checkpoint rule took). Failed calls (out of blocks,
out of state slots) must change nothing.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfBlocksError
from pagedkv.testing.state_model import StateOracle, state_of

ALPHABET = st.integers(1, 3)
BS = 4
EVERY = 2
SALTS = [None, "tenant"]


class StateCacheMachine(RuleBasedStateMachine):
    """PagedKVCache with two state layers and one attention layer, 4-token blocks."""

    @initialize(policy=st.sampled_from(["lru", "priority", "frequency"]), slots=st.integers(3, 10))
    def setup(self, policy, slots):
        cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, num_blocks=96, dtype="float32",
                          eviction=policy, layer_kinds=("state", "attention", "state"),
                          state_tensors=[("conv", (2, 3)), ("ssm", (2, 2))], state_slots=slots,
                          state_checkpoint_every=EVERY)
        self.kv = PagedKVCache(cfg)
        self.spec = cfg.state_spec
        self.oracle = StateOracle(BS, EVERY)
        self.next_id = 0
        self.prompts = []          # prompts seen, to reuse as prefixes
        self.pins = []             # (prompt, salt) pinned, once per pin

    def teardown(self):
        kv = getattr(self, "kv", None)
        if kv is not None:
            kv.free(list(self.oracle.seqs))
            kv.check_invariants()
            assert kv.stats().states.live_slots == 0

    # ---- helpers ----------------------------------------------------------------------------
    def _evicted(self) -> bool:
        st_ = self.kv.stats()
        return bool(st_.states.snapshots_evicted or st_.eviction_count)

    def _check_state(self, sid) -> None:
        want = self.oracle.state_tokens(sid)
        assert self.kv.num_tokens(sid) == len(want)
        assert int(self.kv.state_positions(sid)[0]) == len(want)
        for layer in range(2):
            got = self.kv.read_state(sid, layer)
            exp = state_of(self.spec, [want], layer) if want else {k: torch.zeros_like(v) for k, v in got.items()}
            for name in got:
                assert torch.equal(got[name], exp[name]), (sid, name, len(want))

    def _snapshot(self):
        st_ = self.kv.stats().states
        return (st_.free_slots, st_.snapshots, {s: (self.kv.num_tokens(s), int(self.kv.state_slots(s)[0]))
                                                for s in self.oracle.seqs})

    # ---- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), tail=st.lists(ALPHABET, min_size=1, max_size=10), salt=st.sampled_from(SALTS))
    def add(self, data, tail, salt):
        head = data.draw(st.sampled_from(self.prompts)) if self.prompts and data.draw(st.booleans()) else []
        cut = data.draw(st.integers(0, len(head)))
        prompt = head[:cut] + tail
        want, chain = self.oracle.expected_hit(prompt, salt)
        sid = self.next_id
        self.next_id += 1
        hit = self.kv.add_sequence(sid, prompt, cache_salt=salt)
        assert hit % BS == 0 and hit <= len(prompt) - 1
        if hit:
            assert (salt, tuple(prompt[:hit])) in self.oracle.snapshots     # only where a snapshot was taken
        if not self._evicted():
            assert hit == want, (prompt, hit, want)
        self.oracle.add(sid, prompt, salt, hit, chain if not self._evicted() else 0)
        self.prompts.append(prompt)
        self._check_state(sid)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data(), n=st.integers(1, 9), gen=st.lists(ALPHABET, max_size=9))
    def step(self, data, n, gen):
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        s = self.oracle.seqs[sid]
        known = len(s.tokens) - s.pos
        new = gen[:max(0, n - known)] if n > known else []
        n = min(n, known + len(new))
        if n == 0:
            return
        before = self._snapshot()
        try:
            self.kv.reserve(sid, n)
        except OutOfBlocksError:        # OutOfStateSlotsError included: nothing changed
            assert self._snapshot() == before
            return
        tokens = s.tokens + new
        for layer in range(2):
            self.kv.write_state(sid, layer, state_of(self.spec, [tokens[:s.pos + n]], layer))
        self.kv.commit(sid, n, tokens[s.pos:s.pos + n] if new else None)
        s.tokens = tokens
        self.oracle.commit(sid, n, prefill=not new)
        self._check_state(sid)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def failed_step(self, data, n):
        """A step that writes its states, then is given back (a failed forward pass)."""
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        try:
            self.kv.reserve(sid, n)
        except OutOfBlocksError:
            return
        for layer in range(2):
            self.kv.write_state(sid, layer, state_of(self.spec, [[9] * 3], layer))
        self.kv.unreserve(sid)
        pos = self.kv.num_tokens(sid)
        assert pos <= self.oracle.seqs[sid].pos
        self.oracle.rewound(sid, pos, self.kv.token_ids(sid).tolist())
        self._check_state(sid)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        dst = self.next_id
        self.next_id += 1
        self.kv.fork(src, dst)
        self.oracle.fork(src, dst, self.kv.token_ids(dst).tolist())
        self._check_state(dst)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data(), n=st.integers(0, 6))
    def truncate(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        s = self.oracle.seqs[sid]
        n = min(n, s.pos)
        if s.pos != len(s.tokens):
            return          # known prompt tokens beyond the committed ones: a rollback is of computed tokens
        self.kv.truncate(sid, n)
        pos = self.kv.num_tokens(sid)
        assert pos <= s.pos - n
        self.oracle.rewound(sid, pos, self.kv.token_ids(sid).tolist())
        self._check_state(sid)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data(), on=st.booleans())
    def record(self, data, on):
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        self.kv.hold_window(sid, on)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        self.kv.free(sid)
        self.oracle.free(sid)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), salt=st.sampled_from(SALTS))
    def pin(self, data, salt):
        prompt = data.draw(st.sampled_from(self.prompts))
        if self.kv.match_prefix(prompt, cache_salt=salt):
            self.kv.pin_prefix(prompt, cache_salt=salt)
            self.pins.append((prompt, salt))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        prompt, salt = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.kv.unpin_prefix(prompt, cache_salt=salt)

    @invariant()
    def consistent(self):
        kv = getattr(self, "kv", None)
        if kv is None:
            return
        kv.check_invariants()
        st_ = kv.stats().states
        assert st_.free_slots + np.count_nonzero(kv._groups.slots.ref) == st_.total_slots
        for sid in self.oracle.seqs:
            self._check_state(sid)


class TieredStateMachine(StateCacheMachine):
    """The same with a host prefix tier and a host swap pool: prefixes leave the device
    (blocks to the host tier, snapshots dropped from the pool: only the tier's copies
    remain) and sequences are swapped out and back. Every state must still read back as
    the state of exactly its tokens, and every hit must end where a snapshot was taken."""

    @initialize(policy=st.sampled_from(["lru", "priority", "frequency"]), slots=st.integers(3, 10))
    def setup(self, policy, slots):
        cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, num_blocks=48, dtype="float32",
                          eviction=policy, layer_kinds=("state", "attention", "state"),
                          state_tensors=[("conv", (2, 3)), ("ssm", (2, 2))], state_slots=slots,
                          state_checkpoint_every=EVERY, prefix_host_blocks=64, host_num_blocks=48)
        self.kv = PagedKVCache(cfg)
        self.spec = cfg.state_spec
        self.oracle = StateOracle(BS, EVERY)
        self.next_id = 0
        self.prompts = []
        self.pins = []

    @rule()
    def flush(self):
        """Every unheld prefix block goes down to the host tier; the pool's snapshots are
        dropped (those no sequence shares free their slots)."""
        kv = self.kv
        kv.add_sequence("flush")
        try:
            while True:
                kv.reserve("flush", BS)
        except OutOfBlocksError:
            pass
        kv.free("flush")
        snaps = kv._groups.snapshots
        for s in snaps.snapshots():
            if not s.pins:
                snaps.remove(s)

    @precondition(lambda self: self.oracle.seqs)
    @rule(data=st.data())
    def swap(self, data):
        sid = data.draw(st.sampled_from(sorted(self.oracle.seqs)))
        try:
            self.kv.swap_out(sid)
        except OutOfBlocksError:
            return
        try:
            self.kv.swap_in(sid)
        except OutOfBlocksError:
            # its state slot was shared (a fork, a hit): back alone it needs one, and every
            # slot is held; it stays swapped out, and freeing it drops its host copy
            assert self.kv.stats().states.free_slots == 0
            self.kv.free(sid)
            self.oracle.free(sid)
            return
        self._check_state(sid)
