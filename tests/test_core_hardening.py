"""Hostile input against the Cython core (issue 9): no crash, no corruption, typed errors.

Every case checks the error type (a pagedkv error with the builtin base a caller would
catch), the message where it is API, and that the state is exactly what it was before.
"""
import threading

import numpy as np
import pytest

from pagedkv import BlockPool, BlockTables, PrefixIndex
from pagedkv.errors import (ArgumentTypeError, DTypeError, InvalidArgumentError, OutOfMemoryError,
                            InvalidBlockError, OutOfBlocksError, PagedKVError, SequenceNotFoundError,
                            ShapeError)


def make(num_blocks=64, block_size=16, prefix=True, **kw):
    index = PrefixIndex(block_size, num_blocks, hash_seed=3, **kw) if prefix else None
    pool = BlockPool(num_blocks, index=index)
    return pool, BlockTables(pool, block_size, index)


def state(pool, tables):
    keys = sorted(tables.keys().tolist())
    return (pool.ref_cnt.tolist(), pool.free_lists(),
            {k: (tables.blocks(k).tolist(), tables.num_reserved(k), tables.num_computed(k),
                 tables.tokens(k).tolist()) for k in keys})


def unchanged(pool, tables, call, err, match=None):
    before = state(pool, tables)
    with pytest.raises(err, match=match):
        call()
    assert state(pool, tables) == before
    tables.check_invariants()


# ---- 64-bit counts ------------------------------------------------------------------
def test_huge_counts_that_overflow_a_32_bit_total_are_refused_not_written():
    pool, tables = make()
    for k in range(4):
        tables.add(k)
    unchanged(pool, tables, lambda: tables.reserve(np.arange(4, dtype=np.int64), np.full(4, 2**62, np.int64)),
              OutOfBlocksError, r"reserve needs \d+ block\(s\), 64 free")
    unchanged(pool, tables, lambda: tables.reserve(1, 2**40), OutOfBlocksError, "reserve needs 68719476736 block")
    unchanged(pool, tables, lambda: tables.reserve(1, 2**63), InvalidArgumentError,
              r"num_tokens: expected counts in \[0, 2\*\*63\), got 9223372036854775808")
    unchanged(pool, tables, lambda: tables.reserve(1, -1), InvalidArgumentError, r"num_tokens: expected an int >= 0, got -1")
    unchanged(pool, tables, lambda: tables.reserve(1, 2.5), ArgumentTypeError, r"num_tokens: expected an int >= 0, got 2.5")
    assert tables.reserve(1, 5).tolist() == tables.slot_mapping(np.array([1]), np.array([0]), np.array([5])).tolist()


def test_commit_range_check_does_not_overflow():
    pool, tables = make()
    tables.add(1, np.arange(20, dtype=np.int32))
    tables.reserve(1, 2)
    tables.commit(1, 1)
    unchanged(pool, tables, lambda: tables.commit(1, np.array([2**63 - 1], np.int64)), InvalidArgumentError,
              r"num_tokens: expected at most 1 \(reserved, not yet committed\) for sequence 1, got 9223372036854775807")
    assert tables.num_computed(1) == 1


def test_unreserve_and_slot_mapping_range_checks_do_not_overflow():
    pool, tables = make()
    tables.add(1)
    tables.reserve(1, 5)
    unchanged(pool, tables, lambda: tables.unreserve(1, np.array([2**63 - 1], np.int64)), InvalidArgumentError,
              r"num_tokens: expected 0..5")
    unchanged(pool, tables, lambda: tables.slot_mapping(np.array([1]), np.array([3]), np.array([2**63 - 2])),
              InvalidArgumentError, r"expected a range inside the 5 reserved tokens of sequence 1")


def test_set_priority_range_is_bounded_by_the_pool_capacity():
    pool, tables = make(num_blocks=64, prefix=False)
    tables.add(0)
    unchanged(pool, tables, lambda: tables.set_priority(0, 1, 0, 2**31 * 16), InvalidArgumentError,
              r"end_token: expected an int in \[1, 1024\] \(the pool's capacity in tokens\), got 34359738368")
    unchanged(pool, tables, lambda: tables.set_priority(0, 2.5), ArgumentTypeError, r"priority: expected an int in \[0, 127\], got 2.5")
    unchanged(pool, tables, lambda: tables.set_priority(0, 1, 1.5, 20), ArgumentTypeError, "start_token")
    tables.set_priority(0, 1, 0, 1024)          # the whole pool is fine
    assert len(tables.reserve(0, 40)) == 40     # and a later reserve is unharmed
    tables.check_invariants()


# ---- byte order and layout ----------------------------------------------------------
@pytest.mark.parametrize("layout", ["big-endian", "reversed", "strided", "big-endian reversed"])
def test_any_layout_reads_the_same_values(layout):
    def shape(a):
        if "big-endian" in layout:
            a = a.astype(a.dtype.newbyteorder(">"))
        if "reversed" in layout:
            a = a[::-1].copy()[::-1]
        if layout == "strided":
            wide = np.zeros(2 * len(a), dtype=a.dtype)
            wide[::2] = a
            a = wide[::2]
        return a

    ref_pool, ref = make()
    pool, tables = make()
    keys = np.arange(4, dtype=np.int64)
    counts = np.array([64, 3, 17, 1], dtype=np.int64)
    for k in range(4):
        ref.add(k, np.arange(100, dtype=np.int32) + k)
        tables.add(int(k), shape(np.arange(100, dtype=np.int32) + k))
    expect = ref.reserve(keys, counts)
    got = tables.reserve(shape(keys), shape(counts))
    assert got.tolist() == expect.tolist()
    ref.commit(keys, counts)
    tables.commit(shape(keys), shape(counts))
    assert state(pool, tables) == state(ref_pool, ref)
    blocks = tables.blocks(0)
    # pool calls too: touch and free with a reversed, big-endian view
    pool.touch(shape(blocks[:2].copy()))
    pool.free(shape(blocks[:2].copy()))
    tables.check_invariants()


def test_reversed_views_are_freed_in_the_order_given():
    pool = BlockPool(8)
    ids = pool.allocate(4)
    pool.free(ids[::-1])
    assert pool.free_block_queue()[:4].tolist() == ids[::-1].tolist()


@pytest.mark.parametrize("bad, err, msg", [
    (np.array([1, 2], np.int32), DTypeError, r"seq_ids: expected a 1-D int64 array, got int32 array"),
    (np.array([[1]], np.int64), ShapeError, r"seq_ids: expected a 1-D int64 array, got int64 array of shape \(1, 1\)"),
    (np.array([1.0]), DTypeError, "seq_ids: expected a 1-D int64 array, got float64"),
    ("ab", ArgumentTypeError, r"seq_ids: expected a 1-D int64 array or a list of ints, got str"),
    (None, ArgumentTypeError, "seq_ids"),
    ([[1], [2, 3]], ShapeError, "seq_ids: expected a flat sequence of ints"),
])
def test_key_arrays_of_the_wrong_kind_get_typed_errors(bad, err, msg):
    pool, tables = make()
    tables.add(1)
    tables.add(2)
    unchanged(pool, tables, lambda: tables.reserve(bad, 1), err, msg)


# ---- scalar arguments ---------------------------------------------------------------
@pytest.mark.parametrize("bad, err", [(2**31, InvalidArgumentError), (0, InvalidArgumentError),
                                      ("8", ArgumentTypeError), (None, ArgumentTypeError),
                                      (1.5, ArgumentTypeError), (True, ArgumentTypeError)])
def test_pool_sizes_are_ints_in_range(bad, err):
    with pytest.raises(err, match=r"num_blocks: expected an int in \[1, 2147483647\], got"):
        BlockPool(bad)


def test_a_pool_larger_than_free_memory_is_refused_up_front():
    with pytest.raises(OutOfMemoryError, match="num_blocks: expected a pool whose bookkeeping fits the [0-9]+ bytes "
                       r"available on cpu, got 2147483647 \(64424509410 bytes needed\)"):
        BlockPool(2**31 - 1)


@pytest.mark.parametrize("kw, err, msg", [
    (dict(priority_classes=1.5), ArgumentTypeError, "priority_classes"),
    (dict(priority_classes=99), InvalidArgumentError, r"priority_classes: expected an int in \[1, 33\]"),
    (dict(low_watermark="a"), ArgumentTypeError, "low_watermark"),
    (dict(low_watermark=0.5, high_watermark=0.2), InvalidArgumentError, "0 <= low <= high <= 1"),
    (dict(shuffle_seed=-1), InvalidArgumentError, "shuffle_seed"),
])
def test_pool_options_are_checked(kw, err, msg):
    with pytest.raises(err, match=msg):
        BlockPool(8, **kw)


def test_table_and_index_constructors_check_their_arguments():
    pool = BlockPool(8)
    with pytest.raises(ArgumentTypeError, match="pool: expected a BlockPool, got NoneType"):
        BlockTables(None, 16)
    with pytest.raises(ArgumentTypeError, match="block_size"):
        BlockTables(pool, "16")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        BlockTables(pool, 0)
    with pytest.raises(ArgumentTypeError, match="num_blocks"):
        PrefixIndex(16, 8.0)
    index = PrefixIndex(16, 8)
    BlockPool(8, index=index)
    with pytest.raises(InvalidArgumentError, match="index: expected a PrefixIndex not attached to another pool"):
        BlockPool(8, index=index)


def test_single_key_calls_type_check_their_key():
    pool, tables = make()
    tables.add(1)
    for call in (lambda: tables.blocks("1"), lambda: tables.num_computed(1.0), lambda: tables.fork(1, None),
                 lambda: tables.add("x")):
        unchanged(pool, tables, call, ArgumentTypeError)
    unchanged(pool, tables, lambda: tables.blocks(2**64), InvalidArgumentError, "an int64 key")


def test_messages_name_the_callers_id_through_the_namer():
    pool, tables = make()
    tables.namer = lambda k: {-1: "req-a", -2: "req-b"}.get(k, k)
    tables.add(-1)
    tables.reserve(-1, 3, internal=True)
    with pytest.raises(InvalidArgumentError, match=r"for sequence 'req-a'"):
        tables.commit(-1, 4, internal=True)
    with pytest.raises(SequenceNotFoundError, match=r"got 'req-b' \(unknown\)"):
        tables.reserve(np.array([-1, -2], np.int64), 1, internal=True)
    with pytest.raises(InvalidArgumentError, match=r"got 'req-a' repeated at index 1"):
        tables.reserve(np.array([-1, -1], np.int64), 1, internal=True)
    tables.remove(-1, internal=True)


# ---- failed calls leave nothing behind ----------------------------------------------
def test_unpin_failure_leaves_no_scratch_behind():
    pool, tables = make(num_blocks=8, block_size=4)
    tables.add(1, np.arange(8, dtype=np.int32))
    tables.reserve(1, 8)
    tables.commit(1, 8)
    blocks = tables.blocks(1)
    tables.remove(1)
    pool.pin(blocks[:1])
    with pytest.raises(InvalidBlockError, match=r"block_ids: expected block ids in \[0, 8\), got -1 at index 1"):
        pool.unpin(np.array([blocks[0], -1], np.int32))
    pool.check_invariants()                       # scratch is all zero again
    with pytest.raises(InvalidBlockError, match="expected pinned blocks"):
        pool.unpin(np.array([blocks[0], blocks[0]], np.int32))
    pool.check_invariants()                       # scratch is all zero again
    assert pool.pin_count(int(blocks[0])) == 1
    pool.unpin(blocks[:1])
    assert pool.pin_count(int(blocks[0])) == 0


def test_events_beyond_the_buffer_are_counted_not_raised():
    pool, tables = make(num_blocks=64, block_size=4, events=True, max_events=8)
    tables.add(1, np.arange(48, dtype=np.int32))
    tables.reserve(1, 48)
    tables.commit(1, 48)                          # 12 registrations, room for 8 events
    kind, hashes, parents, ns, blocks, lost = tables.index.drain_events()
    assert len(kind) == 8 and lost == 4
    assert tables.index.num_cached == 12          # registration itself was complete
    tables.check_invariants()
    assert tables.index.drain_events()[5] == 0
    tables.remove(1)


# ---- a second thread rewriting the caller's arrays -----------------------------------
def test_arrays_rewritten_by_another_thread_during_calls_cannot_smuggle_values():
    """Each call reads its arguments once: a value flipped between validation and use
    must not reach the C loops. The writer flips counts between 1 and 2**40, block ids
    between valid and -5, and token ids; the core must never crash or corrupt state."""
    pool, tables = make(num_blocks=256, block_size=4)
    keys = np.arange(4, dtype=np.int64)
    for k in keys.tolist():
        tables.add(k)
    counts = np.ones(4, dtype=np.int64)
    tokens = np.zeros(4, dtype=np.int32)
    stop = threading.Event()

    def writer():
        flip = 0
        while not stop.is_set():
            flip ^= 1
            counts[:] = 2**40 if flip else 1
            tokens[:] = 7 if flip else 0

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(3000):
            try:
                slots = tables.reserve(keys, counts)
                assert len(slots) == 4          # a snapshot of ones, never a mix with 2**40
                tables.commit(keys, 1)
            except OutOfBlocksError:
                pass                              # the snapshot said 2**40: refused whole
            if tables.num_reserved(0) > 200:
                tables.remove(keys)
                for k in keys.tolist():
                    tables.add(k)
    finally:
        stop.set()
        t.join()
    tables.check_invariants()
    tables.remove(keys)
    assert pool.num_in_use_blocks == 0


def test_free_list_rewritten_by_another_thread_cannot_double_free():
    pool = BlockPool(64)
    stop = threading.Event()
    ids = np.zeros(8, dtype=np.int32)

    def writer():
        while not stop.is_set():
            ids[3] = -5
            ids[3] = 0

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(3000):
            got = pool.allocate(8)
            ids[:] = got
            try:
                pool.free(ids)
            except InvalidBlockError:
                pool.free(got)                    # refused whole: nothing was released
            pool.check_invariants()
    finally:
        stop.set()
        t.join()
    assert pool.num_in_use_blocks == 0


def test_every_core_error_is_a_pagedkv_error():
    # The builtins a caller catches still work, but nothing escapes untyped.
    pool, tables = make()
    calls = [lambda: tables.reserve(object(), 1), lambda: tables.commit([1], "x"),
             lambda: tables.block_table([1], width="x"), lambda: tables.csr(3.5),
             lambda: pool.free({1: 2}), lambda: pool.touch(b"ab"), lambda: pool.allocate_many("ab"),
             lambda: tables.add(1, "abc"), lambda: tables.index.match(["a"]),
             lambda: tables.index.hash_tokens([1], ns_hash=-1)]
    for call in calls:
        with pytest.raises(PagedKVError):
            call()
