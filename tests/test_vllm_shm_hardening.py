"""The vLLM connector's shared memory under hostile files (issue 32): ``/dev/shm`` is
world-writable, so what a neighbour plants there may cost a miss or a logged refusal,
never an untyped exception in vLLM's worker step, a hang at engine start, or a partial
copy. No vLLM needed: the arena, the worker's mover, the settings and the store."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, PagedKVError, TierFileError
from pagedkv.integrations import vllm_shm
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_shm import HEADER, MAGIC, SharedArena, shm_dir
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

BS, H, D, L, N = 4, 2, 8, 2, 6
NS = b"model\x00\x00"


@pytest.fixture
def planted():
    """Paths planted in the shared-memory directory, removed after the test."""
    made = []

    def plant(name=None):
        p = shm_dir() / (name or f"pagedkv-vllm-{os.getpid()}-{secrets.token_hex(8)}")
        made.append(p)
        return p

    yield plant
    for p in made:
        if os.path.lexists(p):
            os.unlink(p)


def write_arena(path, blob: bytes, size: int = 8192, length=None):
    n = len(blob) if length is None else length
    raw = MAGIC + n.to_bytes(8, "little") + blob
    path.write_bytes(raw + b"\0" * (size - len(raw)))


def make_store(**cfg):
    store = PrefixStore(ConnectorConfig.from_extra(dict({"host_blocks": 8}, **cfg)),
                        KVSpec(L, H, BS, D, torch.bfloat16), "model")
    g = torch.Generator().manual_seed(0)
    store.kv = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    store.mover = BlockMover()
    assert store.mover.register(store.spec, store.kv) is None
    return store


def real_layout():
    s = make_store()
    try:
        return dict(s.arena.layout), s.arena.layout["offsets"][-1]
    finally:
        s.close()


def forged_headers():
    lay, size = real_layout()

    def with_(**kw):
        return json.dumps(dict(lay, **kw)).encode(), size

    return {
        "a list (the issue's repro)": (b"[1]", 8192),
        "null": (b"null", 8192),
        "a string": (b'"x"', 8192),
        "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, 8192),
        "not UTF-8": (b"\xff\xfe{}", 8192),
        "truncated JSON": (b'{"num_layers": ', 8192),
        "lying offsets": with_(offsets=[HEADER, HEADER + 64]),
        "offsets of strings": with_(offsets=["a"] * len(lay["offsets"])),
        "capacity larger than the file": with_(capacity=10**6),
        "capacity 0": with_(capacity=0),
        "capacity a float": with_(capacity=8.0),
        "capacity true": with_(capacity=True),
        "num_layers 2**70": with_(num_layers=2**70),
        "a negative shape": with_(arenas=[["bfloat16", [-2, 4, 16]]]),
        "a shape of strings": with_(arenas=[["bfloat16", ["2"]]]),
        "an unknown dtype": with_(arenas=[["complex64", [2, 4, 16]]]),
        "arenas a dict": with_(arenas={"a": 1}),
        "no arenas": with_(arenas=[]),
        "missing keys": (json.dumps({"offsets": [HEADER]}).encode(), HEADER),
    }


@pytest.mark.parametrize("label", list(forged_headers()))
def test_a_forged_header_is_a_tier_file_error(planted, label):
    blob, size = forged_headers()[label]
    p = planted()
    write_arena(p, blob, size=max(size, len(MAGIC) + 8 + len(blob)))
    with pytest.raises(TierFileError, match="shared arena"):
        SharedArena.open(p.name)


@pytest.mark.parametrize("length", [0, 1, 2**64 - 1, HEADER])
def test_a_lying_header_length_is_a_tier_file_error(planted, length):
    p = planted()
    write_arena(p, b"{}", length=length)
    with pytest.raises(TierFileError, match="shared arena header"):
        SharedArena.open(p.name)


def test_a_lying_header_never_reaches_the_worker_step(planted):
    # BlockMover.arena turns every failure below it into a refusal: a miss, logged
    s = make_store()
    try:
        for label, (blob, size) in forged_headers().items():
            p = planted()
            write_arena(p, blob, size=max(size, len(MAGIC) + 8 + len(blob)))
            got, why, new = s.mover.arena(p.name)
            assert got is None and new and "cannot map the shared arena" in why, label
            assert s.mover.arena(p.name) == (None, why, False)        # refused once, remembered
    finally:
        s.close()


@pytest.mark.parametrize("field,value", [("storage", "int2"), ("storage", ["bf16"]), ("kv_heads", "2"),
                                         ("dtype", None), ("rotation_seed", 2**70), ("head_size", None)])
def test_a_header_with_a_bad_kv_field_is_refused_by_the_worker(planted, field, value):
    s = make_store()
    try:
        lay = dict(s.arena.layout, **{field: value})
        p = planted()
        write_arena(p, json.dumps(lay).encode(), size=lay["offsets"][-1])
        got, why, _ = s.mover.arena(p.name)
        assert got is None and field in why
    finally:
        s.close()


def test_a_symlinked_arena_name_is_refused(planted):
    s = make_store()
    try:
        link = planted()
        os.symlink(s.arena.path, link)
        with pytest.raises(TierFileError, match="symlink"):
            SharedArena.open(link.name)
        assert s.mover.arena(link.name)[0] is None
        assert s.mover.arena(s.arena.name)[0] is not None         # the arena itself maps
    finally:
        s.close()


def test_a_fifo_or_a_directory_under_an_arena_name_is_refused(planted):
    fifo, d = planted(), planted()
    os.mkfifo(fifo)
    os.mkdir(d)
    try:
        for p in (fifo, d):
            with pytest.raises(TierFileError, match="shared arena"):
                SharedArena.open(p.name)
    finally:
        os.rmdir(d)


SWEEP = """
import sys
from pathlib import Path
from pagedkv.integrations.vllm_shm import sweep_stale
print(sorted(sweep_stale(Path(sys.argv[1]))))
"""


def _sweep_in_child(directory) -> str:
    p = subprocess.run([sys.executable, "-c", SWEEP, str(directory)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


def test_sweep_never_blocks_on_a_fifo_or_raises_on_hostile_json(tmp_path):
    # every engine start runs the sweep: a FIFO under a status name hung it for good
    os.mkfifo(tmp_path / "pagedkv-vllm-worker-0000000000000000.json")
    bad = {"1": b'{"pid": 1e400}', "2": b"[" * 100_000, "3": b"\xff", "4": b'{"pid": true}', "5": b"[1]",
           "6": b'{"pid": -5}', "7": b'{"pid": 99999999999999999999}', "8": b'{"pid": "1"}'}
    for k, raw in bad.items():
        (tmp_path / f"pagedkv-vllm-worker-{k * 16}.json").write_bytes(raw)
    (tmp_path / "pagedkv-vllm-worker-big.json").write_bytes(b" " * (1 << 20))
    (tmp_path / ("pagedkv-vllm-" + "9" * 200 + "-0123456789abcdef")).write_bytes(b"x")
    os.mkdir(tmp_path / "pagedkv-vllm-999999999-0123456789abcdef")
    dead = tmp_path / "pagedkv-vllm-999999998-0123456789abcdef"
    dead.write_bytes(b"x")
    os.symlink(dead, tmp_path / "pagedkv-vllm-999999997-0123456789abcdef")
    status = tmp_path / "pagedkv-vllm-worker-aaaaaaaaaaaaaaaa.json"
    status.write_text(json.dumps({"pid": 999999996, "refused": None}))
    out = _sweep_in_child(tmp_path)
    # only dead engines' own regular files go (a status naming no possible pid is dead too);
    # nothing is followed, and what is not a status of an int pid is left alone
    no_pid = [f"pagedkv-vllm-worker-{k * 16}.json" for k in "67"]
    assert out == repr(sorted([dead.name, status.name] + no_pid))
    assert (tmp_path / "pagedkv-vllm-999999997-0123456789abcdef").is_symlink()
    assert (tmp_path / "pagedkv-vllm-worker-0000000000000000.json").exists()


def test_status_files_are_read_without_blocking_or_following(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert vllm_shm.read_status(fifo) is None
    assert time.monotonic() - t0 < 5
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"pid": os.getpid(), "refused": None}))
    assert vllm_shm.read_status(real) == {"pid": os.getpid(), "refused": None}
    os.symlink(real, tmp_path / "link.json")
    assert vllm_shm.read_status(tmp_path / "link.json") is None
    for raw in (b'{"pid": 1e400}', b"[" * 100_000, b'{"pid": 1, "refused": 5}', b"null"):
        real.write_bytes(raw)
        assert vllm_shm.read_status(real) is None


@pytest.mark.parametrize("kind", ["save", "load"])
@pytest.mark.parametrize("pairs", [[(0, 99)], [(99, 0)], [(-1, 0)], [(0, 1), (2, 10**9)], [(0, 1), (1, 1)],
                                   [(0, True)], [(0, 1.0)], [("0", 1)], [(0, 1, 2)], [0], "ab", 5, [(0, None)]],
                         ids=str)
def test_block_mover_checks_every_pair_before_copying(kind, pairs):
    s = make_store()
    try:
        sa, codec = s.mover.arena(s.arena.name)[0]
        s.mover.save(sa, codec, [(b, b) for b in range(N)])      # slots 0..5 hold blocks 0..5
        s.kv[0][:] = 0
        s.kv[1][:] = 0
        arena_before = [t.clone() for t in sa.tensors]
        kv_before = [t.clone() for t in s.kv]
        with pytest.raises((InvalidArgumentError, ArgumentTypeError)) as err:
            getattr(s.mover, kind)(sa, codec, pairs)
        assert isinstance(err.value, PagedKVError)
        assert all(torch.equal(a, b) for a, b in zip(sa.tensors, arena_before))     # nothing copied
        assert all(torch.equal(a, b) for a, b in zip(s.kv, kv_before))
    finally:
        s.close()


@pytest.mark.parametrize("extra", [5, "abc", ["host_blocks"], 1.5, b"x", object()], ids=repr)
def test_connector_settings_that_are_no_mapping_are_a_type_error(extra):
    with pytest.raises(ArgumentTypeError, match=r"kv_connector_extra_config: expected a mapping"):
        ConnectorConfig.from_extra(extra)


@pytest.mark.parametrize("key", ["lock_timeout_s", "report_timeout_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 10**9, "5", None])
def test_connector_timeouts_are_finite_and_bounded(key, value):
    with pytest.raises(InvalidArgumentError, match=rf"\['{key}'\]: expected a finite number of seconds"):
        ConnectorConfig.from_extra({key: value})


def test_connector_settings_with_keys_of_any_type_are_named():
    with pytest.raises(InvalidArgumentError, match="unknown key 1"):
        ConnectorConfig.from_extra({1: 2, "host_blocks": 4})


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def admit(store, tokens, blocks):
    parent, saves = -1, []
    for i, b in enumerate(blocks):
        slot, created = store.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
        assert slot >= 0 and created
        saves.append((b, slot))
        parent = slot
    return saves


def test_a_report_that_never_comes_releases_the_step_after_the_timeout():
    s = make_store(report_timeout_s=30.0)
    try:
        s.worker_ready = True
        t = toks(2 * BS + 1, 1)
        saves = admit(s, t, [0, 1])
        s.sent(1, [slot for _, slot in saves], [])
        assert s.pending and int(s.host.index.busy.sum()) == 2
        assert s.expire(time.monotonic() + 29.0) == 0                  # not yet due
        assert s.expire(time.monotonic() + 31.0) == 2                  # the report never came
        assert not s.pending and int(s.host.index.busy.sum()) == 0
        assert s.num_report_timeouts == 2 and s.host.index.num_used == 0
        # the late report changes nothing (its slots may hold other blocks by now)
        saves2 = admit(s, toks(BS + 1, 2), [3])
        s.sent(2, [saves2[0][1]], [])
        s.committed([slot for _, slot in saves], step=1)
        assert saves2[0][1] in s.pending
        s.committed([saves2[0][1]], step=2)
        assert not s.pending and s.lookup(toks(BS + 1, 2), NS, 1) == [saves2[0][1]]
    finally:
        s.close()


def test_an_unreported_load_releases_its_lease_after_the_timeout():
    s = make_store(report_timeout_s=1.0)
    try:
        s.worker_ready = True
        t = toks(BS + 1, 3)
        saves = admit(s, t, [0])
        s.sent(1, [saves[0][1]], [])
        s.committed([saves[0][1]], step=1)
        chain = s.lookup(t, NS, 1)
        s.lease(chain)
        s.sent(2, [], chain)
        assert int(s.host.index.busy.sum()) == 1
        assert s.expire(time.monotonic() + 2.0) == 1
        assert int(s.host.index.busy.sum()) == 0 and s.num_report_timeouts == 1
        s.loaded(chain, ok=True, step=2)                                # late: nothing to release twice
        assert int(s.host.index.busy.sum()) == 0
        assert (s.host.index.busy >= 0).all()
    finally:
        s.close()


def test_a_report_settles_only_its_own_step():
    s = make_store()
    try:
        a = admit(s, toks(BS + 1, 4), [0])
        s.sent(1, [a[0][1]], [])
        s.committed([a[0][1]], step=7)                                  # not step 7's save
        assert a[0][1] in s.pending
        s.abandon([a[0][1]], step=1)
        assert not s.pending and int(s.host.index.busy.sum()) == 0
    finally:
        s.close()
