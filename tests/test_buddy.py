"""BuddyAllocator: power-of-two runs over the shared BlockPool, against a plain model."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv._core.pool import BlockPool
from pagedkv.manager.buddy import BuddyAllocator, order_for
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, OutOfBlocksError


def check(buddy, pool, paged, coalesced=True):
    """No overlap, every block accounted for once, runs aligned; candidates coalesced
    unless paged mode has freed blocks since the last refresh (those the allocator
    learns of only at its next refresh)."""
    owner = np.full(pool.num_blocks, -1)
    for start, n in buddy.runs().items():
        assert n & (n - 1) == 0 and start % n == 0
        assert (owner[start:start + n] == -1).all()
        owner[start:start + n] = 1
    for b in paged:
        assert owner[b] == -1
        owner[b] = 2
    ref = np.asarray(pool.ref_cnt)
    assert ((ref > 0) == (owner >= 0)).all()
    assert pool.num_free_blocks == pool.num_blocks - (owner >= 0).sum()
    seen = np.zeros(pool.num_blocks, dtype=bool)
    for k, starts in buddy.free_candidates().items():
        for s in starts:
            assert s % (1 << k) == 0 and not seen[s:s + (1 << k)].any()
            seen[s:s + (1 << k)] = True
            # coalesced: a listed run and its listed buddy are never both wholly free
            # (a candidate paged mode took part of is split when next used, not before)
            b = s ^ (1 << k)
            assert not coalesced or not (b in starts and (ref[min(s, b):max(s, b) + (1 << k)] == 0).all())
    assert not (seen & (owner == 1)).any()       # a live run is never listed free


def test_order_for():
    assert [order_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_allocate_splits_and_free_coalesces_back_to_one_run():
    pool = BlockPool(16)
    buddy = BuddyAllocator(pool)
    a, b, c = buddy.allocate(3), buddy.allocate(1), buddy.allocate(2)
    assert (a, b, c) == (0, 4, 6) and buddy.runs() == {0: 4, 4: 1, 6: 2}
    assert buddy.free_candidates() == {0: [5], 3: [8]}
    check(buddy, pool, [])
    for s in (np.int64(b), a, c):                # numpy ints name runs too
        buddy.free(s)
    assert buddy.free_candidates() == {4: [0]} and pool.num_free_blocks == 16
    with pytest.raises(InvalidBlockError, match=r"start: expected the start of a live run \(double free\?\), got 0"):
        buddy.free(0)


def test_bad_arguments_and_exhaustion_change_nothing():
    pool = BlockPool(8)
    buddy = BuddyAllocator(pool)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="num_blocks: expected an int >= 1"):
            buddy.allocate(bad)
    s = buddy.allocate(5)
    with pytest.raises(OutOfBlocksError, match="a contiguous run needs 1 block"):
        buddy.allocate(1)
    with pytest.raises(OutOfBlocksError, match="a contiguous run needs 16 block"):
        buddy.grow(s, 9)
    assert buddy.runs() == {0: 8}
    buddy.free(s)
    with pytest.raises(InvalidArgumentError, match="pool: expected a BlockPool"):
        BuddyAllocator("pool")


def test_shares_the_pool_with_paged_mode():
    pool = BlockPool(16)
    paged = pool.allocate(3).tolist()           # paged mode first: blocks 0-2
    buddy = BuddyAllocator(pool)
    assert buddy.allocate(4) == 4               # 0-3 is not a free aligned run
    more = pool.allocate(5).tolist()            # paged mode takes from the buddy's candidates
    paged += more
    s = buddy.allocate(2)                       # stale candidates are split, not trusted
    check(buddy, pool, paged)
    pool.free(np.asarray(paged, dtype=np.int32))
    buddy.free(s)
    buddy.free(4)
    assert buddy.allocate(16) == 0              # found again by the refresh
    buddy.free(0)
    assert pool.num_free_blocks == 16


def test_grow_merges_in_place_or_moves_the_data():
    pool = BlockPool(32)
    buddy = BuddyAllocator(pool)
    arena = np.zeros(32)
    copies = []

    def copy(old, new, n):
        copies.append((old, new, n))
        arena[new:new + n] = arena[old:old + n]

    a = buddy.allocate(2)
    arena[a:a + 2] = [1, 2]
    assert buddy.grow(a, 3, copy) == a and not copies   # buddy 2-3 free: merged in place
    assert buddy.runs() == {a: 4}
    b = buddy.allocate(4)                               # blocks 4-7: blocks a's next buddy
    arena[a:a + 4] = [1, 2, 3, 4]
    a2 = buddy.grow(a, 8, copy)
    assert a2 != a and copies == [(a, a2, 4)]
    assert arena[a2:a2 + 4].tolist() == [1, 2, 3, 4]
    check(buddy, pool, [])
    buddy.free(a2)
    buddy.free(b)
    assert pool.num_free_blocks == 32 and buddy.free_candidates() == {5: [0]}


def test_a_failed_copy_leaves_the_run_where_it_was():
    pool = BlockPool(8)
    buddy = BuddyAllocator(pool)
    a, b = buddy.allocate(1), buddy.allocate(1)

    def boom(old, new, n):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        buddy.grow(b, 2, boom)
    assert buddy.runs() == {a: 1, b: 1} and pool.num_free_blocks == 6
    check(buddy, pool, [])
    buddy.free(a)
    buddy.free(b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abgpq"), st.integers(1, 9), st.integers(0, 99)), max_size=60))
def test_random_ops_against_a_model(ops):
    pool = BlockPool(64)
    buddy = BuddyAllocator(pool)
    arena = np.full(64, -1)
    live = {}                                     # start -> tag written into its blocks
    paged = []
    tag = 0
    paged_freed = False
    for op, n, pick in ops:
        if op == "a":
            refreshes = buddy.num_refreshes
            try:
                s = buddy.allocate(n)
            except OutOfBlocksError:
                continue
            finally:
                paged_freed &= buddy.num_refreshes == refreshes
            tag += 1
            arena[s:s + (1 << order_for(n))] = tag
            live[s] = tag
        elif op == "b" and live:
            s = sorted(live)[pick % len(live)]
            buddy.free(s)
            del live[s]
        elif op == "g" and live:
            s = sorted(live)[pick % len(live)]
            old = buddy.runs()[s]

            def copy(o, d, k):
                arena[d:d + k] = arena[o:o + k]
            try:
                s2 = buddy.grow(s, n, copy)
            except OutOfBlocksError:
                assert buddy.runs()[s] == old
                continue
            t = live.pop(s)
            live[s2] = t
            assert (arena[s2:s2 + old] == t).all()   # data survived the growth
            arena[s2:s2 + buddy.runs()[s2]] = t
        elif op == "p" and pool.num_free_blocks >= n:
            paged += pool.allocate(n).tolist()
        elif op == "q" and paged:
            k = pick % len(paged) + 1
            pool.free(np.asarray(paged[:k], dtype=np.int32))
            paged = paged[k:]
            paged_freed = True
        check(buddy, pool, paged, coalesced=not paged_freed)
        for s, t in live.items():
            assert (arena[s:s + buddy.runs()[s]] == t).all()
    for s in list(live):
        buddy.free(s)
    if paged:
        pool.free(np.asarray(paged, dtype=np.int32))
    assert pool.num_free_blocks == 64
    buddy.refresh()
    assert buddy.free_candidates() == {6: [0]}
