"""The disk prefix tier against a hostile or failing environment: a full filesystem, a
writer killed mid-write, planted symbolic links and FIFOs, foreign files, malformed
headers, an unwritable directory, and descriptors that must not outlive close()."""
import errno
import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pagedkv.errors import HostMemoryError, InvalidArgumentError, TierFileError, TierStorageError
from pagedkv.tiers.chain import slot_dtype

from tier_helpers import SHAPE, assert_clean, assert_kv, fill, make

BS = SHAPE["block_size"]
HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = f"import sys\nsys.path.insert(0, {HERE!r})\n"


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


def opts(path, **over):
    o = dict(num_blocks=4, prefix_disk_dir=str(path), prefix_disk_blocks=8)
    o.update(over)
    return o


def tier_with(path, *prompts, salts=None, **over):
    """A disk tier holding ``prompts`` (all evicted from the device); returns its options."""
    o = opts(path, **over)
    with make(**o) as cache:
        for i, p in enumerate(prompts):
            fill(cache, f"p{i}", p, **({"cache_salt": salts[i]} if salts and salts[i] else {}))
            cache.free(f"p{i}")
        flush_device(cache)
    return o


def listing(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


def run_py(body: str, timeout: float = 120):
    return subprocess.run([sys.executable, "-c", HEADER + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout)


def index_records(path, capacity=8):
    return np.fromfile(os.path.join(path, "index.bin"), dtype=slot_dtype(BS), count=capacity)


def slot_of(path, tokens, capacity=8):
    r = index_records(path, capacity)
    for s in np.flatnonzero(r["valid"] == 1):
        if r["parent"][s] == -1 and np.array_equal(r["tokens"][s], tokens[:BS]):
            return int(s)
    raise AssertionError("no such root slot")


# ---- a full filesystem -------------------------------------------------------------------
def test_a_file_size_limit_at_creation_is_a_typed_oserror_and_the_directory_is_left_as_it_was(tmp_path):
    # RLIMIT_FSIZE with SIGXFSZ ignored makes the reservation fail with EFBIG, as ENOSPC would.
    (tmp_path / "keep.txt").write_text("mine")
    r = run_py(f"""
        import errno, os, resource, signal
        from pagedkv.errors import TierStorageError
        from tier_helpers import make
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        for d in ({str(tmp_path / "new" / "tier")!r}, {str(tmp_path)!r}):
            try:
                make(num_blocks=4, prefix_disk_dir=d, prefix_disk_blocks=4096)
            except TierStorageError as e:
                assert isinstance(e, OSError) and isinstance(e, ValueError) and e.errno == errno.EFBIG, e
                print(str(e))
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("prefix_disk_blocks: expected room for 2097152 bytes in ") and \
            line.endswith("blocks.bin', got EFBIG (File too large)"), line
    assert listing(tmp_path) == ["keep.txt"]               # no tier/, no lock, no half-made files


def test_the_tier_files_have_their_space_reserved_at_creation_and_at_open(tmp_path):
    def reserved(name):
        st = os.stat(tmp_path / name)
        return st.st_blocks * 512 >= st.st_size > 0

    o = opts(tmp_path, prefix_disk_blocks=64)
    with make(**o):
        assert reserved("blocks.bin") and reserved("index.bin")
    size = os.path.getsize(tmp_path / "blocks.bin")
    os.unlink(tmp_path / "blocks.bin")                      # an empty tier written sparse (older pagedkv)
    with open(tmp_path / "blocks.bin", "wb") as f:
        f.truncate(size)
    assert not reserved("blocks.bin")
    with make(**o):
        assert reserved("blocks.bin")


def test_more_blocks_than_the_disk_holds_are_refused_before_anything_is_created(tmp_path):
    big = dict(num_kv_heads=8, head_dim=128, block_size=16)            # 256 KiB a record
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    n = min(2 * (free // (256 << 10)) + 16, 2**31 - 1)
    with pytest.raises(TierStorageError, match=r"prefix_disk_blocks: expected at most \d+ blocks \(\d+ bytes free "
                                               rf"in '.*/t'\), got {n} \(\d+ bytes\)") as e:
        make(**opts(tmp_path / "t", prefix_disk_blocks=n, **big))
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert listing(tmp_path) == []
    with pytest.raises(InvalidArgumentError, match=r"prefix_disk_blocks: expected an int in \[1, 2147483647\] "
                                                   r"\(tier slot ids are int32\), got 1099511627776"):
        make(**opts(tmp_path / "t", prefix_disk_blocks=2**40))
    assert listing(tmp_path) == []


def test_an_index_larger_than_host_memory_is_a_memory_error(tmp_path):
    # 2**31 - 1 slots of 16-token records: a 280 GiB index, over any test machine's memory
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert have < (2**31 - 1) * 124
    with pytest.raises(HostMemoryError, match=r"prefix_disk_blocks: expected a tier index that fits in host memory"):
        make(**opts(tmp_path / "t", prefix_disk_blocks=2**31 - 1, block_size=16))
    assert listing(tmp_path) == []


# ---- crash consistency ------------------------------------------------------------------------
WRITER = """
    import numpy as np
    from tier_helpers import fill, make
    rng = np.random.default_rng({seed})
    with make(num_blocks=6, prefix_disk_dir={path!r}, prefix_disk_blocks=12, prefix_tier_write="through") as c:
        print("ready", flush=True)
        i = 0
        while True:
            base = int(rng.integers(0, 6)) * 100
            toks = np.arange(base, base + 4 * int(rng.integers(1, 4)) + 1, dtype=np.int32)
            fill(c, i, toks, cache_salt=str(int(rng.integers(0, 3))))
            c.free(i)
            if i % 23 == 22:
                c.reset_prefix_cache()
            i += 1
"""


def test_a_writer_killed_at_random_points_leaves_a_tier_that_reopens_and_serves_exact_kv(tmp_path):
    rnd = random.Random(2501)
    for round_ in range(4):
        p = subprocess.Popen([sys.executable, "-c", HEADER + textwrap.dedent(WRITER.format(seed=round_,
                              path=str(tmp_path)))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rnd.uniform(0.05, 1.0))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        with make(num_blocks=6, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=12) as cache:
            cache.check_invariants()
            for base in range(0, 600, 100):
                for salt in "012":
                    toks = np.arange(base, base + 13, dtype=np.int32)
                    fill(cache, "q", toks, cache_salt=salt)
                    assert_kv(cache, "q", toks)              # whatever hit is exact
                    cache.free("q")
            assert_clean(cache)


def test_an_orphaned_record_costs_its_chain_not_the_tier(tmp_path):
    a, b = prompt(100), prompt(500)
    o = tier_with(tmp_path, a, b)
    s = slot_of(tmp_path, a)
    with open(tmp_path / "index.bin", "r+b") as f:        # a's root emptied, its children still sealed
        f.seek(s * slot_dtype(BS).itemsize)
        f.write(b"\x00")
    with make(**o) as cache:
        assert cache.match_prefix(a) == 0
        assert fill(cache, "b", b) == 12                     # the rest of the tier still serves
        assert_kv(cache, "b", b)
        cache.free("b")
        assert_clean(cache)
    with make(**o) as cache:                                 # the drop was persisted
        assert cache.match_prefix(a) == 0 and cache.match_prefix(b) == 12


def test_a_record_whose_namespace_never_reached_namespaces_json_is_a_miss(tmp_path):
    a, b = prompt(100), prompt(500)
    o = tier_with(tmp_path, a, b, salts=[None, "x"])
    keys = json.loads((tmp_path / "namespaces.json").read_text())
    assert len(keys) == 2
    (tmp_path / "namespaces.json").write_text(json.dumps(keys[:1]))
    with make(**o) as cache:
        assert cache.match_prefix(b, cache_salt="x") == 0
        assert fill(cache, "a", a) == 12
        assert_kv(cache, "a", a)
        cache.free("a")
        assert_clean(cache)


def test_a_failed_namespace_write_changes_nothing_and_the_tier_reopens(tmp_path):
    a, b = prompt(100), prompt(500)
    tier_with(tmp_path, a)
    before = (tmp_path / "namespaces.json").read_text()
    r = run_py(f"""
        import errno, os, resource, signal, warnings
        import numpy as np
        from pagedkv.errors import TierStorageError
        from tier_helpers import assert_kv, fill, make
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        b = np.arange(500, 513, dtype=np.int32)
        with make(num_blocks=4, prefix_disk_dir={str(tmp_path)!r}, prefix_disk_blocks=8,
                  prefix_tier_write="through") as c:
            disk = c._tiers.disk
            keys = list(disk.ns_keys)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8, resource.RLIM_INFINITY))
            try:
                disk.namespace(b"k" * 16, create=True)
            except TierStorageError as e:
                assert isinstance(e, OSError) and e.errno == errno.EFBIG
                print(str(e))
            assert disk.ns_keys == keys and b"k" * 16 not in disk.ns_ids
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                fill(c, "b", b, cache_salt="x")        # the cache call succeeds; b is not written down
            assert any("block not written down" in str(x.message) for x in w), [str(x.message) for x in w]
            assert_kv(c, "b", b)
            c.free("b")
            c.check_invariants()
            print(disk.num_write_errors)
    """)
    assert r.returncode == 0, r.stderr
    err, count = r.stdout.splitlines()
    assert err.endswith("namespaces.json: expected room to write it, got EFBIG (File too large)"), err
    assert int(count) == 4                                   # the direct call, then each of b's 3 full blocks
    assert (tmp_path / "namespaces.json").read_text() == before
    assert "namespaces.json.tmp" not in os.listdir(tmp_path)
    with make(**opts(tmp_path)) as cache:                    # reopens; a still hits, b never reached disk
        assert cache.match_prefix(a) == 12
        assert cache.match_prefix(b, cache_salt="x") == 0


def test_a_stamp_of_2_64_minus_1_is_harmless(tmp_path):
    a, b = prompt(100), prompt(500)
    o = tier_with(tmp_path, a)
    s = slot_of(tmp_path, a)
    dt = slot_dtype(BS)
    with open(tmp_path / "index.bin", "r+b") as f:           # stamp is outside the record's CRC
        f.seek(s * dt.itemsize + dt.fields["stamp"][1])
        f.write((2**64 - 1).to_bytes(8, "little"))
    for _ in range(2):
        with make(**o) as cache:
            assert fill(cache, "a", a) == 12
            assert_kv(cache, "a", a)
            cache.free("a")
            fill(cache, "b", b)                              # touches and inserts: the clock moves on
            cache.free("b")
            flush_device(cache)
            assert_clean(cache)


# ---- symbolic links, FIFOs, foreign files ---------------------------------------------------
def test_a_planted_blocks_bin_symlink_is_refused_and_its_target_untouched(tmp_path):
    d = tmp_path / "tier"
    o = tier_with(d, prompt(100), prefix_tier_write="through")
    outside = tmp_path / "outside.bin"
    os.replace(d / "blocks.bin", outside)
    os.symlink(outside, d / "blocks.bin")
    before = outside.read_bytes()
    with pytest.raises(TierFileError, match=r"/tier/blocks\.bin: expected a regular file owned by this user "
                                            r"\(uid \d+\), got a symbolic link"):
        make(**o)
    assert outside.read_bytes() == before and os.path.islink(d / "blocks.bin")


def test_a_planted_meta_tmp_symlink_is_refused_and_nothing_is_written_outside(tmp_path):
    d = tmp_path / "tier"
    d.mkdir()
    outside = tmp_path / "victim.txt"
    outside.write_text("precious")
    os.symlink(outside, d / "meta.json.tmp")
    with pytest.raises(TierFileError, match=r"meta\.json\.tmp: expected a regular file owned by this user "
                                            r"\(uid \d+\), got a symbolic link"):
        make(**opts(d))
    assert outside.read_text() == "precious"
    assert listing(d) == ["meta.json.tmp"]                   # left as it was


def test_a_planted_lock_symlink_creates_nothing_outside(tmp_path):
    d = tmp_path / "tier"
    d.mkdir()
    os.symlink(tmp_path / "created-outside", d / "lock")
    with pytest.raises(TierFileError, match=r"/tier/lock: expected a regular file owned by this user \(uid \d+\), "
                                            r"got a symbolic link"):
        make(**opts(d))
    assert not os.path.lexists(tmp_path / "created-outside")


def test_a_lock_that_is_a_directory_is_refused(tmp_path):
    (tmp_path / "lock").mkdir()
    with pytest.raises(TierFileError, match=r"/lock: expected a regular file owned by this user \(uid \d+\), "
                                            r"got a directory"):
        make(**opts(tmp_path))


@pytest.mark.parametrize("name", ["meta.json", "namespaces.json", "blocks.bin", "lock"])
def test_a_fifo_in_the_tier_directory_is_refused_without_blocking(tmp_path, name):
    o = tier_with(tmp_path / "t", prompt(100))
    os.unlink(tmp_path / "t" / name)
    os.mkfifo(tmp_path / "t" / name)
    r = run_py(f"""
        from pagedkv.errors import TierFileError
        from tier_helpers import make
        try:
            make(**{o!r})
        except TierFileError as e:
            print(e)
    """, timeout=60)                                           # main: open() of a FIFO waits forever
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(f"/t/{name}: expected a regular file owned by this user "
                                     f"(uid {os.geteuid()}), got a FIFO"), r.stdout


def test_a_tier_file_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    o = tier_with(tmp_path, prompt(100))
    if os.geteuid() == 0:
        os.chown(tmp_path / "index.bin", 4242, 4242)
        other = 4242
    else:                                                      # cannot chown: be another user instead
        other = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: other + 1)
        os.chmod(tmp_path, 0o755)
        monkeypatch.setattr(os, "fstat", _as_owner(os.fstat, other + 1, str(tmp_path)))
    with pytest.raises(TierFileError, match=rf"index\.bin: expected a regular file owned by this user "
                                            rf"\(uid \d+\), got a file owned by uid {other}"):
        make(**o)


def _as_owner(fstat, uid, path):
    def patched(fd):                                           # the directory itself stays ours
        st = fstat(fd)
        if os.path.samestat(st, os.stat(path)):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, uid) + tuple(st)[5:])
        return st
    return patched


def test_a_world_writable_tier_directory_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(TierFileError, match=r"prefix_disk_dir: expected a directory owned by this user \(uid \d+\) "
                                            r"and not writable by others, got '.*/shared' writable by every user "
                                            r"\(mode 777\)"):
        make(**opts(d))
    assert listing(d) == []


def test_a_stale_temporary_of_ours_is_replaced(tmp_path):
    o = tier_with(tmp_path, prompt(100))
    (tmp_path / "namespaces.json.tmp").write_text("half a write")
    with make(**o) as cache:
        fill(cache, "x", prompt(700), cache_salt="new")
        cache.free("x")
        flush_device(cache)                                    # x goes down: namespaces.json is written
    assert "namespaces.json.tmp" not in os.listdir(tmp_path)
    assert len(json.loads((tmp_path / "namespaces.json").read_text())) == 2


# ---- other typed errors ------------------------------------------------------------------------
def test_a_prefix_disk_dir_with_a_nul_byte_is_refused(tmp_path):
    # CacheConfig refuses it first (the tier's own check stays for direct use)
    with pytest.raises(InvalidArgumentError, match=r"prefix_disk_dir: expected a directory path \(a str without NUL "
                                                   r"bytes\), got '"):
        make(**opts(str(tmp_path) + "/a\0x"))


@pytest.mark.parametrize("value", [[1, 2], "llama", 7, None])
def test_a_meta_json_whose_kv_format_is_not_an_object_is_refused(tmp_path, value):
    o = tier_with(tmp_path, prompt(100))
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["kv_format"] = value
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TierFileError, match=rf"meta\.json: expected kv_format as a JSON object, got "
                                            rf"{type(value).__name__} "):
        make(**o)


def test_a_deeply_nested_meta_json_is_refused(tmp_path):
    o = tier_with(tmp_path, prompt(100))
    (tmp_path / "meta.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(TierFileError, match=r"meta\.json: expected a readable pagedkv prefix-tier JSON file, "
                                            r"got RecursionError"):
        make(**o)


def test_an_unwritable_tier_directory_is_a_typed_oserror(tmp_path):
    f = tmp_path / "plain-file"
    f.write_text("x")
    with pytest.raises(TierStorageError, match=r"prefix_disk_dir: expected a directory pagedkv can create and "
                                               r"open, got ENOTDIR") as e:
        make(**opts(f / "tier"))
    assert e.value.errno == errno.ENOTDIR and isinstance(e.value, OSError)
    # /proc/self is ours and not writable by anyone (root included)
    with pytest.raises(TierStorageError, match=r"/proc/self/lock: expected a file pagedkv can open, got E"):
        make(**opts("/proc/self"))
    if os.geteuid() != 0:                                      # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        with pytest.raises(TierStorageError, match=r"/ro/lock: expected a file pagedkv can open, got EACCES"):
            make(**opts(ro))


# ---- close releases everything ----------------------------------------------------------------
def test_close_releases_descriptors_and_maps_without_the_garbage_collector(tmp_path):
    def held():
        fds = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/maps") as f:
            maps = sum(str(tmp_path) in line for line in f)
        return fds, maps

    gc.collect()
    gc.disable()
    try:
        before = held()
        cache = make(**opts(tmp_path))
        fill(cache, "a", prompt(100))
        cache.free("a")
        assert held()[1] == 2                                  # blocks.bin and index.bin are mapped
        cache.close()
        assert held() == before
    finally:
        gc.enable()
