"""Recurrent-state layers in the manager: the spec, the state pool, snapshots and the hit
rule every group agrees on (pagedkv.state, pagedkv.manager.states)."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError
from pagedkv.groups.spec import SPEC_TYPES, RecurrentStateSpec, StateTensor
from pagedkv.state.tables import OutOfStateSlotsError
from pagedkv.testing import weak_hash_cache
from pagedkv.testing.state_model import state_of

BS = 4
KINDS = ("state", "attention", "state")
TENSORS = [("conv", (3, 4)), ("ssm", (2, 2, 2))]


def config(**kw):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=64, dtype="float32",
                layer_kinds=KINDS, state_tensors=TENSORS, state_slots=16, state_checkpoint_every=2)
    return CacheConfig(**(base | kw))


def step(kv, sid, tokens, n, new=False):
    """Reserve ``n`` tokens of ``sid``, write the states of ``tokens[:pos + n]``, commit."""
    pos = kv.num_tokens(sid)
    kv.reserve(sid, n)
    for layer in range(2):
        kv.write_state(sid, layer, state_of(kv.config.state_spec, [tokens[:pos + n]], layer))
    kv.commit(sid, n, tokens[pos:pos + n] if new else None)


def assert_state(kv, sid, tokens):
    """The sequence's state is the state of exactly ``tokens``."""
    for layer in range(2):
        got = kv.read_state(sid, layer)
        want = state_of(kv.config.state_spec, [tokens], layer) if tokens else {k: torch.zeros_like(v)
                                                                              for k, v in got.items()}
        for name in got:
            assert torch.equal(got[name], want[name]), (name, len(tokens))


# ---- the spec and the config -------------------------------------------------------------------
def test_spec_type_and_bytes():
    cfg = config()
    spec = cfg.state_spec
    assert SPEC_TYPES["state"] is RecurrentStateSpec
    assert isinstance(spec, RecurrentStateSpec) and spec.layers == (0, 2)
    assert spec.tensors == (StateTensor("conv", (3, 4), "float32"), StateTensor("ssm", (2, 2, 2), "float32"))
    assert spec.layer_bytes() == (12 + 8) * 4 and spec.slot_bytes() == 2 * 80
    assert cfg.state_bytes == 16 * 160
    assert spec.kind == "state(conv [3, 4] float32, ssm [2, 2, 2] float32)"
    assert spec.token_bytes() == 0 and spec.blocks_held(1000) == 0
    assert (cfg.kv_layer_of(1), cfg.kv_layer_of(0), cfg.state_layer_of(2), cfg.state_layer_of(1)) == (0, None, 1, None)
    assert spec.fingerprint()["tensors"] == [["conv", [3, 4], "float32"], ["ssm", [2, 2, 2], "float32"]]


def test_state_budget_in_bytes():
    cfg = config(state_slots=None, state_memory_budget="1KiB")
    assert cfg.resolved_state_slots == 1024 // 160 and cfg.state_memory_budget == 1024


@pytest.mark.parametrize("kw, err, match", [
    (dict(state_slots=None), InvalidArgumentError,
     "state_slots: expected exactly one of state_slots or state_memory_budget with recurrent-state layers, got "
     "neither"),
    (dict(state_memory_budget=100), InvalidArgumentError, "state_slots: expected exactly one of .* got both"),
    (dict(state_slots=None, state_memory_budget=10), InvalidArgumentError,
     r"state_memory_budget: expected at least one state slot \(160 bytes\), got 10 bytes"),
    (dict(layer_kinds=("state", "mlp")), InvalidArgumentError,
     "layer_kinds: expected 'attention', 'state', 'hybrid', 'none' entries, got 'mlp' at index 1"),
    (dict(layer_kinds=("state", "attention", "attention")), InvalidArgumentError,
     "num_layers: expected the 2 layers with attention in layer_kinds"),
    (dict(state_tensors=[]), InvalidArgumentError, "state_tensors: expected tensors exactly when"),
    (dict(state_tensors=[("conv", (0, 4))]), InvalidArgumentError, "state_tensors: expected a shape of ints >= 1"),
    (dict(state_tensors=[("conv", (3,), "int8")]), InvalidArgumentError, "state_tensors: expected a model dtype"),
    (dict(state_tensors=["conv"]), ArgumentTypeError, "state_tensors: expected .name, shape"),
    (dict(state_checkpoint_every=0), InvalidArgumentError, "state_checkpoint_every: expected an int >= 1"),
    (dict(layer_kinds=None), InvalidArgumentError, "state_tensors: expected tensors exactly when"),
])
def test_config_refusals(kw, err, match):
    with pytest.raises(err, match=match):
        config(**kw)


def test_a_model_without_attention_layers_needs_num_blocks():
    with pytest.raises(InvalidArgumentError, match="memory_budget: expected None without attention layers"):
        CacheConfig(num_layers=0, num_kv_heads=1, head_dim=1, memory_budget="1MiB", layer_kinds=("state",),
                    state_tensors=TENSORS, state_slots=4)
    with pytest.raises(InvalidArgumentError, match="num_layers: expected an int >= 1"):
        CacheConfig(num_layers=0, num_kv_heads=1, head_dim=1, num_blocks=4)


# ---- hits ------------------------------------------------------------------------------------------
def test_hit_at_exactly_a_snapshot_and_short_prompts_hit():
    kv = PagedKVCache(config())
    a = [5, 6, 7, 8, 9, 10]                      # 6 tokens: shorter than any state page, 1 full block
    kv.add_sequence("a", a)
    step(kv, "a", a, 4)                           # a prefill chunk ending on the block boundary: a snapshot
    step(kv, "a", a, 2)
    assert kv.stats().states.snapshots == 1
    b = a[:4] + [1, 2, 3]
    assert kv.add_sequence("b", b) == 4
    assert_state(kv, "b", b[:4])
    assert kv.stats().states.snapshot_hits == 1
    kv.free(["a", "b"])


def test_a_kv_only_hit_never_advances_a_request():
    kv = PagedKVCache(config())
    a = list(range(1, 11))
    kv.add_sequence("a", a)
    step(kv, "a", a, 10)                          # one chunk: the state exists at 10 only, the KV chain at 4, 8
    kv.free("a")
    assert kv.match_prefix_groups(a + [1])["per_group"][0] == 8
    assert kv.add_sequence("b", a + [1]) == 0     # no snapshot on a block boundary: nothing is skipped
    assert kv.match_prefix_groups(a + [1]) == {"tokens": 0, "per_group": [8, 0], "limited_by": 1}
    assert kv.stats().group_hit_limits[-1] == 1
    assert_state(kv, "b", [])
    kv.free("b")


def test_a_deleted_snapshot_gives_a_shorter_hit_with_the_right_state():
    kv = PagedKVCache(config())
    a = list(range(1, 14))
    kv.add_sequence("a", a)
    for n in (4, 4, 4, 1):                        # chunks on the boundaries: snapshots at 4, 8, 12
        step(kv, "a", a, n)
    kv.free("a")
    assert kv.add_sequence("b", a + [7]) == 12
    kv.free("b")
    snaps = kv._groups.snapshots
    snaps.remove(next(s for s in snaps.snapshots() if len(s.tokens) == 12))
    assert kv.add_sequence("c", a + [7]) == 8
    assert_state(kv, "c", a[:8])
    kv.free("c")


def test_a_snapshot_of_another_prefix_is_never_served():
    """Colliding digests (a weak hash): the tokens are compared, the collision is a miss."""
    kv = weak_hash_cache(config())
    a, b = [1, 2, 3, 4, 5], [2, 1, 3, 4, 5]
    kv.add_sequence("a", a)
    step(kv, "a", a, 4)
    kv.free("a")
    kv.add_sequence("b", b)
    assert kv.num_tokens("b") == 0
    assert kv._groups.states.lookup(np.array(b, np.int32), 0, kv._groups.state_namespace(0, 0)[1], 1).boundaries == ()
    kv.free("b")
    # the same key forced onto another prefix's tokens: the lookup refuses it
    snaps = kv._groups.snapshots
    s = snaps.snapshots()[0]
    s.tokens = np.array(b[:4], np.int32)
    fails = snaps.num_verify_failures
    assert kv.add_sequence("a2", a) == 0
    assert snaps.num_verify_failures > fails
    kv.free("a2")


def test_namespaces_do_not_share_states():
    kv = PagedKVCache(config())
    a = list(range(1, 10))
    kv.add_sequence("a", a, cache_salt="x")
    step(kv, "a", a, 8)
    kv.free("a")
    assert kv.add_sequence("b", a, cache_salt="y") == 0
    assert kv.add_sequence("c", a, cache_salt="x") == 8
    kv.free(["b", "c"])


def test_checkpoints_every_n_blocks_at_chunk_ends_and_junctions():
    kv = PagedKVCache(config(state_checkpoint_every=2))
    a = list(range(1, 30))
    kv.add_sequence("a", a[:1])
    step(kv, "a", a, 1)
    for _ in range(8):
        step(kv, "a", a, 1, new=True)             # decode steps: periodic snapshots only (at 8)
    assert [len(s.tokens) for s in kv._groups.snapshots.snapshots()] == [8]
    kv.free("a")
    assert kv.add_sequence("a", a) == 8
    step(kv, "a", a, 1)                           # a prompt chunk ending off a boundary: none
    step(kv, "a", a, 3)                           # a prompt chunk ending on a boundary (12): a snapshot
    assert sorted(len(s.tokens) for s in kv._groups.snapshots.snapshots()) == [8, 12]
    assert kv.next_checkpoint("a") == 16
    step(kv, "a", a, 8)                           # 20, a chunk end
    kv.free("a")
    kv._groups.snapshots.remove(next(s for s in kv._groups.snapshots.snapshots() if len(s.tokens) == 20))
    # a later request: the chain holds 20 tokens, the states 12: a junction snapshot is due at 20
    b = a[:26]
    assert kv.add_sequence("b", b) == 12
    assert kv.next_checkpoint("b") == 16
    assert kv.sequence_info("b")["state"]["next_checkpoint"] == 16
    step(kv, "b", b, 4)
    assert kv.next_checkpoint("b") == 20          # the junction, before the periodic 24
    step(kv, "b", b, 4)
    assert kv.next_checkpoint("b") == 24
    assert sorted(len(s.tokens) for s in kv._groups.snapshots.snapshots()) == [8, 12, 16, 20]
    kv.free("b")


# ---- slots, eviction, pins ---------------------------------------------------------------------
def _fill(kv, prompts):
    for i, p in enumerate(prompts):
        kv.add_sequence(i, p)
        step(kv, i, p, 4)
        kv.free(i)


def test_out_of_state_slots_is_typed_and_changes_nothing():
    kv = PagedKVCache(config(state_slots=2))
    kv.add_sequence("a", [1, 2, 3])
    kv.add_sequence("b", [1, 2, 4])
    kv.add_sequence("c", [1, 2, 5])
    kv.reserve(["a", "b"], 1)
    before = (kv.stats().allocated_blocks, kv.num_reserved("c"))
    with pytest.raises(OutOfStateSlotsError, match=r"out of state slots: reserve needs 1 slot\(s\), 0 free"):
        kv.reserve("c", 1)
    assert issubclass(OutOfStateSlotsError, OutOfBlocksError) and issubclass(OutOfStateSlotsError, MemoryError)
    assert (kv.stats().allocated_blocks, kv.num_reserved("c")) == before
    kv.free(["a", "b", "c"])


@pytest.mark.parametrize("policy", ["lru", "priority", "frequency"])
def test_eviction_takes_unshared_unpinned_snapshots_in_policy_order(policy):
    kv = PagedKVCache(config(state_slots=3, eviction=policy))
    p = [[1, 1, 1, 1, 9], [2, 2, 2, 2, 9], [3, 3, 3, 3, 9]]
    _fill(kv, p)
    assert kv.stats().states.snapshots == 3
    kv.pin_prefix(p[0])                           # pinned: never evicted
    hit = kv.add_sequence("h", p[1]) == 4         # a hit: p[1] is the most used, most recent
    assert hit
    kv.free("h")
    kv.add_sequence("x", [7, 7, 7, 7, 7])
    kv.reserve("x", 5)                            # needs a slot: one snapshot goes
    left = sorted(s.tokens[0] for s in kv._groups.snapshots.snapshots())
    assert left == [1, 2]                         # p[2]: unpinned, least recent and least used
    assert kv.stats().states.snapshots_evicted == 1
    kv.free("x")
    kv.unpin_prefix(p[0])


def test_priority_evicts_the_lowest_class_first():
    kv = PagedKVCache(config(state_slots=3, eviction="priority"))
    for i, prio in enumerate([2, 0, 1]):
        kv.add_sequence(i, [i + 1] * 5, priority=prio)
        step(kv, i, [i + 1] * 5, 4)
        kv.free(i)
    kv.add_sequence("x", [9] * 5)
    kv.reserve("x", 1)
    assert sorted(s.priority for s in kv._groups.snapshots.snapshots()) == [1, 2]
    kv.free("x")


def test_reset_prefix_cache_drops_snapshots():
    kv = PagedKVCache(config())
    _fill(kv, [[1, 2, 3, 4, 5]])
    kv.reset_prefix_cache()
    assert kv.stats().states.snapshots == 0 and kv.stats().states.free_slots == 16


# ---- forks, rollback ---------------------------------------------------------------------------------
def test_fork_shares_the_state_and_copies_before_a_write():
    kv = PagedKVCache(config())
    a = [1, 2, 3, 4, 5, 6]
    kv.add_sequence("a", a)
    step(kv, "a", a, 3)
    kv.fork("a", "b")
    assert kv.state_slots("a")[0] == kv.state_slots("b")[0]
    step(kv, "b", a[:3] + [9], 1, new=True)
    assert kv.state_slots("a")[0] != kv.state_slots("b")[0]
    assert_state(kv, "a", a[:3])                  # the source is untouched
    assert_state(kv, "b", a[:3] + [9])
    assert kv.stats().states.state_copies >= 1
    kv.free(["a", "b"])


def test_rollback_resumes_from_the_restore_point_and_says_what_to_recompute():
    kv = PagedKVCache(config())
    a = [1, 2, 3, 4, 5]
    kv.add_sequence("a", a)
    step(kv, "a", a, 4)
    step(kv, "a", a, 1)
    kv.hold_window("a", True)                     # record the past: a restore point per step
    draft = a[:5] + [8, 8, 8]
    step(kv, "a", draft, 3, new=True)             # a speculative step of 3 draft tokens
    kv.truncate("a", 2)                           # 1 accepted: the state cannot stop at 6
    assert kv.num_tokens("a") == 5                # resumes at the restore point: 1 token to compute again
    assert_state(kv, "a", a[:5])
    assert kv.stats().states.recomputed_tokens == 1
    kv.hold_window("a", False)
    step(kv, "a", a + [8], 1, new=True)
    kv.truncate("a", 1)                           # no restore point: back to the snapshot at 4
    assert kv.num_tokens("a") == 4
    assert_state(kv, "a", a[:4])
    kv.free("a")


def test_a_step_given_back_after_its_state_was_written_resumes_where_a_state_is_kept():
    kv = PagedKVCache(config())
    a = [1, 2, 3, 4, 5, 6]
    kv.add_sequence("a", a)
    step(kv, "a", a, 4)
    step(kv, "a", a, 1)
    kv.reserve("a", 1)
    kv.write_state("a", 0, state_of(kv.config.state_spec, [[0]], 0))
    kv.unreserve("a")
    assert kv.num_tokens("a") == 4                # its live state was overwritten: the snapshot at 4
    assert_state(kv, "a", a[:4])
    kv.free("a")


# ---- the data calls ------------------------------------------------------------------------------------
def test_write_state_needs_a_reserved_unshared_slot():
    kv = PagedKVCache(config())
    kv.add_sequence("a", [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="seq_ids: expected sequences reserved this step .* got 'a' "
                                                   "with no state slot"):
        kv.write_state("a", 0, state_of(kv.config.state_spec, [[1]], 0))
    kv.reserve("a", 1)
    with pytest.raises(InvalidArgumentError, match="layer: expected a state layer in"):
        kv.write_state("a", 2, state_of(kv.config.state_spec, [[1]], 0))
    with pytest.raises(InvalidArgumentError, match="states: expected the tensors"):
        kv.write_state("a", 0, {"conv": torch.zeros(1, 3, 4)})
    kv.free("a")


def test_state_calls_on_a_cache_without_states_are_refused():
    kv = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4))
    with pytest.raises(InvalidArgumentError, match="config.layer_kinds: expected recurrent-state layers"):
        kv.state_slots([])


def test_a_model_without_attention_layers():
    cfg = CacheConfig(num_layers=0, num_kv_heads=1, head_dim=1, num_blocks=64, block_size=BS,
                      layer_kinds=("state", "state"), state_tensors=TENSORS, state_slots=8)
    kv = PagedKVCache(cfg)
    a = list(range(1, 10))
    kv.add_sequence("a", a)
    step(kv, "a", a, 8)
    kv.free("a")
    assert kv.add_sequence("b", a) == 8
    assert_state(kv, "b", a[:8])
    kv.free("b")


def test_bookkeeping_only_cache_owes_state_copies():
    kv = PagedKVCache(config(), allocate_store=False)
    kv.add_sequence("a", [1, 2, 3, 4, 5])
    kv.reserve("a", 4)
    kv.commit("a", 4)
    kv.fork("a", "b")
    kv.reserve("b", 1)
    copies, zeroed = kv.take_state_copies()
    a, b = int(kv.state_slots("a")[0]), int(kv.state_slots("b")[0])
    assert zeroed == [a] and copies == [(a, b)]
    kv.free(["a", "b"])


def test_stats_describe_the_state_pool():
    kv = PagedKVCache(config())
    _fill(kv, [[1, 2, 3, 4, 5]])
    s = kv.stats()
    assert s.states.snapshots == 1 and s.states.slot_bytes == 160 and s.states.bytes_in_use == 160
    assert "State pool: 1/16 slots in use (0 held by sequences, 1 snapshots, 0 pinned)" in s.describe()


def test_a_superseded_snapshot_is_evicted_before_the_chains_newest():
    """A chat's earlier checkpoints go before its newest snapshot (and before another
    chain's), whatever their recency: a request extending the chain resumes from the
    deepest one."""
    kv = PagedKVCache(config(state_slots=4, state_checkpoint_every=1))
    a, b = list(range(1, 14)), list(range(50, 55))
    kv.add_sequence("a", a)
    for n in (4, 4, 4, 1):                        # snapshots at 4, 8, 12: 4 and 8 superseded by 12
        step(kv, "a", a, n)
    kv.free("a")
    kv.add_sequence("b", b)
    step(kv, "b", b, 4)                           # another chain's, the most recent
    kv.free("b")
    assert kv.add_sequence("h", a[:5]) == 4       # a hit makes the 4-token one the most recent
    kv.free("h")
    snaps = kv._groups.snapshots
    assert sorted((len(s.tokens), s.superseded) for s in snaps.snapshots()) == [(4, 0), (4, 2), (8, 1), (12, 0)]
    kv.add_sequence("x", [9] * 5)
    kv.reserve("x", 5)                            # one slot: the LRU superseded one (8) goes, not b's
    assert sorted((int(s.tokens[0]), len(s.tokens)) for s in snaps.snapshots()) == [(1, 4), (1, 12), (50, 4)]
    kv.free("x")
    assert kv.add_sequence("c", a + [3]) == 12
    assert_state(kv, "c", a[:12])
    kv.free("c")
    snaps.remove(next(s for s in snaps.snapshots() if len(s.tokens) == 12))
    assert [s.superseded for s in snaps.snapshots() if s.tokens[0] == 1] == [0]   # the count follows removals
    kv.check_invariants()
