"""Error classes of bad block and sequence ids (issue 25, item 2).

Every pool query with an id out of range raises InvalidBlockError, as ``free`` and
``unpin`` do; a wrong type is an ArgumentTypeError. Each case pins the class and the
whole message, and checks the pool is unchanged.
"""
import re

import numpy as np
import pytest

from pagedkv import BlockPool, CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidBlockError, ShapeError

QUERIES = ["is_cached", "block_state", "pin_count", "hit_count", "is_free"]


def _pool():
    pool = BlockPool(8)
    pool.allocate(3)            # a pool with some state to keep
    pool.free([1])
    return pool


def _state(pool):
    return pool.ref_cnt.tolist(), pool.free_lists(), pool.pinned_blocks().tolist(), pool.states().tolist()


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("bad", [8, 2**31, -1, 2**40, 2**70, np.int64(8), np.int32(-1)])
def test_a_query_with_an_id_out_of_range_is_an_invalid_block(query, bad):
    pool = _pool()
    before = _state(pool)
    whole = f"block_id: expected a block id in [0, 8), got {int(bad)}"
    with pytest.raises(InvalidBlockError, match=f"^{re.escape(whole)}$"):
        getattr(pool, query)(bad)
    assert _state(pool) == before


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("bad", ["1", 1.0, True, None, [1]])
def test_a_query_with_a_non_int_id_is_a_type_error(query, bad):
    pool = _pool()
    before = _state(pool)
    whole = f"block_id: expected an int in [0, 8), got {bad!r}"
    with pytest.raises(ArgumentTypeError, match=f"^{re.escape(whole)}$"):
        getattr(pool, query)(bad)
    assert _state(pool) == before


def test_queries_and_batch_calls_agree_on_the_class():
    pool = _pool()
    with pytest.raises(InvalidBlockError, match=r"^block_ids: expected block ids in \[0, 8\), got 8 at index 0$"):
        pool.free([8])
    with pytest.raises(InvalidBlockError, match=r"^block_ids: expected block ids in \[0, 8\), got 99 at index 0$"):
        pool.unpin([99])
    for query in QUERIES:
        with pytest.raises(InvalidBlockError):
            getattr(pool, query)(8)


def test_valid_ids_still_answer():
    pool = _pool()
    assert pool.block_state(np.int64(0)) == "in_use" and pool.pin_count(2) == 0
    assert pool.is_cached(7) is False and pool.hit_count(0) == 0


def _cache():
    return PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8))


def test_a_2d_seq_id_array_is_a_shape_error():
    kv = _cache()
    kv.add_sequence(1, list(range(5)))
    before = list(kv.block_table(1))
    with pytest.raises(ShapeError, match=r"^seq_ids: expected a 1-D batch of ids, got an array of shape \(1, 1\)$"):
        kv.reserve(np.array([[1]]), 1)
    assert list(kv.block_table(1)) == before
    kv.free(1)


@pytest.mark.parametrize("pairs, message", [
    ([[2**63, 1]], "pairs: expected block ids in [0, 8), got 9223372036854775808 at src row 0"),
    ([[1, -2**63 - 1]], "pairs: expected block ids in [0, 8), got -9223372036854775809 at dst row 0"),
    ([[0, 1], [2**64, 3]], "pairs: expected block ids in [0, 8), got 18446744073709551616 at src row 1"),
    ([[np.uint64(2**63), 1]], "pairs: expected block ids in [0, 8), got 9223372036854775808 at src row 0"),
])
def test_copy_blocks_ids_past_int64_are_out_of_range_ids(pairs, message):
    kv = _cache()
    before = kv.store.kv.clone()
    with pytest.raises(InvalidBlockError, match=f"^{re.escape(message)}$"):
        kv.copy_blocks(pairs)
    assert bool((kv.store.kv == before).all())


@pytest.mark.parametrize("pairs, message", [
    # torch would truncate 1.5 to 1 and copy block 1
    ([[1.5, 2]], "pairs: expected an int [P, 2] array of (src, dst) block ids, got float 1.5 at row 0"),
    ([[1, True]], "pairs: expected an int [P, 2] array of (src, dst) block ids, got bool True at row 0"),
    ([["a", 1]], "pairs: expected an int [P, 2] array of (src, dst) block ids, got str 'a' at row 0"),
])
def test_copy_blocks_non_int_ids_are_type_errors(pairs, message):
    kv = _cache()
    kv.store.kv[:, 1].fill_(1.0)
    before = kv.store.kv.clone()
    with pytest.raises(ArgumentTypeError, match=f"^{re.escape(message)}$"):
        kv.copy_blocks(pairs)
    assert bool((kv.store.kv == before).all())


def test_copy_blocks_still_copies_int_pairs():
    kv = _cache()
    kv.store.kv[:, 1].fill_(3.0)
    kv.copy_blocks([[1, 2]])
    assert bool((kv.store.kv[:, 2] == 3.0).all())
