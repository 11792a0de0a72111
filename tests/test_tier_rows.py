"""Sink and window rows through the prefix tiers: a quantized cache keeps each
sequence's first sink tokens and its recent window in model precision (a window arena
beside the codes); a prefix evicted to the host tier or the disk tier and promoted back,
or restored by a new cache on the same disk directory, reads them exactly as it would
have in place, not quantized. Damaged rows are a miss; a disk tier written with other
rows (or none) is refused by name."""
import os

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfBlocksError, TierFileError

BS = 4
CASES = {
    "int4-block-keys-sinks": dict(kv_dtype="int4", head_dim=8, kv_window=0, kv_key_quant="block", kv_sink_tokens=4),
    "int8-window": dict(kv_dtype="int8", head_dim=4, kv_window=6),
    "int4-hybrid-sinks-window": dict(kv_dtype="int4", head_dim=8, kv_window=4, kv_key_quant="block",
                                     kv_sink_tokens=5, layer_windows=(6, 0, 6, 0)),
}


def make(opts) -> PagedKVCache:
    o = dict(num_layers=4, num_kv_heads=2, block_size=BS, dtype="float32", num_blocks=24, prefix_host_blocks=32)
    o.update(opts)
    return PagedKVCache(CacheConfig(**o))


_NOISE = torch.randn((4, 64, 2, 2, 8), generator=torch.Generator().manual_seed(3))


def expected_kv(tokens, layer: int, heads: int, dim: int):
    """Values with outliers per row (every kv_dtype loses something on them); row i
    depends on position i and tokens[i] only, so a shared prefix has shared rows."""
    t = torch.from_numpy(np.asarray(tokens, dtype=np.float32))[:, None, None] / 100
    base = _NOISE[layer, :len(tokens), :, :heads, :dim] * torch.tensor([1.0] * (dim - 1) + [9.0])
    return (base[:, 0] + t).contiguous(), (base[:, 1] - t).contiguous()


def fill(cache, seq, tokens) -> int:
    hit = cache.add_sequence(seq, tokens)
    n = len(tokens) - hit
    slots = cache.reserve(seq, n)
    for layer in range(cache.config.num_layers):
        k, v = expected_kv(tokens, layer, 2, cache.config.head_dim)
        cache.write(layer, slots, k[hit:], v[hit:])
    cache.commit(seq, n)
    return hit


def reads(cache, seq, tokens):
    hit = fill(cache, seq, tokens)
    out = [cache.gather_window([seq], layer) for layer in range(cache.config.num_layers)]
    cache.free(seq)
    return hit, [(k, v, pos) for k, v, _, pos in out]


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    try:
        while True:
            cache.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    cache.free("flush")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_promoted_prefix_reads_its_sink_and_window_rows_as_in_place(case):
    a = np.arange(100, 117, dtype=np.int32)         # 4 full blocks + 1 token
    short = np.append(a[:8], np.int32(7))           # shares the first two blocks only
    with make(CASES[case]) as cache:
        fill(cache, "a", a)
        cache.free("a")
        in_place = [reads(cache, "b", t) for t in (a, short)]
        assert [h for h, _ in in_place] == [16, 8]
        for toks, (_, want) in zip((a, short), in_place):
            flush_device(cache)                     # every cached block goes to the host tier
            assert cache.match_prefix(toks) >= 8 and cache.stats().host_hit_tokens >= 0
            before = cache.stats().host_hit_tokens
            hit, got = reads(cache, "c", toks)
            assert hit == (16 if toks is a else 8) and cache.stats().host_hit_tokens - before == hit
            for layer, ((k, v, pos), (wk, wv, wpos)) in enumerate(zip(got, want)):
                assert torch.equal(pos, wpos)
                assert torch.equal(k, wk) and torch.equal(v, wv), f"layer {layer}: the promoted prefix reads other KV"
        cache.check_invariants()


# ---- through the disk tier: a disk round trip, a warm restart, damaged rows -------------

FILLER = np.arange(2000, 2041, dtype=np.int32)       # 10 full blocks, tokens no test prefix uses


def make_disk(opts, path) -> PagedKVCache:
    return make(dict(opts, num_blocks=40, prefix_host_blocks=8, prefix_disk_dir=str(path), prefix_disk_blocks=96))


def push_to_disk(cache, round_: int) -> None:
    """Every cached block leaves the device, then the host: a filler prefix of other
    tokens takes the host tier, which writes what it held back to the disk."""
    flush_device(cache)
    fill(cache, "filler", FILLER + 100 * round_)
    cache.free("filler")
    flush_device(cache)


def in_place_reads(opts, a, short):
    with make(opts) as cache:
        fill(cache, "a", a)
        cache.free("a")
        return [reads(cache, "b", t) for t in (a, short)]


def assert_reads_equal(got, want, what: str) -> None:
    for layer, ((k, v, pos), (wk, wv, wpos)) in enumerate(zip(got, want)):
        assert torch.equal(pos, wpos)
        assert torch.equal(k, wk) and torch.equal(v, wv), f"layer {layer}: {what} reads other KV than in place"


A = np.arange(100, 117, dtype=np.int32)             # 4 full blocks + 1 token
SHORT = np.append(A[:8], np.int32(7))               # shares the first two blocks only


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prefix_promoted_from_disk_reads_its_rows_as_in_place(case, tmp_path):
    want = in_place_reads(CASES[case], A, SHORT)
    assert [h for h, _ in want] == [16, 8]
    with make_disk(CASES[case], tmp_path) as cache:
        fill(cache, "a", A)
        cache.free("a")
        for r, (toks, (hit_in_place, rows)) in enumerate(zip((A, SHORT), want)):
            push_to_disk(cache, r)
            before = cache.stats()
            hit, got = reads(cache, "c", toks)
            after = cache.stats()
            assert hit == hit_in_place
            assert after.disk_hit_tokens - before.disk_hit_tokens == hit      # from the disk, not the host
            assert after.host_hit_tokens == before.host_hit_tokens
            assert_reads_equal(got, rows, "a prefix promoted from the disk")
        cache.check_invariants()


def written_to_disk(opts, path) -> None:
    with make_disk(opts, path) as cache:
        fill(cache, "a", A)
        cache.free("a")
        push_to_disk(cache, 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_after_a_warm_restart_a_prefix_reads_its_rows_as_in_place(case, tmp_path):
    want = in_place_reads(CASES[case], A, SHORT)
    written_to_disk(CASES[case], tmp_path)
    for toks, (hit_in_place, rows) in zip((A, SHORT), want):
        with make_disk(CASES[case], tmp_path) as cache:       # a new process on the same directory
            hit, got = reads(cache, "c", toks)
            assert hit == hit_in_place and cache.stats().disk_hit_tokens == hit
            assert_reads_equal(got, rows, "a prefix restored after a warm restart")


def _row_slots(cache):
    """Disk slot -> depth in A (block i holds A[4i:4i+4]) of the slots of A's chain whose
    record holds rows."""
    disk = cache._tiers.disk
    rec = disk.index.rec
    out = {}
    for s in np.flatnonzero(rec["valid"] == 1).tolist():
        toks = np.asarray(rec["tokens"][s])
        for i in range(4):
            if np.array_equal(toks, A[4 * i:4 * i + 4]) and bool(disk.window.valid[s].any()):
                out[s] = i
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_rows_are_a_miss_and_the_kv_served_is_exact(case, tmp_path):
    want = in_place_reads(CASES[case], A, SHORT)
    written_to_disk(CASES[case], tmp_path)
    with make_disk(CASES[case], tmp_path) as cache:
        disk = cache._tiers.disk
        rows = _row_slots(cache)
        assert rows, "A's blocks reached the disk without rows"
        slot = min(rows, key=rows.get)             # the damaged block nearest the root
        depth = rows[slot]
        off = slot * disk.record_bytes + disk.rows_section[0]
        record_bytes, path = disk.record_bytes, disk.path
    del disk
    with open(f"{path}/blocks.bin", "r+b") as f:    # one bit of one row, nothing else
        f.seek(off + 3)
        byte = f.read(1)[0]
        f.seek(off + 3)
        f.write(bytes([byte ^ 0x10]))
    assert off // record_bytes == slot
    with pytest.warns(RuntimeWarning, match=r"dropped 1 damaged record"), make_disk(CASES[case], tmp_path) as cache:
        assert cache._tiers.disk.num_corrupt_dropped == 1
    for toks, (_, rows_in_place) in zip((A, SHORT), want):      # dropped for good when it was found
        with make_disk(CASES[case], tmp_path) as cache:
            hit, got = reads(cache, "c", toks)
            assert hit == min(depth, len(toks) // BS) * BS      # the damaged block and what follows: a miss
            assert_reads_equal(got, rows_in_place, "a prefix over damaged rows")


def _header(path):
    with open(f"{path}/meta.json", "rb") as f:
        return f.read()


@pytest.mark.parametrize("written, opened, message", [
    (dict(kv_window=0), dict(kv_window=6),
     r"expected a tier whose records carry sink and window rows \(kv_window=6, kv_sink_tokens=0: .*"
     r"got version=1, no rows \(written by an older pagedkv or by a cache without kv_window/kv_sink_tokens\)"),
    (dict(kv_window=6), dict(kv_window=8),
     r"expected a tier whose rows were written for this cache \(kv_window=8\), got kv_window=6"),
    (dict(kv_window=6), dict(kv_window=6, kv_sink_tokens=4),
     r"expected a tier whose rows were written for this cache \(kv_sink_tokens=4\), got kv_sink_tokens=0"),
    (dict(kv_window=6), dict(kv_window=0),
     r"expected a tier without sink and window rows \(this cache keeps none\), got rows for kv_window=6, "
     r"kv_sink_tokens=0"),
])
def test_a_tier_written_with_other_rows_is_refused_by_name_and_left_as_it_was(tmp_path, written, opened, message):
    base = dict(kv_dtype="int8", head_dim=4)
    written_to_disk(dict(base, **written), tmp_path)
    header, files = _header(tmp_path), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TierFileError, match=r"meta\.json: " + message):
        make_disk(dict(base, **opened), tmp_path)
    assert _header(tmp_path) == header and sorted(p.name for p in tmp_path.iterdir()) == files
    with make_disk(dict(base, **written), tmp_path) as cache:     # still the tier it was
        assert cache.match_prefix(A) == 16


_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {here!r})
import test_tier_rows as t
from pagedkv.tiers.disk import DiskPrefixTier
def killed(self, slots):          # the data and the rows are in the file, the records not sealed yet
    assert self.window is not None and bool(self.window.valid.any())
    os.kill(os.getpid(), signal.SIGKILL)
DiskPrefixTier.written = killed
t.written_to_disk(t.CASES[{case!r}], {path!r})
"""


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_writer_killed_before_the_seal_leaves_a_miss_not_rows_without_a_block(case, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITER.format(here=here, case=case, path=str(tmp_path))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    want = in_place_reads(CASES[case], A, SHORT)
    for toks, (_, rows) in zip((A, SHORT), want):
        with make_disk(CASES[case], tmp_path) as cache:
            hit, got = reads(cache, "c", toks)
            assert hit == 0                         # nothing of A was sealed: a miss
            assert_reads_equal(got, rows, "a prefix after a killed writer")


def test_the_tiers_byte_figures_count_the_rows(tmp_path):
    opts = CASES["int8-window"]
    with make_disk(opts, tmp_path / "rows") as cache, make_disk(dict(opts, kv_window=0), tmp_path / "none") as plain:
        cfg, host, disk = cache.config, cache._tiers.host, cache._tiers.disk
        layers, per_block = cfg.num_layers, cfg.block_size * cfg.kv_heads_per_rank * cfg.head_dim
        rows = layers * (2 * per_block * 4 + cfg.block_size)          # float32 K and V, a validity byte per token
        assert host.nbytes == plain._tiers.host.nbytes + cfg.window_blocks * rows
        assert disk.rows_bytes >= rows and plain._tiers.disk.rows_bytes == 0
        assert disk.nbytes == plain._tiers.disk.nbytes + disk.capacity * disk.rows_bytes
        assert disk.nbytes == sum(os.path.getsize(tmp_path / "rows" / n) for n in ("blocks.bin", "index.bin"))


def test_a_version_2_header_that_names_no_rows_is_refused(tmp_path):
    import json
    base = dict(kv_dtype="int8", head_dim=4, kv_window=0)
    written_to_disk(base, tmp_path)
    meta = json.loads(_header(tmp_path))
    assert meta["version"] == 1 and "rows" not in meta
    meta["version"] = 2
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TierFileError, match=r"meta\.json: expected version=1, got version=2 without rows"):
        make_disk(base, tmp_path)
