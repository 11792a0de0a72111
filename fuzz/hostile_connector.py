"""Hostile input against the vLLM connector's two sides (issue 32), without vLLM: the
worker side (:class:`~pagedkv.integrations.vllm_worker.BlockMover` mapping an arena by
the name the step's metadata carries, and copying the step's pairs), the scheduler
side's store (:class:`~pagedkv.integrations.vllm_store.PrefixStore`: lookups, admission,
the worker's reports), the settings (``ConnectorConfig.from_extra``) and the shared
memory directory, where any local user can plant files (``SharedArena.open``,
``sweep_stale`` at every engine start, the worker status file).

Verdicts as in :mod:`hostile_surfaces`: ``typed`` (a pagedkv error, or for the worker
side a logged refusal of the arena, with the state unchanged: the arena's and vLLM's KV
bytes, the store's index, leases and pending slots, the directory), ``accepted`` (a
valid input whose result was checked: loads give back what was saved, a miss for
tokens never stored), ``wrong-kv``, ``untyped:<class>``, ``state-changed``; the runner
adds ``crash`` and ``hang`` (a sweep that blocks on a FIFO is a hang).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
from hostile_surfaces import _deep, judge, scratch

BS, H, D, L, N = 4, 2, 8, 2, 6
NS = b"model\x00\x00"

_STORE = None


def store():
    """A store with its worker side registered (one per child), two blocks saved and
    committed under PROMPT."""
    global _STORE
    if _STORE is None:
        import torch

        from pagedkv.integrations.vllm_config import ConnectorConfig
        from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
        from pagedkv.integrations.vllm_worker import BlockMover
        s = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8}), KVSpec(L, H, BS, D, torch.bfloat16), "model")
        g = torch.Generator().manual_seed(0)
        s.kv = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
        s.mover = BlockMover()
        s.mover.register(s.spec, s.kv)
        s.worker_ready = True
        parent, saves = -1, []
        for i, b in enumerate((0, 1)):
            slot, _ = s.admit(parent, PROMPT[i * BS:(i + 1) * BS], NS)
            saves.append((b, slot))
            parent = slot
        sa, codec = s.mover.arena(s.arena.name)[0]
        s.mover.save(sa, codec, saves)
        s.committed([slot for _, slot in saves])
        s.saved = {slot: [t[b].clone() for t in s.kv] for b, slot in saves}
        _STORE = s
    return _STORE


PROMPT = np.arange(500, 500 + 2 * BS + 1, dtype=np.int32)


def store_state(s) -> tuple:
    h = hashlib.sha256()
    for t in s.arena.tensors + s.kv:
        h.update(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    rec = s.host.index.rec
    return (h.hexdigest(), rec.tobytes(), s.host.index.busy.tobytes(), s.host.index.pins.tobytes(),
            tuple(sorted(s.pending)), tuple(sorted(s._sent)), s.num_report_timeouts)


# ---- the shared-memory directory -------------------------------------------------------------
def planted_name() -> str:
    return f"pagedkv-vllm-{os.getpid()}-{secrets.token_hex(8)}"


def _layout():
    s = store()
    return dict(s.arena.layout), s.arena.layout["offsets"][-1]


def _write_arena(path, blob: bytes, size: int, length=None):
    from pagedkv.integrations.vllm_shm import MAGIC
    n = len(blob) if length is None else length
    raw = MAGIC + n.to_bytes(8, "little") + blob
    with open(path, "wb") as f:
        f.write(raw)
        f.truncate(max(size, len(raw)))


def forged():
    lay, size = _layout()

    def with_(**kw):
        return json.dumps(dict(lay, **kw)).encode(), size

    cases = [("header [1]", b"[1]", 8192, None), ("header null", b"null", 8192, None),
             ("header deep 100000", _deep(100_000), 8192, None), ("header not UTF-8", b"\xff\xfe{}", 8192, None),
             ("header length 0", b"{}", 8192, 0), ("header length 2**64-1", b"{}", 8192, 2**64 - 1),
             ("header a 6000-digit number", b'{"capacity": ' + b"9" * 6000 + b"}", 8192, None)]
    for label, kw in [("offsets lie", dict(offsets=[4096, 4160])), ("capacity past the file", dict(capacity=10**6)),
                      ("capacity 0", dict(capacity=0)), ("capacity 8.0", dict(capacity=8.0)),
                      ("num_layers 2**70", dict(num_layers=2**70)), ("shape negative", dict(arenas=[["bfloat16", [-2]]])),
                      ("dtype complex", dict(arenas=[["complex64", [2, 4, 16]]])), ("arenas a dict", dict(arenas={})),
                      ("storage int2", dict(storage="int2")), ("kv_heads '2'", dict(kv_heads="2")),
                      ("dtype None", dict(dtype=None)), ("rotation_seed 2**70", dict(rotation_seed=2**70)),
                      ("head_size 0", dict(head_size=0)), ("another KV shape", dict(kv_heads=3))]:
        blob, sz = with_(**kw)
        cases.append((f"header {label}", blob, sz, None))
    return cases


def open_case(make: Callable[[str], Any]) -> str:
    """Plant what ``make(path)`` makes under a fresh arena name: ``SharedArena.open`` must
    refuse it typed, and the worker's ``arena()`` must log a refusal, never raise."""
    from pagedkv.integrations.vllm_shm import SharedArena, TierFileError, shm_dir
    name = planted_name()
    path = str(shm_dir() / name)
    try:
        make(path)
        before = _dir_entry(path)
        # a header of the right form whose KV fields are wrong maps; the worker refuses it
        v = judge(lambda: SharedArena.open(name), state=lambda: _dir_entry(path), base=TierFileError,
                  accept=lambda sa: "accepted")
        if v not in ("typed", "accepted"):
            return v
        try:
            got, why, _ = store().mover.arena(name)
        except Exception as e:   # noqa: BLE001 - the verdict
            return f"untyped:{type(e).__name__} from BlockMover.arena: {str(e)[:60]}"
        if got is not None or not why:
            return "accepted-bad"
        return "typed" if _dir_entry(path) == before else "state-changed"
    finally:
        if os.path.lexists(path):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)


def _dir_entry(path: str):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    digest = ""
    if os.path.isfile(path) and not os.path.islink(path) and st.st_size < 1 << 20:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return st.st_mode, st.st_size, digest


def shm_cases(smoke: bool):
    cases = []

    def add(label, make):
        cases.append(("connector", f"connector: planted arena, {label}", lambda m=make: open_case(m)))

    for label, blob, size, length in (forged()[:6] if smoke else forged()):
        add(label, lambda p, b=blob, s=size, n=length: _write_arena(p, b, s, n))

    def link(p):
        os.symlink(store().arena.path, p)

    def huge(p):
        _write_arena(p, b"[1]", 8192)
        os.truncate(p, 1 << 40)                       # sparse: nothing may read it whole
    extras = [("a symlink to a real arena", link), ("a FIFO", os.mkfifo), ("a directory", os.mkdir),
              ("empty", lambda p: open(p, "wb").close()), ("a sparse terabyte", huge),
              ("shorter than its header", lambda p: open(p, "wb").write(b"PAGEDKV"))]
    for label, make in extras[:3] if smoke else extras:
        add(label, make)
    names = [("None", None), ("an int", 5), ("'../x'", "../x"), ("a 5000-char name", "p" * 5000),
             ("NUL", "pagedkv-vllm-1-\x00"), ("a 20-digit pid", "pagedkv-vllm-" + "9" * 20 + "-0123456789abcdef"),
             ("no such arena", "pagedkv-vllm-1-0123456789abcdef")]
    for label, name in names[:3] if smoke else names:
        cases.append(("connector", f"connector: worker maps arena name {label}", lambda n=name: name_case(n)))
    return cases


def name_case(name) -> str:
    s = store()
    before = store_state(s)
    try:
        got, why, _ = s.mover.arena(name)
    except Exception as e:   # noqa: BLE001
        return f"untyped:{type(e).__name__}: {str(e)[:60]}"
    if got is not None:
        return "accepted-bad"
    return "typed" if why and store_state(s) == before else "state-changed"


SWEEP_PLANTS = [
    ("a FIFO status", lambda d: os.mkfifo(os.path.join(d, "pagedkv-vllm-worker-0000000000000000.json"))),
    ("status pid 1e400", lambda d: _put(d, "pagedkv-vllm-worker-1111111111111111.json", b'{"pid": 1e400}')),
    ("status [ x 100000", lambda d: _put(d, "pagedkv-vllm-worker-2222222222222222.json", b"[" * 100_000)),
    ("status a list", lambda d: _put(d, "pagedkv-vllm-worker-3333333333333333.json", b"[1]")),
    ("status pid true", lambda d: _put(d, "pagedkv-vllm-worker-4444444444444444.json", b'{"pid": true}')),
    ("status of a MiB", lambda d: _put(d, "pagedkv-vllm-worker-5555555555555555.json", b" " * (1 << 20))),
    ("status a symlink", lambda d: os.symlink("/etc/hostname", os.path.join(d, "pagedkv-vllm-worker-6666666666666666.json"))),
    ("an arena name of 200 digits", lambda d: _put(d, "pagedkv-vllm-" + "9" * 200 + "-0123456789abcdef", b"x")),
    ("an arena name that is a directory", lambda d: os.mkdir(os.path.join(d, "pagedkv-vllm-999999999-0123456789abcdef"))),
    ("an arena name that is a FIFO", lambda d: os.mkfifo(os.path.join(d, "pagedkv-vllm-999999998-0123456789abcdef"))),
]


def _put(d, name, raw: bytes):
    with open(os.path.join(d, name), "wb") as f:
        f.write(raw)


def sweep_case(plant) -> str:
    """``sweep_stale`` over a directory with ``plant`` in it and one dead engine's arena:
    it must return (a hang is the runner's verdict), remove only that arena, and leave
    every planted entry as it was."""
    from pathlib import Path

    from pagedkv.integrations.vllm_shm import sweep_stale
    d = os.path.join(scratch(), f"shm-{secrets.token_hex(4)}")
    os.makedirs(d)
    plant(d)
    dead = "pagedkv-vllm-999999990-0123456789abcdef"
    _put(d, dead, b"x")
    planted = {n: _dir_entry(os.path.join(d, n)) for n in os.listdir(d) if n != dead}

    def accept(gone):
        left = {n: _dir_entry(os.path.join(d, n)) for n in os.listdir(d)}
        if dead not in gone or dead in left:
            return "accepted-bad"
        kept = {n: v for n, v in left.items() if n in planted}
        lost = set(planted) - set(left)
        # a status that names a dead pid may go; anything else planted stays as it was
        if any(not n.startswith("pagedkv-vllm-worker-") or _dir_entry_kind(planted[n]) != "file" for n in lost):
            return "escape"
        return "accepted" if all(kept[n] == planted[n] for n in kept) else "state-changed"
    return judge(lambda: sweep_stale(Path(d)), accept=accept)


def _dir_entry_kind(entry) -> str:
    import stat
    return "file" if entry is not None and stat.S_ISREG(entry[0]) else "other"


def status_case(raw) -> str:
    from pagedkv.integrations.vllm_shm import read_status
    p = os.path.join(scratch(), f"status-{secrets.token_hex(4)}.json")
    if raw == "fifo":
        os.mkfifo(p)
    else:
        _put(os.path.dirname(p), os.path.basename(p), raw)
    return judge(lambda: read_status(p), accept=lambda r: "typed" if r is None else "accepted-bad")


# ---- the worker's copies ------------------------------------------------------------------------
PAIRS = [("block 99", [(99, 0)]), ("slot 99", [(0, 99)]), ("block -1", [(-1, 0)]), ("slot 10**9", [(0, 10**9)]),
         ("good then bad", [(2, 3), (3, 10**9)]), ("a slot twice", [(2, 3), (4, 3)]), ("True", [(True, 0)]),
         ("1.0", [(1.0, 0)]), ("'0'", [("0", 0)]), ("a triple", [(0, 1, 2)]), ("flat ints", [0, 1]), ("a str", "ab"),
         ("an int", 5), ("None in a pair", [(0, None)]), ("np.int64 pair", [(np.int64(2), np.int64(3))]),
         ("2**70", [(2**70, 0)])]


def copy_case(kind: str, pairs) -> str:
    import torch
    s = store()
    sa, codec = s.mover.arena(s.arena.name)[0]
    snap = [t.clone() for t in s.kv] + [t.clone() for t in sa.tensors]

    def state():
        return tuple(hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                     for t in list(s.kv) + list(sa.tensors))

    def restore():
        for t, o in zip(list(s.kv) + list(sa.tensors), snap):
            t.copy_(o)

    def accept(_):
        restore()
        return "accepted-bad"
    try:
        return judge(lambda: getattr(s.mover, kind)(sa, codec, pairs), state=state, accept=accept)
    finally:
        restore()


def roundtrip_case() -> str:
    """Control: a load of the committed prefix gives back the bytes saved."""
    import torch
    s = store()
    chain = s.lookup(PROMPT, NS, 2)
    if len(chain) != 2:
        return "wrong-kv"
    s.lease(chain)
    sa, codec = s.mover.arena(s.arena.name)[0]
    keep = [t.clone() for t in s.kv]
    try:
        s.mover.load(sa, codec, list(zip(chain, (4, 5))))
        ok = all(torch.equal(s.kv[layer][4 + i], s.saved[slot][layer]) for i, slot in enumerate(chain)
                 for layer in range(L))
    finally:
        s.loaded(chain, ok=True)
        for t, k in zip(s.kv, keep):
            t.copy_(k)
    return "accepted" if ok else "wrong-kv"


# ---- the scheduler side's store -------------------------------------------------------------------
def store_case(call: Callable[[Any], Any], accept=None, same_state: bool = True) -> str:
    """``same_state``: an accepted call must leave the store as it was too (a report of
    slots its step never sent); an admission of a block held already refreshes it."""
    s = store()
    before = store_state(s)

    def checked(result):
        v = accept(result)
        return v if v != "accepted" or not same_state or store_state(s) == before else "state-changed"
    return judge(lambda: call(s), state=lambda: store_state(s), accept=None if accept is None else checked)


TOKENS = [("floats", np.array([1.5] * 9)), ("int64 past int32", np.array([2**40] * 9)), ("a str", "abc"),
          ("None", None), ("2-D", np.ones((3, 3), np.int32)), ("negative", np.array([-5] * 9, np.int32)),
          ("empty", np.zeros(0, np.int32)), ("a list of ints", list(range(9)))]
SLOTS = [("-1", [-1]), ("10**9", [10**9]), ("1.5", [1.5]), ("'0'", ["0"]), ("None", [None]), ("a str", "ab"),
         ("True", [True]), ("2**70", [2**70])]


def store_cases(smoke: bool):
    cases = []

    def add(label, call, accept=None, same_state=True):
        cases.append(("connector", f"connector: store {label}",
                      lambda c=call, a=accept, k=same_state: store_case(c, a, k)))

    def miss(chain):
        return "accepted" if chain == [] else "wrong-kv"
    for label, t in TOKENS[:3] if smoke else TOKENS:
        add(f"lookup tokens {label}", lambda s, t=t: s.lookup(t, NS, 2), miss)
        add(f"admit tokens {label}", lambda s, t=t: s.admit(-1, t, NS))
    for label, v in [("-1", -1), ("2**40", 2**40), ("1.5", 1.5), ("None", None), ("True", True)]:
        add(f"lookup max_blocks {label}", lambda s, v=v: s.lookup(PROMPT, NS, v),
            lambda c, v=v: "accepted" if c == [] or (isinstance(v, int) and not isinstance(v, bool) and
                                                     v > 2 and len(c) == 2) else "wrong-kv")
        add(f"admit parent {label}", lambda s, v=v: s.admit(v, PROMPT[:BS], NS),
            lambda r, v=v: "accepted" if v == -1 and r == (s_first(), False) else "accepted-bad", v != -1)
    for label, ns in [("str", "model"), ("None", None), ("an int", 5), ("a list", [1])]:
        add(f"lookup ns_key {label}", lambda s, ns=ns: s.lookup(PROMPT, ns, 2), miss)
    for label, slots in SLOTS[:3] if smoke else SLOTS:
        # the worker's report, as update_connector_output passes it on: with a step
        add(f"report saved {label}", lambda s, v=slots: s.committed(v, step=12345),
            lambda _: "accepted")
        add(f"report loaded {label}", lambda s, v=slots: s.loaded(v, ok=True, step=12345),
            lambda _: "accepted")
        add(f"report save_failed {label}", lambda s, v=slots: s.abandon(v, step=12345),
            lambda _: "accepted")
    for label, step in [("None step, slots never sent", None), ("step -1", -1), ("step 'x'", "x")]:
        add(f"report saved of unsent slot 0, {label}", lambda s, st=step: s.committed([0], step=st),
            lambda _: "accepted")
    return cases


def s_first() -> int:
    """The slot of PROMPT's first block (committed by store())."""
    s = store()
    return s.lookup(PROMPT, NS, 1)[0]


# ---- settings ---------------------------------------------------------------------------------------
EXTRA = [("5", 5), ("'abc'", "abc"), ("['host_blocks']", ["host_blocks"]), ("{1: 2}", {1: 2}),
         ("host_blocks True", {"host_blocks": True}), ("host_blocks 2**70", {"host_blocks": 2**70}),
         ("host_blocks -1", {"host_blocks": -1}), ("disk_blocks '4'", {"disk_blocks": "4", "disk_dir": "/tmp/x"}),
         ("lock_timeout_s inf", {"lock_timeout_s": float("inf")}), ("lock_timeout_s nan", {"lock_timeout_s": float("nan")}),
         ("report_timeout_s 0", {"report_timeout_s": 0}), ("report_timeout_s 1e300", {"report_timeout_s": 1e300}),
         ("storage ['bf16']", {"storage": ["bf16"]}), ("eviction None", {"eviction": None}),
         ("disk_dir ''", {"disk_dir": ""}), ("disk_dir 5", {"disk_dir": 5}), ("weak_hash 1", {"weak_hash": 1}),
         ("rotation_seed 2**64", {"rotation_seed": 2**64}), ("model_tag 5", {"model_tag": 5}),
         ("unknown key", {"hostblocks": 4})]


def config_cases(smoke: bool):
    from pagedkv.integrations.vllm_config import ConnectorConfig
    out = [("connector", f"connector: kv_connector_extra_config {label}",
            lambda v=v: judge(lambda: ConnectorConfig.from_extra(v)))
           for label, v in (EXTRA[:6] if smoke else EXTRA)]
    out.append(("connector", "connector: kv_connector_extra_config None (control)",
                lambda: judge(lambda: ConnectorConfig.from_extra(None),
                              accept=lambda c: "accepted" if c.host_blocks == 256 else "accepted-bad")))
    return out


def surface_cases(smoke: bool) -> list[tuple[str, str, Callable[[], str]]]:
    cases = shm_cases(smoke)
    plants = SWEEP_PLANTS[:3] if smoke else SWEEP_PLANTS
    cases += [("connector", f"connector: engine-start sweep with {label}", lambda p=plant: sweep_case(p))
              for label, plant in plants]
    for label, raw in [("a FIFO", "fifo"), ("pid 1e400", b'{"pid": 1e400}'), ("[ x 100000", b"[" * 100_000),
                       ("refused 5", b'{"pid": 1, "refused": 5}')][: 2 if smoke else 4]:
        cases.append(("connector", f"connector: worker status {label}", lambda r=raw: status_case(r)))
    for kind in ("save", "load"):
        for label, pairs in PAIRS[:4] if smoke else PAIRS:
            name = f"connector: worker {kind} pairs {label}"
            if label == "np.int64 pair":       # numpy ints are ints a vLLM block table may hold: accepted
                cases.append(("connector", name, lambda k=kind, p=pairs: np_pair_case(k, p)))
            else:
                cases.append(("connector", name, lambda k=kind, p=pairs: copy_case(k, p)))
    cases.append(("connector", "connector: worker load of a committed prefix (control)", roundtrip_case))
    cases += store_cases(smoke)
    cases += config_cases(smoke)
    return cases


def np_pair_case(kind: str, pairs) -> str:
    v = copy_case(kind, pairs)
    return "accepted" if v == "accepted-bad" else v


def prepare() -> None:
    store()
