"""The continuous-batching planner (``pagedkv.sched.batching``): token budget, chunked
prefill, and prefixes shared between requests admitted together (issue 33 item 2).

The engine's forwards are simulated on a bookkeeping-only cache: a prefill chunk or a
decode token is reserved and committed, so the prefix index registers full blocks
exactly as it does under a model.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.config.options import CacheConfig
from pagedkv.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
)
from pagedkv.manager.cache import PagedKVCache
from pagedkv.sched.batching import ATTACHED, PREFILLING, RUNNING, WAITING, ContinuousBatcher, PrefillWork

BS = 4


def make_kv(num_blocks=512, **kw) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS,
                                    num_blocks=num_blocks, **kw), allocate_store=False)


def run_step(kv, plan, tokens_left: dict) -> list:
    """Do what the engine's forwards would: commit each chunk and decode token. Returns
    the ids whose last token this step produced (the caller finishes them)."""
    done = []
    for group in plan.prefill:
        for w in group:
            kv.reserve(w.request_id, w.num_tokens)
            kv.commit(w.request_id, w.num_tokens)
            if w.last:
                tokens_left[w.request_id] -= 1
    for rid in plan.decode:
        kv.reserve(rid, 1)
        kv.commit(rid, 1, [7])
        tokens_left[rid] -= 1
    for rid in list(plan.decode) + [w.request_id for g in plan.prefill for w in g if w.last]:
        if tokens_left[rid] == 0:
            done.append(rid)
    return done


def serve_all(kv, batcher, prompts: dict, max_new=2, limit=1000) -> list:
    """Submit every prompt at once and run steps until all are done; returns the plans."""
    left = {}
    for rid, p in prompts.items():
        batcher.submit(rid, p, max_new)
        left[rid] = max_new
    plans = []
    while len(batcher):
        assert len(plans) < limit
        plan = batcher.schedule()
        plans.append(plan)
        for rid in run_step(kv, plan, left):
            batcher.finish(rid)
    return plans


SYSTEM = list(range(100, 140))             # 40 tokens: 10 full blocks


def test_burst_leader_computes_the_shared_prefix_once():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=8, token_budget=64)
    prompts = {i: SYSTEM + [i, i + 1, i + 2] for i in range(5)}
    assert b.schedule().num_tokens == 0                  # nothing submitted: an empty plan
    for rid, p in prompts.items():
        b.submit(rid, p, 3)
    plan = b.schedule()
    assert plan.admitted == [(0, 0)]
    assert plan.attached == {1: 0, 2: 0, 3: 0, 4: 0}
    assert [[(w.request_id, w.start, w.num_tokens) for w in g] for g in plan.prefill] == [[(0, 0, 43)]]
    assert [b.state(i) for i in range(5)] == [PREFILLING, ATTACHED, ATTACHED, ATTACHED, ATTACHED]
    assert b.leader(1) == 0 and b.leader(0) is None
    left = {i: 3 for i in prompts}
    run_step(kv, plan, left)
    plan = b.schedule()
    # the leader decodes; the others hit its 40 committed tokens and compute 3 each
    assert plan.decode == [0]
    assert plan.admitted == [(1, 40), (2, 40), (3, 40), (4, 40)] and plan.attached == {}
    assert [(w.request_id, w.start, w.num_tokens) for g in plan.prefill for w in g] == \
        [(1, 40, 3), (2, 40, 3), (3, 40, 3), (4, 40, 3)]
    assert plan.num_tokens == 13
    run_step(kv, plan, left)
    assert b.schedule().decode == [0, 1, 2, 3, 4]
    stats = kv.stats()
    assert (stats.hit_tokens, stats.query_tokens) == (160, 215)
    b.close()
    assert len(kv) == 0 and len(b) == 0


def test_without_sharing_every_request_computes_its_own_copy():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=8, token_budget=None, share_prefixes=False)
    for i in range(3):
        b.submit(i, SYSTEM + [i], 2)
    plan = b.schedule()
    assert plan.admitted == [(0, 0), (1, 0), (2, 0)] and plan.attached == {}
    assert plan.prefill_tokens == 123 and len(plan.prefill) == 1
    b.close()


def test_prefix_caching_off_shares_nothing():
    kv = make_kv(enable_prefix_caching=False)
    b = ContinuousBatcher(kv, max_batch=8, token_budget=100)
    assert b.share_prefixes is False
    for i in range(2):
        b.submit(i, SYSTEM + [i], 2)
    assert b.schedule().admitted == [(0, 0), (1, 0)]
    b.close()


def test_budget_chunks_on_block_boundaries_and_decode_goes_first():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=2, token_budget=10)
    b.submit("a", list(range(5)), 4)
    b.submit("b", list(range(50, 80)), 4)
    left = {"a": 4, "b": 4}
    plan = b.schedule()
    # a's whole 5 tokens; b's chunk ends on a block boundary (5 left -> 4)
    assert [(w.request_id, w.start, w.num_tokens) for g in plan.prefill for w in g] == [("a", 0, 5), ("b", 0, 4)]
    run_step(kv, plan, left)
    plan = b.schedule()
    assert plan.decode == ["a"]
    assert [(w.request_id, w.start, w.num_tokens) for g in plan.prefill for w in g] == [("b", 4, 8)]
    assert plan.num_tokens == 9
    run_step(kv, plan, left)
    # a chunk that cannot reach a block boundary takes what the budget leaves
    b2 = ContinuousBatcher(kv, max_batch=1, token_budget=3)
    b2.submit("c", list(range(200, 210)), 1)
    plan = b2.schedule()
    assert [(w.start, w.num_tokens) for g in plan.prefill for w in g] == [(0, 3)]
    b.close()
    b2.close()


def test_cancel_takes_effect_at_the_next_schedule_and_hands_the_prefix_over():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=4, token_budget=17)
    for i in range(3):
        b.submit(i, SYSTEM + [i, i], 2)
    left = {i: 2 for i in range(3)}
    plan = b.schedule()
    assert plan.attached == {1: 0, 2: 0}
    run_step(kv, plan, left)                   # the leader commits 16 tokens (4 blocks)
    b.cancel(0)
    assert b.state(0) == PREFILLING            # not yet
    plan = b.schedule()
    assert plan.cancelled == [0] and 0 not in kv
    # 1 takes over from the 16 committed tokens; 2 now waits for 1
    assert plan.admitted == [(1, 16)] and plan.attached == {2: 1}
    with pytest.raises(SequenceNotFoundError, match=r"request_id: expected a live sequence id, got 0 \(unknown\)"):
        b.state(0)
    run_step(kv, plan, left)
    b.cancel(2)                                # an attached request: nothing to free
    b.finish(1)
    plan = b.schedule()
    assert plan.cancelled == [2] and len(b) == 0
    assert len(kv) == 0
    kv.check_invariants()


def test_request_that_never_fits_raises_and_waits_for_blocks_otherwise():
    kv = make_kv(num_blocks=12)
    b = ContinuousBatcher(kv, max_batch=4, token_budget=100)
    b.submit("big", list(range(60)), 1)
    with pytest.raises(OutOfBlocksError, match=r"out of KV blocks: request 'big' needs 16 block\(s\), 12 free"):
        b.schedule()
    b.cancel("big")
    b.schedule()
    b.submit("x", list(range(30)), 6)          # 9 blocks at worst
    b.submit("y", list(range(300, 330)), 6)    # does not fit beside x: waits
    plan = b.schedule()
    assert plan.admitted == [("x", 0)] and b.state("y") == WAITING
    b.finish("x")
    assert b.schedule().admitted == [("y", 0)]
    b.close()
    assert len(kv) == 0


def test_argument_errors_change_nothing():
    kv = make_kv()
    with pytest.raises(InvalidArgumentError, match=r"kv: expected a PagedKVCache, got dict"):
        ContinuousBatcher({})
    with pytest.raises(InvalidArgumentError, match=r"token_budget: expected None or an int > max_batch \(4\), got 4"):
        ContinuousBatcher(kv, max_batch=4, token_budget=4)
    with pytest.raises(ArgumentTypeError, match=r"max_batch: expected an int, got"):
        ContinuousBatcher(kv, max_batch=2.0)
    with pytest.raises(InvalidArgumentError, match=r"share_prefixes: expected True or False, got 1"):
        ContinuousBatcher(kv, share_prefixes=1)
    with pytest.raises(InvalidArgumentError, match=r"padding: expected a number >= 1, got 0.5"):
        ContinuousBatcher(kv, padding=0.5)
    b = ContinuousBatcher(kv)
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids: expected at least one token, got an empty"):
        b.submit(1, [], 4)
    with pytest.raises(InvalidArgumentError, match=r"max_new_tokens: expected an int >= 1, got 0"):
        b.submit(1, [1, 2], 0)
    with pytest.raises(InvalidArgumentError, match=r"request_id: expected a hashable id, got list"):
        b.submit([1], [1, 2], 1)
    b.submit(1, [1, 2], 1)
    with pytest.raises(SequenceExistsError, match=r"request_id: expected a new sequence id, got 1 \(already live\)"):
        b.submit(1, [3], 1)
    kv.add_sequence("elsewhere")
    with pytest.raises(SequenceExistsError):
        b.submit("elsewhere", [3], 1)
    with pytest.raises(SequenceNotFoundError):
        b.cancel(2)
    with pytest.raises(SequenceNotFoundError):
        b.finish(2)
    assert len(b) == 1 and b.state(1) == WAITING
    kv.free("elsewhere")
    b.close()


def test_prompt_is_copied_at_submit():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=2, token_budget=50)
    p = np.arange(20, dtype=np.int32)
    b.submit(0, p, 1)
    p[:] = 0
    plan = b.schedule()
    assert plan.admitted == [(0, 0)]
    run_step(kv, plan, {0: 1})
    assert kv.token_ids(0).tolist() == list(range(20))
    b.close()


def test_namespaces_do_not_share():
    kv = make_kv()
    b = ContinuousBatcher(kv, max_batch=4, token_budget=100)
    b.submit("a", SYSTEM + [1], 1, cache_salt="tenant-a")
    b.submit("b", SYSTEM + [2], 1, cache_salt="tenant-b")
    b.submit("c", SYSTEM + [3], 1, cache_salt="tenant-a")
    plan = b.schedule()
    assert plan.admitted == [("a", 0), ("b", 0)] and plan.attached == {"c": "a"}
    b.close()


def test_a_leader_whose_block_the_index_refused_is_not_waited_for():
    from pagedkv.testing.caches import weak_hash_cache

    # With the 4-valued test hash, a cached block of another prompt owns the hash of the
    # leader's first block, so the index refuses to register it: the follower cannot hit
    # it, and waiting would only delay it. It is admitted as soon as the leader has
    # computed the shared blocks, while the leader still prefills its own tail.
    kv = weak_hash_cache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=256),
                         allocate_store=False)
    shared = [7, 7, 7, 7]
    target = kv.index.hash_tokens(shared)[0]
    other = next([x, x, x, x] for x in range(100) if x != 7 and kv.index.hash_tokens([x, x, x, x])[0] == target)
    kv.add_sequence("owner", other + [1])
    kv.reserve("owner", 5)
    kv.commit("owner", 5)                       # registers `other`'s block under the shared hash
    b = ContinuousBatcher(kv, max_batch=4, token_budget=6)
    b.submit("lead", shared + list(range(30, 50)), 1)
    b.submit("next", shared + [99], 1)
    plan = b.schedule()
    assert plan.attached == {"next": "lead"}
    run_step(kv, plan, {"lead": 1})             # the leader commits 4 tokens: its block is refused
    assert kv.index.num_collisions >= 1 and kv.match_prefix(shared + [99]) == 0
    plan = b.schedule()
    assert b.state("lead") == PREFILLING and plan.admitted == [("next", 0)] and plan.attached == {}
    b.close()
    kv.free("owner")


# ---- the rules as a state machine -----------------------------------------------------------
PREFIXES = [list(range(1000, 1000 + n)) for n in (0, 3, 9, 17)] + [list(range(2000, 2013))]


class BatcherMachine(RuleBasedStateMachine):
    """Random submissions (prompts built from a few shared prefixes), cancellations,
    finishes and steps. After every step: the budget and the batch hold, an attached
    request waits only on a prefilling leader that owes it blocks the cache lacks, the
    cache's invariants hold, and (with blocks to spare, so nothing is evicted) no
    request ever computes a block another request has computed."""

    @initialize(budget=st.one_of(st.none(), st.integers(5, 40)), max_batch=st.integers(1, 4),
                scarce=st.booleans(), share=st.booleans(), weak=st.booleans())
    def start(self, budget, max_batch, scarce, share, weak):
        from pagedkv.testing.caches import weak_hash_cache

        if budget is not None and budget <= max_batch:
            budget = max_batch + 1
        config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS,
                             num_blocks=40 if scarce else 4096)
        # the weak hash collides constantly: blocks are refused, so sharing can only be
        # checked for safety and progress, not for computing each block once
        self.kv = weak_hash_cache(config, allocate_store=False) if weak else PagedKVCache(config,
                                                                                          allocate_store=False)
        self.scarce, self.share, self.weak = scarce, share, weak
        self.b = ContinuousBatcher(self.kv, max_batch=max_batch, token_budget=budget, share_prefixes=share)
        self.budget, self.max_batch = budget, max_batch
        self.next_id = 0
        self.prompts: dict = {}
        self.salts: dict = {}
        self.left: dict = {}
        self.computed_by: dict = {}      # block chain key -> request that computed it
        self.counted: dict = {}          # request -> block indexes counted
        self.admitted_hits = 0
        self.admitted_queries = 0

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(0, 3), max_size=6),
          max_new=st.integers(1, 3), salt=st.sampled_from([None, None, "s"]))
    def submit(self, prefix, tail, max_new, salt):
        prompt = PREFIXES[prefix] + tail
        if not prompt:
            prompt = [5]
        rid = self.next_id
        self.next_id += 1
        self.b.submit(rid, prompt, max_new, cache_salt=salt)
        self.prompts[rid], self.salts[rid], self.left[rid] = prompt, salt, max_new

    @precondition(lambda self: len(self.b))
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.b._requests)))
        self.b.cancel(rid)

    @rule()
    def step(self):
        try:
            plan = self.b.schedule()
        except OutOfBlocksError:
            assert self.scarce
            head = next(r for r in self.b._waiting)
            self.b.cancel(head.rid)       # it can never fit: the engine gives up on it
            return
        live = set(self.b._requests)
        assert (plan.num_tokens > 0) == bool(live) or not live
        if self.budget is not None:
            assert plan.num_tokens <= self.budget
        assert sum(self.b.state(r) != WAITING for r in live) <= self.max_batch
        for rid, cached in plan.admitted:
            self.admitted_hits += cached
            self.admitted_queries += len(self.prompts[rid])
        for rid, leader in plan.attached.items():
            assert self.share and self.b.state(rid) == ATTACHED and self.b.state(leader) == PREFILLING
            assert self.salts[rid] == self.salts[leader]
            p, q = self.prompts[rid], self.prompts[leader]
            common = next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
            owed = min(common // BS * BS, (len(p) - 1) // BS * BS)
            assert self.kv.num_tokens(leader) < owed
            assert self.kv.match_prefix(p, cache_salt=self.salts[rid]) < owed
        for group in plan.prefill:
            for w in group:
                assert isinstance(w, PrefillWork) and self.b.state(w.request_id) == PREFILLING
                assert w.start == self.kv.num_tokens(w.request_id)
                self.note_computed(w)
        for rid in plan.decode:
            assert self.b.state(rid) == RUNNING
        for rid in run_step(self.kv, plan, self.left):
            self.b.finish(rid)

    def note_computed(self, w):
        p = self.prompts[w.request_id]
        cap = (len(p) - 1) // BS                      # blocks a later request could hit
        seen = self.counted.setdefault(w.request_id, set())
        for blk in range(w.start // BS, min(cap, -(-w.end // BS))):
            if blk in seen:
                continue
            seen.add(blk)
            key = (self.salts[w.request_id], tuple(p[:(blk + 1) * BS]))
            if not (self.scarce or self.weak) and self.share:
                assert key not in self.computed_by, (key, self.computed_by.get(key), w)
            self.computed_by[key] = w.request_id

    @invariant()
    def cache_is_consistent(self):
        if hasattr(self, "kv"):
            self.kv.check_invariants()
            assert self.kv.stats().hit_tokens == self.admitted_hits
            assert self.kv.stats().query_tokens == self.admitted_queries

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        steps = 0
        while len(self.b):               # every request finishes: nothing waits forever
            steps += 1
            assert steps < 2000
            self.step()
        assert len(self.kv) == 0 and self.kv.stats().allocated_blocks == 0
        self.kv.check_invariants()


TestBatcherRules = BatcherMachine.TestCase
TestBatcherRules.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
