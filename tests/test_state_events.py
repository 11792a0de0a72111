"""KV events of recurrent-state snapshots: a router learns where a hybrid model's prefix
can resume (the state group's BlockStored at each snapshot's boundary, BlockRemoved when
it goes), in pagedkv's events and on vLLM's wire (``kv_cache_spec_kind`` "mamba")."""
import pytest
from test_state_tiers import BS, A, config, prefill, step

from pagedkv import PagedKVCache
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored

STATE_GROUP = 1        # after the one attention group


def state_events(events, kind):
    return [e for e in events if isinstance(e, kind) and e.group == STATE_GROUP]


def test_each_snapshot_is_stored_and_removed_as_its_boundary_block():
    with PagedKVCache(config(enable_kv_events=True)) as kv:
        prefill(kv, "a", A, (4, 4, 2))                 # snapshots after 4 and 8 tokens
        kv.free("a")
        events = kv.drain_events()
        stored = state_events(events, BlockStored)
        assert [e.token_ids for e in stored] == [A[:4], A[4:8]]     # each its boundary block's tokens
        assert stored[0].parent_block_hash is None                   # the first block of the chain
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
        assert all(e.token_count == BS and e.medium == "device" for e in stored)
        # the attention group's own events come first, and are untouched
        assert any(isinstance(e, BlockStored) and e.group == 0 for e in events)
        assert events.index(stored[0]) > max(i for i, e in enumerate(events)
                                              if isinstance(e, BlockStored) and e.group == 0)
        kv.reset_prefix_cache()
        events = kv.drain_events()
        assert any(isinstance(e, AllBlocksCleared) for e in events)
        removed = state_events(events, BlockRemoved)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(e.block_hashes[0] for e in stored)
        assert kv.drain_events() == []


def test_a_namespace_is_carried_and_the_same_prompt_hashes_alike():
    hashes = []
    for _ in range(2):                                 # two caches with one hash_seed: one hash space
        with PagedKVCache(config(enable_kv_events=True, hash_seed=5)) as kv:
            kv.add_sequence("a", A, cache_salt="tenant-1")
            step(kv, "a", A, 4)
            kv.free("a")
            stored = state_events(kv.drain_events(), BlockStored)
            assert [e.namespace for e in stored] == [("tenant-1", None)]
            hashes.append(stored[0].block_hashes)
    assert hashes[0] == hashes[1]


def test_the_wire_names_the_state_group_mamba():
    pytest.importorskip("zmq", reason="the events extra: pip install 'pagedkv[events]'")
    pytest.importorskip("msgspec", reason="the events extra: pip install 'pagedkv[events]'")
    from test_kv_events import LOOP, listen, received

    from pagedkv.kv_events import KVEventPublisher

    with PagedKVCache(config(enable_kv_events=True)) as kv, KVEventPublisher(kv, LOOP) as pub:
        sub = listen(pub)
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        pub.publish()
        events = [e for b in received(sub, 1) for e in b[2] if e["type"] == "BlockStored"]
        kinds = {e["group_idx"]: e["kv_cache_spec_kind"] for e in events}
        assert kinds == {0: "full_attention", STATE_GROUP: "mamba"}
        assert [e["token_ids"] for e in events if e["group_idx"] == STATE_GROUP] == [A[:4], A[4:8]]
        sub.close()
