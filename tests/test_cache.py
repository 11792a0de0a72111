"""PagedKVCache: the sequence lifecycle and the KV data path, checked against a dense reference."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import (InvalidArgumentError, OutOfBlocksError, SequenceExistsError,
                            SequenceNotFoundError, ShapeError)

H, D = 3, 8


def make(num_blocks=32, **kw):
    kw.setdefault("dtype", "float32")
    cfg = CacheConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=num_blocks, **kw)
    return PagedKVCache(cfg)


class Dense:
    """What every sequence's KV must be: a plain per-sequence list of rows."""

    def __init__(self, cache):
        self.cache = cache
        self.k, self.v = {}, {}

    def step(self, seqs, counts, gen):
        slots = self.cache.reserve(seqs, counts)
        total = int(np.sum(counts))
        for layer in range(self.cache.config.num_layers):
            k = torch.randn(total, H, D, generator=gen)
            v = torch.randn(total, H, D, generator=gen)
            self.cache.write(layer, slots, k, v)
            off = 0
            for s, n in zip(seqs, counts):
                self.k.setdefault((s, layer), []).append(k[off:off + n])
                self.v.setdefault((s, layer), []).append(v[off:off + n])
                off += n
        self.cache.commit(seqs, counts)

    def check(self, seq):
        for layer in range(self.cache.config.num_layers):
            k, v = self.cache.gather(seq, layer)
            assert torch.equal(k, torch.cat(self.k[(seq, layer)])) and torch.equal(v, torch.cat(self.v[(seq, layer)]))


def test_random_batches_round_trip_element_for_element():
    cfg = CacheConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=64,
                      dtype="float32", shuffle_free_blocks=5)
    cache = PagedKVCache(cfg)
    dense = Dense(cache)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    seqs = ["a", ("b", 1), 7, 8.5]
    for s in seqs:
        cache.add_sequence(s)
    for _ in range(12):
        counts = rng.integers(0, 6, len(seqs)).tolist()
        dense.step(seqs, counts, gen)
    for s in seqs:
        dense.check(s)
        blocks = cache.block_table(s)
        assert len(blocks) == -(-cache.num_tokens(s) // 4)
    k, v, cu = cache.gather_batch(seqs, 1)
    assert cu.tolist() == [0] + np.cumsum([cache.num_tokens(s) for s in seqs]).tolist()
    assert torch.equal(k[cu[1]:cu[2]], cache.gather(("b", 1), 1)[0])
    cache.check_invariants()
    cache.free(seqs)


def test_negative_slots_are_skipped():
    cache = make()
    cache.add_sequence(1)
    slots = cache.reserve(1, 3)
    padded = np.array([slots[0], -1, slots[1], slots[2], -1], dtype=np.int64)
    k = torch.arange(5 * H * D, dtype=torch.float32).reshape(5, H, D)
    cache.write(0, padded, k, k)
    got, _ = cache.gather(1, 0)
    assert torch.equal(got, k[[0, 2, 3]])
    cache.free(1)


def test_write_rejects_bad_input_and_changes_nothing():
    cache = make()
    cache.add_sequence(1)
    slots = cache.reserve(1, 2)
    before = cache.store.kv.clone()
    with pytest.raises(ShapeError):
        cache.write(0, slots, torch.zeros(2, H, D + 1), torch.zeros(2, H, D + 1))
    with pytest.raises(TypeError):
        cache.write(0, slots, torch.zeros(2, H, D, dtype=torch.float16), torch.zeros(2, H, D, dtype=torch.float16))
    with pytest.raises(ValueError, match="slot"):
        cache.write(0, np.array([0, 10_000], np.int64), torch.zeros(2, H, D), torch.zeros(2, H, D))
    with pytest.raises(TypeError, match=r"slot_mapping: expected an int64 array, got int32 array"):
        cache.write(0, slots.astype(np.int32), torch.zeros(2, H, D), torch.zeros(2, H, D))
    assert torch.equal(cache.store.kv, before)
    cache.free(1)


def test_ids_errors_and_batch_atomicity():
    cache = make(num_blocks=4)
    cache.add_sequence("x")
    with pytest.raises(SequenceExistsError, match=r"seq_id: expected a new sequence id, got 'x' \(already live\)"):
        cache.add_sequence("x")
    with pytest.raises(SequenceNotFoundError, match=r"seq_ids: expected a live sequence id, got 'y' \(unknown\)") as e:
        cache.reserve(["x", "y"], 1)
    assert isinstance(e.value, KeyError)
    with pytest.raises(InvalidArgumentError, match=r"seq_id: expected an int id in \[0, 2\*\*63\) or another hashable, got -3"):
        cache.add_sequence(-3)
    with pytest.raises(InvalidArgumentError, match="hashable"):
        cache.add_sequence(["not", "hashable"])
    cache.add_sequence(5)
    with pytest.raises(OutOfBlocksError, match=r"reserve needs 5 block\(s\), 4 free"):
        cache.reserve(["x", 5], [8, 12])          # all or nothing across the batch
    assert cache.num_reserved("x") == 0 and cache.num_reserved(5) == 0
    with pytest.raises(InvalidArgumentError, match=r"seq_ids: expected each sequence at most once per call"):
        cache.reserve(["x", "x"], 1)
    with pytest.raises(SequenceNotFoundError):
        cache.reserve(np.array([-1], np.int64), 1)  # int64 arrays address int ids only
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most 0 \(reserved, not yet committed\)"):
        cache.commit("x", 1)
    cache.free(["x", 5])
    assert len(cache) == 0 and cache.pool.num_free_blocks == 4


def test_fork_shares_blocks_and_copy_on_write_keeps_both_histories():
    cache = make()
    dense = Dense(cache)
    gen = torch.Generator().manual_seed(1)
    cache.add_sequence("p")
    dense.step(["p"], [6], gen)                  # 1.5 blocks: the last block is partial
    cache.fork("p", "c")
    assert cache.block_table("c").tolist() == cache.block_table("p").tolist()
    assert np.asarray(cache.pool.ref_cnt)[cache.block_table("p")].tolist() == [2, 2]
    for layer in range(2):
        dense.k[("c", layer)] = list(dense.k[("p", layer)])
        dense.v[("c", layer)] = list(dense.v[("p", layer)])
    dense.step(["c", "p"], [3, 1], gen)           # both write into the shared partial block
    dense.check("p")
    dense.check("c")
    assert cache.block_table("c")[0] == cache.block_table("p")[0]          # full block still shared
    assert cache.block_table("c")[1] != cache.block_table("p")[1]
    assert cache.stats().cow_copies >= 1
    cache.check_invariants()
    cache.free(["p", "c"])


def test_slot_mapping_tables_and_csr_exports():
    cache = make()
    cache.add_sequence(1)
    cache.add_sequence(2)
    s = cache.reserve([1, 2], [5, 2])
    b1, b2 = cache.block_table(1).tolist(), cache.block_table(2).tolist()
    assert s.tolist() == [b1[0] * 4, b1[0] * 4 + 1, b1[0] * 4 + 2, b1[0] * 4 + 3, b1[1] * 4, b2[0] * 4, b2[0] * 4 + 1]
    assert cache.slot_mapping(1, 3, 2).tolist() == s[3:5].tolist()
    tab = cache.block_tables([1, 2], pad=-7)
    assert tab.dtype == np.int32 and tab.tolist() == [b1, b2 + [-7]]
    indptr, indices, last = cache.page_table_csr([1, 2])
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == b1 + b2 and last.tolist() == [1, 2]
    with pytest.raises(InvalidArgumentError, match=r"expected a range inside the 5 reserved tokens of sequence 1"):
        cache.slot_mapping(1, 3, 3)
    cache.free([1, 2])


def test_hnd_layout_and_quantized_round_trips():
    gen = torch.Generator().manual_seed(2)
    for layout, kv_dtype, tol in (("HND", None, 0.0), ("NHD", "int8", 0.02), ("HND", "fp8_e4m3", 0.07),
                                  ("NHD", "fp8_e5m2", 0.13)):
        cache = make(layout=layout, kv_dtype=kv_dtype)
        cache.add_sequence(1)
        slots = cache.reserve(1, 9)
        k = torch.randn(9, H, D, generator=gen)
        for layer in range(2):
            cache.write(layer, slots, k, -k)
        cache.commit(1, 9)      # committed: read as stored (a pass's own rows are not read back quantized)
        got, gotv = cache.gather(1, 1)
        rel = ((got - k).abs().max() / k.abs().max()).item()
        assert rel <= tol and got.dtype == torch.float32
        assert torch.equal(gotv, -got) or kv_dtype == "int8"
        cache.free(1)


def test_swap_out_and_in_restores_kv_and_frees_device_blocks():
    cfg = CacheConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=8,
                      dtype="float32", host_num_blocks=8)
    cache = PagedKVCache(cfg)
    dense = Dense(cache)
    gen = torch.Generator().manual_seed(3)
    cache.add_sequence("s")
    dense.step(["s"], [10], gen)
    assert cache.swap_out("s") == 3
    assert cache.is_swapped("s") and "s" not in cache and cache.pool.num_in_use_blocks == 0
    cache.add_sequence("t")
    cache.reserve("t", 24)                        # the device blocks are reusable meanwhile
    with pytest.raises(OutOfBlocksError, match="swap_in from the host tier"):
        cache.swap_in("s")
    cache.free("t")
    assert cache.swap_in("s") == 3
    dense.check("s")
    dense.step(["s"], [3], gen)                   # and it keeps decoding
    dense.check("s")
    cache.swap_out("s")
    cache.free("s")                               # freeing a swapped sequence drops its host copy
    assert cache.stats().host_blocks_in_use == 0
    cache.check_invariants()


def test_stats_dump_and_capacity_queries():
    cache = make(num_blocks=8)
    cache.add_sequence(1, np.arange(6, dtype=np.int32))
    cache.reserve(1, 6)
    cache.commit(1, 6)
    st = cache.stats()
    assert (st.total_blocks, st.allocated_blocks, st.active_sequences, st.total_tokens) == (8, 2, 1, 6)
    assert st.utilization_pct == 25.0 and st.fragmentation == 2 / 8
    assert st.bytes_in_use == 2 * cache.config.bytes_per_block and not st.is_full
    assert cache.has_available_blocks(6) and not cache.has_available_blocks(7)
    assert cache.can_allocate(24) and not cache.can_allocate(25)
    m = cache.dump_block_map(width=4)
    assert m.count("#") == 2 and m.count("\n") == 1
    text = cache.dump_stats()
    assert "1: 6/6 tokens, 2 blocks" in text and "Block map:" in text
    cache.free(1)


@pytest.mark.parametrize("form", ["sparse", "meta"])
@pytest.mark.parametrize("call", ["add_sequence", "reserve_counts", "reserve_ids", "advance_tokens", "commit_tokens"])
def test_sparse_and_meta_tensor_arguments_get_typed_errors(form, call):
    from pagedkv.errors import ArgumentTypeError, DeviceError
    cache = make()
    cache.add_sequence(0, [1, 2, 3])
    cache.reserve(0, 3)
    before = (cache.stats().allocated_blocks, cache.num_reserved(0), cache.num_tokens(0))

    def bad(t):
        return t.to_sparse() if form == "sparse" else t.to("meta")
    calls = {
        "add_sequence": lambda: cache.add_sequence(1, bad(torch.tensor([1, 2]))),
        "reserve_counts": lambda: cache.reserve(torch.tensor([0]), bad(torch.tensor([1]))),
        "reserve_ids": lambda: cache.reserve(bad(torch.tensor([0])), 1),
        "advance_tokens": lambda: cache.advance([0], bad(torch.tensor([7]))),
        "commit_tokens": lambda: cache.commit([0], [3], bad(torch.tensor([1, 2, 3]))),
    }
    exc, msg = ((ArgumentTypeError, "expected a dense \\(strided\\) tensor, got a torch.sparse_coo tensor")
                if form == "sparse" else (DeviceError, "expected a tensor with data \\(cpu or cuda\\), got a meta tensor"))
    with pytest.raises(exc, match=msg):
        calls[call]()
    assert (cache.stats().allocated_blocks, cache.num_reserved(0), cache.num_tokens(0)) == before
    assert 1 not in cache
    cache.check_invariants()
    cache.free(0)
