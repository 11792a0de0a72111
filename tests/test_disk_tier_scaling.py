"""The disk tier that scales: files that grow on demand up to the limit, a clear that
gives the space back, and turns between processes that cost what changed (the
journal), with every change another process made checked like a first open would."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pagedkv.format.fingerprint import kv_format
from pagedkv.tiers import disk as disk_module
from pagedkv.tiers.chain import slot_dtype
from pagedkv.tiers.disk import DiskPrefixTier
from pagedkv.tiers.payload import Blocks
from pagedkv.tiers.verify import ChainQuery

from tier_helpers import SHAPE, assert_clean, assert_kv, expected_kv, fill, make

BS = SHAPE["block_size"]
HERE = os.path.dirname(os.path.abspath(__file__))


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


def record_bytes(cache) -> int:
    return sum(a[:, 0].numel() * a.element_size() for a in cache.store.arenas)


def test_the_files_start_small_and_grow_to_the_limit_before_anything_is_evicted(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "INITIAL_BYTES", 4 * (512 + slot_dtype(BS).itemsize))   # 4 slots
    opts = dict(num_blocks=6, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=24)
    prompts = [prompt(1000 * i) for i in range(8)]                     # 24 blocks in all
    with make(**opts) as cache:
        disk = cache._tiers.disk
        assert disk.capacity == 4 and os.path.getsize(tmp_path / "blocks.bin") == 4 * 512
        for i, p in enumerate(prompts):
            fill(cache, i, p)
            cache.free(i)
            flush_device(cache)
        assert disk.capacity == 24 and disk.num_grown == 3                # 4 -> 8 -> 16 -> 24
        assert disk.index.num_evictions == 0 and disk.index.num_used == 24
        st = os.stat(tmp_path / "blocks.bin")
        assert st.st_size == 24 * 512 and st.st_blocks * 512 >= st.st_size   # grown, its space reserved
        fill(cache, "x", prompt(50_000))                                  # the limit: now it evicts
        cache.free("x")
        flush_device(cache)
        assert disk.capacity == 24 and disk.index.num_evictions == 3
        disk.check_invariants()
    with make(**opts) as again:                                          # a restart maps the grown files
        assert again._tiers.disk.capacity == 24
        held = [again.match_prefix(p) for p in prompts]
        assert sum(held) == (24 - 3) * BS and held[3:] == [12] * 5      # all but the three evicted leaves
        assert fill(again, "p", prompts[7]) == 12
        assert_kv(again, "p", prompts[7])
        again.free("p")
        assert_clean(again)


def test_a_filesystem_that_refuses_to_grow_stops_the_growth_not_the_cache(tmp_path):
    r = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, {HERE!r})\n" + textwrap.dedent(f"""
        import resource, signal, warnings
        import numpy as np
        from pagedkv.tiers import disk
        from tier_helpers import assert_kv, fill, make
        disk.INITIAL_BYTES = 4 * 600
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with make(num_blocks=6, prefix_disk_dir={str(tmp_path)!r}, prefix_disk_blocks=64) as c:
            resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 512, resource.RLIM_INFINITY))
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                for i in range(8):
                    toks = np.arange(1000 * i, 1000 * i + 13, dtype=np.int32)
                    fill(c, i, toks)
                    assert_kv(c, i, toks)
                    c.free(i)
                    c.add_sequence("f"); c.reserve("f", c.pool.num_free_blocks * 4); c.free("f")
            t = c._tiers.disk
            print(t.capacity, t.limit, t.index.num_evictions > 0, any("stops growing at 4 blocks" in str(x.message)
                                                                      for x in w))
    """)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "4", "True", "True"]


def test_a_reset_gives_the_space_back(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "INITIAL_BYTES", 4 * (512 + slot_dtype(BS).itemsize))
    with make(num_blocks=6, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=64) as cache:
        for i in range(6):
            fill(cache, i, prompt(1000 * i))
            cache.free(i)
            flush_device(cache)
        assert os.path.getsize(tmp_path / "blocks.bin") == 32 * 512
        cache.reset_prefix_cache()
        assert os.path.getsize(tmp_path / "blocks.bin") == 4 * 512
        assert os.path.getsize(tmp_path / "index.bin") == 4 * slot_dtype(BS).itemsize
        assert cache._tiers.disk.index.num_used == 0
        fill(cache, "a", prompt(7))                                      # and it grows again
        cache.free("a")
        flush_device(cache)
        assert cache.match_prefix(prompt(7)) == 12
        assert_clean(cache)


# ---- two processes taking turns (two tier objects: flock is per open file) --------------------------
def two_tiers(tmp_path, cache, limit=64, **kw):
    fmt = kv_format(cache.store, "")
    opts = dict(eviction="lru", weak_hash=False, verify_blocks=False)
    opts.update(kw)
    a = DiskPrefixTier(str(tmp_path), cache.store.arenas, limit, BS, fmt, **opts)
    a.unlock()
    b = DiskPrefixTier(str(tmp_path), cache.store.arenas, limit, BS, fmt, **opts)
    b.unlock()
    return a, b


def put(tier, cache, tokens, seq):
    """Write ``tokens``' blocks (computed in ``cache`` as ``seq``) into ``tier`` in a turn."""
    assert tier.relock(1.0)
    try:
        fill(cache, seq, tokens)
        blocks = cache.block_table(seq)[:len(tokens) // BS].tolist()
        n = tier.batched_put(ChainQuery(tokens, b"ns", BS), 0, Blocks(cache.store.arenas, None, None), blocks)
        cache.free(seq)
        return n
    finally:
        tier.unlock()


def found(tier, tokens, cache=None):
    assert tier.relock(1.0)
    try:
        chain = tier.lookup(ChainQuery(tokens, b"ns", BS), 0, len(tokens) // BS)
        if cache is not None and chain:
            cache.add_sequence("chk")
            cache.reserve("chk", len(chain) * BS)
            dst = cache.block_table("chk")[:len(chain)].tolist()
            assert all(tier.verify(s) for s in chain)
            tier.load(chain, Blocks(cache.store.arenas, None, None), dst)
            for layer in range(SHAPE["num_layers"]):
                k, v = cache.gather("chk", layer)
                ek, ev = expected_kv(tokens[:len(chain) * BS], layer)
                assert torch.equal(k, ek) and torch.equal(v, ev)
            cache.free("chk")
        return len(chain)
    finally:
        tier.unlock()


def test_a_turn_reads_only_what_the_other_process_changed(tmp_path):
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        assert b.unchanged()
        assert put(a, cache, prompt(100), "a") == 3
        assert not b.unchanged()
        assert found(b, prompt(100), cache) == 3
        assert b.num_full_checks == 1 and b.num_refreshed == 3            # its open; then the three slots a sealed
        assert b.unchanged() and a.unchanged()                            # b's turn only looked: nothing changed
        assert found(a, prompt(100)) == 3
        assert put(b, cache, prompt(500), "b") == 3
        assert found(a, prompt(500), cache) == 3 and a.num_refreshed == 3
        assert a.relock(1.0)                                              # a evicts b's chain
        for s in a.subtree(a.lookup(ChainQuery(prompt(500), b"ns", BS), 0, 3)[0]):
            a.index.remove(s)
        a.unlock()
        assert found(b, prompt(500)) == 0 and found(b, prompt(100)) == 3
        for t in (a, b):
            assert t.relock(1.0)
            t.check_invariants()
            t.close()


def test_a_record_damaged_between_turns_is_dropped_at_the_next_turn(tmp_path):
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        put(a, cache, prompt(100), "a")
        assert found(b, prompt(100)) == 3
        assert a.relock(1.0)
        slot = a.lookup(ChainQuery(prompt(100), b"ns", BS), 0, 3)[1]
        a._disk["tokens"][slot][0] ^= 1                                   # a bit rot, journaled as a change
        a.journal.append([slot])
        a.unlock()
        assert found(b, prompt(100)) == 1                                 # the damaged block and the one below it
        for t in (a, b):
            assert t.relock(1.0)
            t.close()


def test_a_restarted_journal_makes_the_other_process_check_everything(tmp_path):
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        put(a, cache, prompt(100), "a")
        assert found(b, prompt(100)) == 3
        assert a.relock(1.0)
        a.journal.restart()
        a.unlock()
        assert found(b, prompt(100)) == 3 and b.num_full_checks == 2     # its open, then this turn
        assert a.relock(1.0)
        a.clear()                                                         # empties, shrinks, restarts the journal
        a.unlock()
        assert found(b, prompt(100)) == 0 and b.num_full_checks == 3
        for t in (a, b):
            assert t.relock(1.0)
            t.check_invariants()
            t.close()


def test_a_hostile_journal_costs_checks_never_wrong_kv(tmp_path, monkeypatch):
    """Whatever another process (or a damaged disk) leaves in the journal names at most
    slots to re-check: out-of-range ids, a torn entry, a garbage header, a shortened or
    a huge journal cost a re-check or a full check, and the hits stay exact."""
    journal = tmp_path / "journal.bin"
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        put(a, cache, prompt(100), "a")
        assert found(b, prompt(100), cache) == 3
        checks = b.num_full_checks
        with open(journal, "ab") as f:                                    # ids no slot has, and a torn entry
            f.write(np.array([10**12, -7, 2**63 - 1, 64, -(2**63)], dtype="<i8").tobytes() + b"\x01\x02\x03")
        assert found(b, prompt(100), cache) == 3 and b.num_full_checks == checks
        slot = 1
        with open(journal, "ab") as f:                                    # a live slot named again (after the torn bytes)
            f.write(np.array([slot] * 3, dtype="<i8").tobytes())
        assert found(b, prompt(100), cache) == 3
        for damage in ("shortened", "header", "huge"):
            if damage == "header":
                with open(journal, "r+b") as f:
                    f.write(b"\xff" * 16)
            elif damage == "shortened":
                os.truncate(journal, 20)
            else:                                                         # 16 M entries naming slot 0 (sparse)
                os.truncate(journal, os.path.getsize(journal) + (128 << 20))
                reads = []
                pread = os.pread
                monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or pread(fd, n, off))
            assert found(b, prompt(100), cache) == 3, damage
            assert b.num_full_checks == checks + 1, damage
            checks = b.num_full_checks
        assert max(reads) < 1 << 20                                       # the huge journal was not read
        monkeypatch.undo()
        assert found(a, prompt(100), cache) == 3                          # the writer copes as well
        put(a, cache, prompt(500), "b")                                   # and restarts the journal it outgrew
        assert found(b, prompt(500), cache) == 3 and b.num_full_checks == checks + 1
        put(a, cache, prompt(900), "c")                                   # from there on, turns cost changes again
        assert found(b, prompt(900), cache) == 3 and b.num_full_checks == checks + 1
        for t in (a, b):
            assert t.relock(1.0)
            t.check_invariants()
            t.close()


def test_growth_by_one_process_is_mapped_by_the_other_at_its_turn(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "INITIAL_BYTES", 2 * (512 + slot_dtype(BS).itemsize))
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        assert a.capacity == 2 and b.capacity == 2
        put(a, cache, prompt(100), "a")                                   # 3 blocks: a grows to 4
        put(a, cache, prompt(500), "b")                                   # 6: to 8
        assert a.capacity == 8 and a.num_grown == 2
        assert found(b, prompt(500), cache) == 3 and found(b, prompt(100), cache) == 3
        assert b.capacity == 8 and b.num_full_checks == 1                 # its open only
        for t in (a, b):
            assert t.relock(1.0)
            t.check_invariants()
            t.close()


def test_a_locked_turn_waits_then_gives_up(tmp_path):
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache)
        assert a.relock(0)
        assert b.relock(0.05) is False                                    # a holds it: nothing changed in b
        a.unlock()
        assert b.relock(0.05)
        b.close()
        assert a.relock(0)
        a.close()


@pytest.mark.parametrize("n", [1000, 20000])
def test_a_turn_after_a_small_change_does_not_scale_with_the_directory(tmp_path, n):
    """Behaviour, not speed: the turn re-checks the changed slots only (num_refreshed),
    at any directory size (the figures are in benchmarks/shared_tiers.py)."""
    with make(num_blocks=16) as cache:
        a, b = two_tiers(tmp_path, cache, limit=n + 64)
        assert a.relock(1.0)
        src = Blocks(cache.store.arenas, None, None)
        for i in range(n):                                                # n one-block chains
            a.batched_put(ChainQuery(np.array([i, i, i, i], dtype=np.int32), b"ns", BS), 0, src, [0])
        a.unlock()
        assert found(b, np.array([7, 7, 7, 7], dtype=np.int32)) == 1      # b's first look after a's bulk write
        before = (b.num_refreshed, b.num_full_checks)
        put(a, cache, prompt(10**6), "a")
        assert found(b, prompt(10**6), cache) == 3
        assert (b.num_refreshed - before[0], b.num_full_checks - before[1]) == (3, 0)
        for t in (a, b):
            assert t.relock(1.0)
            t.close()
