"""Every public member of PagedKVCache on a cache with sliding-window layer groups: it
either covers every group or is refused by the support table, naming the call.

The recipes below are the list: a public member added to PagedKVCache without a recipe
fails ``test_every_public_member_has_a_recipe``."""
import numpy as np
import pytest
import torch
from test_sliding_cache import BS, hybrid, kv_of  # the same 4-layer cache: groups full (1, 3), window 6 (0, 2)

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.support import CAPABILITIES, UnsupportedCombinationError, markdown_table, require
from pagedkv.errors import InvalidArgumentError

WINDOWS = (6, 0, 6, 0)          # group 0: full attention (layers 1, 3); group 1: window 6 (layers 0, 2)


def fill(kv, seq, tokens, start=0):
    slots = kv.reserve(seq, len(tokens))
    for layer in range(4):
        k = kv_of(layer, range(start, start + len(tokens)))
        kv.write(layer, slots, k, -k)
    kv.commit(seq, len(tokens), tokens)


def live(kv, n=14):
    """One committed sequence 'a' of n tokens: its sliding group has released blocks."""
    kv.add_sequence("a")
    fill(kv, "a", list(range(100, 100 + n)))
    return kv


def held(kv, key="a"):
    return [int((kv.block_table(key, group=g) >= 0).sum()) for g in range(2)]


def refused(call, name):
    def run(kv):
        with pytest.raises(UnsupportedCombinationError, match="^" + name.replace("(", r"\(").replace(")", r"\)")
                           + ": expected a cache with full attention in every layer"):
            call(kv)
        kv.check_invariants()
    return run


def r_stats(kv):
    s = kv.stats()
    assert len(s.groups) == 2 and [g.window for g in s.groups] == [0, 6]
    assert [g.blocks_held for g in s.groups] == held(kv)
    assert sum(g.blocks_held for g in s.groups) == s.allocated_blocks     # nothing shared: the sums are the pool's
    assert s.fragmentation == sum(g.waste_slots for g in s.groups) / (s.allocated_blocks * BS)


def r_sequence_info(kv):
    info = kv.sequence_info("a")
    assert [g["num_blocks"] for g in info["groups"]] == held(kv)
    assert info["num_blocks"] == sum(held(kv)) and info["num_dropped_blocks"] == info["groups"][1]["num_dropped_blocks"] > 0


def r_num_blocks(kv):
    assert kv.num_blocks("a") == sum(held(kv)) == kv.stats().allocated_blocks


def r_set_priority(kv):
    kv.set_priority("a", 3)
    assert [g["priority"] for g in kv.sequence_info("a")["groups"]] == [3, 3]


def r_dump_stats(kv):
    text = kv.dump_stats()
    h = held(kv)
    assert f"group 0: {h[0]} blocks" in text and f"group 1: {h[1]} blocks" in text
    assert "Layer group 1 (window 6, 2 layers)" in text


def r_gather(kv):
    k, v = kv.gather("a", 1)          # a full-attention layer: every token
    assert torch.equal(k, kv_of(1, range(14))) and torch.equal(v, -k)


def r_gather_batch(kv):
    k, v, cu = kv.gather_batch(["a"], 0)      # a sliding layer: the tokens its group holds
    _, _, _, pos = kv.gather_window(["a"], 0)
    assert torch.equal(k, kv_of(0, pos.tolist())) and cu.tolist() == [0, len(pos)]


def r_gather_window(kv):
    _, _, _, pos = kv.gather_window(["a"], 2)
    assert pos.tolist()[-1] == 13 and len(pos) < 14


def r_gather_pages(kv):
    for layer, group in ((1, 0), (0, 1)):       # a full layer, then a sliding one (its held blocks only)
        indptr, indices, _ = kv.page_table_csr(["a"], group=group)
        gone = int(kv.released_tokens(["a"], group=group)[0])
        lens = torch.tensor([14 - gone], dtype=torch.int32)
        k, v = kv.gather_pages(layer, torch.from_numpy(indptr), torch.from_numpy(indices), lens)
        assert torch.equal(k, kv_of(layer, range(gone, 14))) and torch.equal(v, -k)
    assert gone > 0


def r_fork(kv):
    kv.fork("a", "b")
    assert kv.num_blocks("b") == kv.num_blocks("a")
    kv.free("b")


def r_truncate(kv):
    kv.truncate("a", 1)
    assert kv.num_tokens("a") == 13 and kv.num_blocks("a") == sum(held(kv))


def r_unreserve(kv):
    kv.reserve("a", 3)
    kv.unreserve("a")
    assert kv.num_reserved("a") == 14


def r_advance(kv):
    slots = kv.advance(["a"], [7])
    assert slots.shape == (2, 1)


def r_write(kv):
    slots = kv.reserve("a", 1)
    for layer in range(4):
        kv.write(layer, slots, kv_of(layer, [14]), -kv_of(layer, [14]))
    kv.commit("a", 1, [9])
    assert torch.equal(kv.gather("a", 3)[0][-1], kv_of(3, [14])[0])


def r_free(kv):
    kv.free("a")
    assert kv.stats().allocated_blocks == 0


def r_free_deferred(kv):
    kv.free_deferred("a")
    assert kv.sequences() == []


def r_copy_blocks(kv):
    src = int(kv.block_table("a", group=0)[0])
    dst = next(b for b in range(kv.pool.num_blocks) if kv.pool.block_state(b) == "free")
    kv.copy_blocks([[src, dst]])
    assert torch.equal(kv.store.arenas[0][:, dst], kv.store.arenas[0][:, src])


def r_match_prefix(kv):
    kv.free("a")
    per = kv.match_prefix_groups(list(range(100, 114)))["per_group"]
    assert per[0] == 12 and kv.match_prefix(list(range(100, 114))) == min(per)


def r_prefetch(kv):
    kv.free("a")
    prompt = list(range(100, 114))
    before = kv.match_prefix_groups(prompt)
    assert kv.prefetch_prefix(prompt) is None           # no remote tier: nothing to bring close
    assert kv.match_prefix_groups(prompt) == before


def r_pin(kv):
    kv.free("a")
    prompt = list(range(100, 114))
    pinned = kv.pin_prefix(prompt)
    assert kv.unpin_prefix(prompt) == pinned


def r_can_admit(kv):
    assert kv.can_admit(list(range(100, 114)), 20)
    assert kv.blocks_to_admit(list(range(100, 114)), 20) > 0


def r_swap(kv):
    """A grouped cache with a host tier: swap out, in, and the KV reads back exactly."""
    assert kv.is_swapped("a") is False
    with pytest.raises(InvalidArgumentError, match=r"config\.host_num_blocks: expected > 0 for swapping, got 0"):
        kv.swap_out("a")
    host = live(hybrid(host_num_blocks=16))
    before = everything(host)
    held_before = held(host)
    assert host.swap_out("a") == sum(held_before)
    assert host.is_swapped("a") and host.stats().allocated_blocks == 0
    host.swap_in("a")
    assert not host.is_swapped("a") and held(host) == held_before
    assert same(everything(host), before)
    fill(host, "a", [7, 8, 9], start=14)                # decoding goes on after the swap
    k, _, _, pos = host.gather_window(["a"], 0)
    assert torch.equal(k, kv_of(0, pos.tolist())) and pos.tolist()[-1] == 16
    host.check_invariants()
    host.free("a")
    host.close()


def everything(kv, key="a"):
    """Every layer's gathered K/V and positions: what a move must leave unchanged."""
    return [kv.gather_window([key], layer) for layer in range(4)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[3], y[3]) for x, y in zip(a, b))


def r_relocate(kv):
    before = everything(kv)
    full, sliding = kv.block_table("a", group=0), kv.block_table("a", group=1)
    moves = [[int(full[0]), 60], [int(sliding[-1]), 61]]     # one block of each group, in one call
    pairs = kv.relocate("a", moves)
    assert pairs.tolist() == moves
    assert kv.block_table("a", group=0)[0] == 60 and kv.block_table("a", group=1)[-1] == 61
    assert same(everything(kv), before)


def r_relocate_all_or_nothing(kv):
    before = (kv.block_table("a", group=0).tolist(), kv.block_table("a", group=1).tolist(), kv.pool.num_free_blocks)
    full, sliding = kv.block_table("a", group=0), kv.block_table("a", group=1)
    from pagedkv.errors import InvalidBlockError

    # group 0's move is good; group 1's new block is the one group 0 takes: refused before anything moves
    with pytest.raises(InvalidBlockError, match=r"moves: expected each new block at most once, got \[60, 60\]"):
        kv.relocate("a", [[int(full[0]), 60], [int(sliding[-1]), 60]])
    with pytest.raises(InvalidBlockError, match=r"moves: expected old blocks of sequence 'a''s tables, got block 59 at row 1"):
        kv.relocate("a", [[int(full[0]), 60], [59, 61]])
    assert (kv.block_table("a", group=0).tolist(), kv.block_table("a", group=1).tolist(),
            kv.pool.num_free_blocks) == before


def r_compact(kv):
    kv.relocate("a", [[int(b), 63 - i] for i, b in enumerate(kv.block_table("a", group=0).tolist())])
    before = everything(kv)
    pairs = kv.compact()
    assert len(pairs) and (pairs[:, 1] < pairs[:, 0]).all()
    held_now = np.concatenate([kv.block_table("a", group=g) for g in range(2)])
    held_now = held_now[held_now >= 0]
    empty = np.flatnonzero(kv.pool.states() == 0)
    assert (empty > held_now.max()).all()              # no empty block below a held one: packed at the bottom
    assert same(everything(kv), before)


def r_attention(kv):
    """A decode query over a full layer (all 14 keys) and a sliding one (the keys its
    group holds, window 6), each equal to softmax attention over the gathered keys."""
    q = torch.randn(1, 2, 8)
    for layer, group, window in ((1, 0, None), (0, 1, 6)):
        indptr, indices, _ = kv.page_table_csr(["a"], group=group)
        n = 14 - int(kv.released_tokens(["a"], group=group)[0])
        lens = torch.tensor([n], dtype=torch.int32)
        k, v = kv.gather_pages(layer, torch.from_numpy(indptr), torch.from_numpy(indices), lens)
        out = kv.attention(layer, q, indptr, indices, lens, np.array([0, 1], dtype=np.int32), window=window)
        keep = torch.arange(n) > (n - 1) - (window or n + 1)
        logits = torch.einsum("hd,thd->ht", q[0].double(), k.double()) / 8 ** 0.5
        p = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        want = torch.einsum("ht,thd->hd", p, v.double())
        assert torch.allclose(out[0].double(), want, rtol=1e-5, atol=1e-5)


def r_mla_attention(kv):
    """A cache of K/V rows (grouped or not) has no latent: refused, typed, nothing changed."""
    indptr, indices, _ = kv.page_table_csr(["a"], group=0)
    with pytest.raises(InvalidArgumentError, match=r"cache: expected an MLA cache \(kv_lora_rank\) for "
                                                   r"mla_attention, got a cache of K/V rows"):
        kv.mla_attention(1, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), indptr, indices,
                         np.array([14], np.int32), np.array([0, 1], np.int32), sm_scale=0.5)
    assert kv.num_tokens("a") == 14


_STATE_CALLS = {"next_checkpoint": ("a",), "read_state": (["a"], 0), "state_arena": ("conv",),
                "state_positions": (["a"],), "state_slots": (["a"],), "take_state_copies": (),
                "write_state": (["a"], 0, {}), "export_state": ("a",), "import_state": ("a", b""),
                "state_nbytes": ()}


def r_no_states(name):
    def recipe(kv):
        with pytest.raises(InvalidArgumentError, match="config.layer_kinds: expected recurrent-state layers"):
            getattr(kv, name)(*_STATE_CALLS[name])
    return recipe


def r_plan_attention(kv):
    """A step planned once runs each layer as attention() does, each group's layers
    through that group's table."""
    q = torch.randn(1, 2, 8)
    for layer, group, window in ((1, 0, None), (0, 1, 6)):
        indptr, indices, _ = kv.page_table_csr(["a"], group=group)
        lens = np.array([14 - int(kv.released_tokens(["a"], group=group)[0])], dtype=np.int32)
        qi = np.array([0, 1], dtype=np.int32)
        step = kv.plan_attention(indptr, indices, lens, qi, window=window)
        assert torch.equal(step.run(layer, q), kv.attention(layer, q, indptr, indices, lens, qi, window=window))


RECIPES = {
    "add_sequence": lambda kv: None,            # live() admits
    "reserve": r_write, "commit": r_write, "write": r_write,
    "advance": r_advance,
    "attention": r_attention, "mla_attention": r_mla_attention, "plan_attention": r_plan_attention,
    "block_table": lambda kv: held(kv),
    "block_tables": lambda kv: kv.block_tables(["a"], group=1).shape == (1, 4),
    "blocks_to_admit": r_can_admit, "can_admit": r_can_admit,
    "can_allocate": lambda kv: kv.can_allocate(8),
    "has_available_blocks": lambda kv: kv.has_available_blocks(2),
    "check_invariants": lambda kv: kv.check_invariants(),
    "close": lambda kv: None,                   # the fixture closes every cache
    "compact": lambda kv: r_compact(kv),
    "relocate": lambda kv: r_relocate(kv),
    "copy_blocks": r_copy_blocks,
    "device": lambda kv: kv.device.type == "cpu",
    "drain_events": lambda kv: None,            # needs enable_kv_events: test_group_events below
    "dump_block_map": lambda kv: kv.dump_block_map().count("#") == kv.stats().allocated_blocks,
    "dump_stats": r_dump_stats,
    "fork": r_fork,
    "free": r_free, "free_deferred": r_free_deferred,
    "gather": r_gather, "gather_batch": r_gather_batch, "gather_window": r_gather_window,
    "gather_pages": r_gather_pages,
    "hold_window": lambda kv: (kv.hold_window("a"), kv.hold_window("a", False)),
    "slide_window": lambda kv: kv.slide_window("a"),
    "is_swapped": r_swap, "swap_in": r_swap, "swap_out": r_swap,
    "lock": lambda kv: kv.lock.acquire() and kv.lock.release() is None,
    "match_prefix": r_match_prefix, "match_prefix_groups": r_match_prefix,
    "num_blocks": r_num_blocks,
    "num_reserved": lambda kv: kv.num_reserved("a") == 14,
    "num_tokens": lambda kv: kv.num_tokens("a") == 14,
    "page_table_csr": r_gather_pages,
    "pin_prefix": r_pin, "unpin_prefix": r_pin, "prefetch_prefix": r_prefetch,
    "_relocate_all_or_nothing": r_relocate_all_or_nothing,
    "released_tokens": lambda kv: kv.released_tokens(["a"], group=1)[0] > 0,
    "reset_prefix_cache": lambda kv: (kv.free("a"), kv.reset_prefix_cache()),
    "rotation_signs": lambda kv: kv.rotation_signs is None,
    "seq_lens": lambda kv: kv.seq_lens(["a"]).tolist() == [14],
    "sequence_info": r_sequence_info,
    "sequences": lambda kv: kv.sequences() == ["a"],
    "set_priority": r_set_priority,
    "slot_mapping": lambda kv: kv.slot_mapping("a", 12, 2, group=1).shape == (2,),
    "stats": r_stats,
    "take_copies": lambda kv: len(kv.take_copies()) == 0,
    "token_ids": lambda kv: kv.token_ids("a").tolist() == list(range(100, 114)),
    "truncate": r_truncate, "unreserve": r_unreserve,
    # recurrent-state calls: refused, typed, on a cache without state layers (tests/test_state_cache.py)
    **{name: r_no_states(name) for name in _STATE_CALLS},
}


def test_every_public_member_has_a_recipe():
    public = {n for n in dir(PagedKVCache) if not n.startswith("_")}
    assert public == {n for n in RECIPES if not n.startswith("_")}, (f"no recipe: {sorted(public - set(RECIPES))}; "
                                    f"stale recipe: {sorted(set(RECIPES) - public)}")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_public_member_on_a_grouped_cache(name):
    kv = live(hybrid())
    try:
        RECIPES[name](kv)
        kv.check_invariants()
    finally:
        kv.free([s for s in kv.sequences()])
        kv.close()


def test_set_priority_orders_eviction_in_every_group():
    """Under the priority policy the low-class sequence's blocks go first, in the
    sliding group as in the full one (before, only group 0's blocks got the class)."""
    kv = hybrid(num_blocks=14, eviction="priority", windows=(64, 0, 64, 0))   # no block leaves the window
    for seq, base, prio in (("lo", 100, 0), ("hi", 200, 100)):
        kv.add_sequence(seq)
        fill(kv, seq, list(range(base, base + 10)))
        kv.set_priority(seq, prio)
    kv.free("hi")              # freed first: LRU alone would evict hi's blocks first
    kv.free("lo")
    assert kv.match_prefix_groups(list(range(100, 110)))["per_group"] == [8, 8]
    kv.add_sequence("x")
    fill(kv, "x", list(range(300, 320)))          # 10 blocks over 6 empty: evicts 4 cached-free blocks
    assert kv.match_prefix_groups(list(range(200, 210)))["per_group"] == [8, 8]
    assert kv.match_prefix_groups(list(range(100, 110)))["per_group"] == [0, 0]
    kv.free("x")


def test_group_events():
    kv = hybrid(enable_kv_events=True)
    live(kv)
    kv.free("a")
    stored = [e for e in kv.drain_events() if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) >= 3


def test_support_table_is_the_readme_table():
    """The README shows the table the module generates."""
    import pathlib

    readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    assert markdown_table() in readme.read_text()


def test_one_refusal_wording_for_every_unsupported_row():
    cfg = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, block_size=BS, num_blocks=8, layer_windows=WINDOWS)
    full = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, block_size=BS, num_blocks=8)
    for cap in CAPABILITIES:
        require(cap.name, full)                      # everything works with full attention
        if cap.groups:
            require(cap.name, cfg)
        else:
            with pytest.raises(UnsupportedCombinationError) as err:
                require(cap.name, cfg)
            assert str(err.value) == (f"{cap.name}: expected a cache with full attention in every layer ({cap.why}), "
                                      "got sliding-window layer groups; see pagedkv.config.support.CAPABILITIES")
            assert isinstance(err.value, ValueError)
