"""A refused reserve leaves a block table's memory as it was.

A sliding-window table's length is not bounded by the pool (it releases what leaves the
window), so a hostile count used to grow the row's table to the count's size before
the pool refused it (gigabytes for ``2**33`` tokens), and the row kept that capacity
for its next sequences: ``set_priority`` then filled a per-block class array of that
size, taking seconds and gigabytes per call (the core fuzzer ran at 20 operations/s)."""
import resource

import numpy as np
import pytest

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.errors import OutOfBlocksError


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("window", [0, 8])
def test_a_refused_huge_reserve_does_not_grow_the_table(window):
    index = PrefixIndex(4, 48, hash_seed=0)
    pool = BlockPool(48, "lru", index=index)
    tables = BlockTables(pool, 4, index, window=window)
    tables.add(1, np.arange(10, dtype=np.int32), 0, 0)
    tables.reserve(np.array([1], np.int64), 3)
    before = _max_rss_mib()
    for count in (2**33, 2**31, 49 * 4 + 1):
        with pytest.raises(OutOfBlocksError, match=r"out of KV blocks: reserve needs \d+ block\(s\), \d+ free"):
            tables.reserve(np.array([1], np.int64), count)
    # a per-block class array fills the row's whole table capacity: it must be small
    tables.set_priority(1, 2, 0, 8)
    assert _max_rss_mib() - before < 64
    assert tables.info(1)["num_reserved"] == 3 and pool.num_free_blocks == 47
    tables.remove(np.array([1], np.int64))
