"""Hostile input against the public API, with the verdict for each: typed error and
state unchanged, or a failure class (crash, untyped error, state changed by a failing
call, a bad input accepted).

Every case builds a fresh small cache (sequences committed, forked, swapped out, a
cached prefix, KV written), snapshots everything a caller can observe (sequences,
tables, token ids, pool lists and counts, the K/V bytes), makes one bad call and
compares. Each bad value is tried in every argument position of every call that
takes that kind of argument, so the count grows with the API, not by hand.

Crashes are caught by running the cases in a child process that reports each case
before running it; when the child dies, the case it was on is a crash and a new child
resumes after it.

The cache is float32, or quantized with ``--kv-dtype`` (int3 and int4 run with head_dim
8, a whole int3 pack): the quantizing write and dequantizing gather then take the same
bad inputs, and the scale, zero-point and window arenas are part of what must not change.
``--kv-key-quant block`` (int4) adds the block keys' parameter arenas, with sealed blocks.

``--surfaces`` adds the surfaces of :mod:`hostile_surfaces` (fuzz/hostile_surfaces.py):
the disk tier's directory, a transfer peer, configs and the CLI; of :mod:`hostile_serving`
(``serving``: ``PagedCache.select``, paged attention and ``gather_pages``, the layer
groups' tables, the prefix tiers' calls, the newer CLI options); and of
:mod:`hostile_connector` (``connector``: the vLLM connector's worker and scheduler sides
and the shared-memory directory where neighbours can plant files) (``all``: every one).
A case that gives no verdict within ``--case-timeout`` seconds is a hang (its child is
killed and a new one resumes after it). The last line is a JSON summary: inputs,
verdict counts (``typed``, ``accepted``, ``untyped``, ``crash``, ``hang``,
``wrong-kv``, ...), failures, ``counts`` (inputs, typed with the state unchanged,
accepted and checked, crashes, hangs, wrong KV, untyped, other failures) and the counts
by surface.

Usage: ``python fuzz/hostile_inputs.py [--json] [--kv-dtype NAME] [--kv-key-quant MODE]
[--surfaces api,tier,transfer,config,cli,serving,connector|all] [--smoke] [--case-timeout S]``;
exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

#: what ``--surfaces`` may name: the cache's calls here; tier, transfer, config and cli
#: in hostile_surfaces.py; serving (select, attention, gather_pages, the group tables)
#: in hostile_serving.py; connector (the vLLM connector's two sides) in hostile_connector.py
SURFACES = ("api", "tier", "transfer", "config", "cli", "serving", "connector")
_OWN_MODULE = {"serving": "hostile_serving", "connector": "hostile_connector"}

#: the cache's kv_dtype (None: float32) and head_dim, set by ``--kv-dtype``
KV_DTYPE = None
KV_KEY_QUANT = None
D = 4


def set_kv_dtype(name, key_quant=None) -> None:
    global KV_DTYPE, KV_KEY_QUANT, D
    KV_DTYPE, KV_KEY_QUANT = name, key_quant
    D = 8 if name in ("int3", "int4") else 4


# ---- bad values, by the kind of argument they attack ------------------------------------
INT_BAD: List[Tuple[str, Any]] = [
    ("-1", -1), ("2**31", 2**31), ("2**62", 2**62), ("2**63", 2**63), ("2**64", 2**64), ("-2**63-1", -2**63 - 1),
    ("1.5", 1.5), ("2.0", 2.0), ("nan", float("nan")), ("inf", float("inf")), ("True", True), ("None", None),
    ("'8'", "8"), ("b'8'", b"8"), ("np.int8(-1)", np.int8(-1)), ("np.uint64(2**64-1)", np.uint64(2**64 - 1)),
    ("np.float64(3)", np.float64(3.0)), ("[1]", [1]), ("object()", object()), ("complex", 1 + 2j),
]
COUNTS_BAD: List[Tuple[str, Any]] = INT_BAD + [
    ("[2**62]*2", [2**62, 2**62]), ("[-1, 1]", [-1, 1]), ("[1.5, 1]", [1.5, 1]), ("[[1]]", [[1]]),
    ("np >i8 [2**40]*2", np.array([2**40] * 2, ">i8")), ("np float [1,1]", np.array([1.0, 1.0])),
    ("np bool", np.array([True, True])), ("np uint64 max", np.array([2**64 - 1] * 2, np.uint64)),
    ("np object", np.array([1, "x"], dtype=object)), ("np 2-D", np.ones((2, 1), np.int64)),
    ("wrong length [1]*3", [1, 1, 1]), ("str '11'", "11"),
]
IDS_BAD: List[Tuple[str, Any]] = [
    ("unknown 99", 99), ("[0, 0]", [0, 0]), ("[0, 99]", [0, 99]), ("-1", -1), ("2**64", 2**64),
    ("nan", float("nan")), ("None", None), ("[None]", [None]), ("np >i8 [0, 99]", np.array([0, 99], ">i8")),
    ("np float [0.0]", np.array([0.0])), ("np 2-D", np.zeros((1, 1), np.int64)), ("[[0]]", [[0]]),
    ("set", {0}), ("dict", {0: 1}), ("swapped 5 twice", [5, 5]), ("live and swapped twice", [0, 5, 5]),
]
TOKENS_BAD: List[Tuple[str, Any]] = [
    ("[2**31]", [2**31]), ("[-2**31-1]", [-2**31 - 1]), ("[1.5]", [1.5]), ("'abc'", "abc"), ("None-in", [1, None]),
    ("np float", np.array([1.0])), ("np >i4", np.array([1, 2], ">i4")), ("np 2-D", np.ones((1, 2), np.int32)),
    ("np object", np.array(["a"], dtype=object)), ("[[1]]", [[1]]), ("object()", object()),
]


def _torch_bad():
    import torch
    k = torch.randn(2, 2, D)
    return [
        ("fp16 for fp32", k.half()), ("complex", k.to(torch.complex64)), ("int", k.int()), ("2-D", k[0]),
        ("wrong heads", torch.randn(2, 3, D)), ("wrong dim", torch.randn(2, 2, D + 1)), ("sparse", k.to_sparse()),
        ("meta", k.to("meta")), ("numpy", k.numpy()), ("list", k.tolist()), ("rows 3", torch.randn(3, 2, D)),
    ]


def _slots_bad():
    import torch
    return [
        ("slot past arena", torch.tensor([0, 10**6])), ("int32 slots", torch.tensor([0, 1], dtype=torch.int32)),
        ("float slots", torch.tensor([0.0, 1.0])), ("2-D slots", torch.tensor([[0, 1]])), ("3 slots", torch.tensor([0, 1, 2])),
        ("sparse slots", torch.tensor([0, 1]).to_sparse()), ("meta slots", torch.tensor([0, 1]).to("meta")),
        ("np >i8 slots", np.array([0, 1], ">i8")), ("list slots", [0, 1]), ("2**63 slot", torch.tensor([0, 2**63 - 1])),
    ]


def _pairs_bad():
    import torch
    return [
        ("block -1", torch.tensor([[-1, 1]])), ("block past", torch.tensor([[0, 10**6]])), ("float", torch.tensor([[0.0, 1.0]])),
        ("shape [3]", torch.tensor([0, 1, 2])), ("dst in use twice", torch.tensor([[0, 9], [1, 9]])),
        ("sparse", torch.tensor([[0, 1]]).to_sparse()), ("meta", torch.tensor([[0, 1]]).to("meta")),
        ("numpy", np.array([[0, 1]])), ("int8", torch.tensor([[0, 1]], dtype=torch.int8)),
    ]


# ---- the fixture and what a caller can observe -------------------------------------------
def fixture():
    import torch
    from pagedkv import CacheConfig, PagedKVCache
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, block_size=4, num_blocks=24, host_num_blocks=8,
                      dtype=torch.float32, kv_dtype=KV_DTYPE, kv_key_quant=KV_KEY_QUANT)
    cache = PagedKVCache(cfg)
    g = torch.Generator().manual_seed(0)
    prompt = list(range(100, 110))
    for sid in (0, 5):
        cache.add_sequence(sid, prompt if sid == 0 else [7, 8, 9, 10, 11])
        n = cache.num_tokens(sid)
        todo = len(prompt if sid == 0 else [7] * 5) - n
        slots = cache.reserve(sid, todo)
        for layer in range(2):
            cache.write(layer, slots, torch.randn(todo, 2, D, generator=g), torch.randn(todo, 2, D, generator=g))
        cache.commit(sid, todo)
    cache.fork(0, 1)
    cache.add_sequence("req-a", prompt)            # a prefix hit on sequence 0's blocks
    cache.reserve("req-a", 2)
    cache.swap_out(5)
    return cache


def observe(cache) -> Tuple:
    import torch
    seqs = []
    for s in sorted(cache.sequences(), key=repr):
        seqs.append((repr(s), cache.num_tokens(s), cache.num_reserved(s), tuple(cache.block_table(s).tolist()),
                     tuple(cache.token_ids(s).tolist())))
    pool = cache.pool
    kv = hashlib.sha256()
    for t in cache.store.arenas:   # data, and the scale/zero arenas of a quantized cache
        kv.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    window = cache.store.window
    if window is not None:
        kv.update(window.data.contiguous().view(torch.uint8).numpy().tobytes())
        kv.update(window.valid.numpy().tobytes())
    kv = kv.hexdigest()
    return (tuple(seqs), tuple(map(tuple, pool.free_lists())), tuple(pool.ref_cnt.tolist()), tuple(pool.states().tolist()),
            tuple(pool.pinned_blocks().tolist()), cache.is_swapped(5), kv)


# ---- the cases --------------------------------------------------------------------------
def cases() -> List[Tuple[str, Callable[[Any], Any]]]:
    import torch
    out: List[Tuple[str, Callable[[Any], Any]]] = []

    def add(name, fn):
        out.append((name, fn))

    k2 = torch.randn(2, 2, D)
    for label, v in COUNTS_BAD:
        add(f"reserve([0, 1], {label})", lambda c, v=v: c.reserve([0, 1], v))
        add(f"commit([0, 1], {label})", lambda c, v=v: c.commit([0, 1], v))
        add(f"unreserve(['req-a'], {label})", lambda c, v=v: c.unreserve(["req-a"], v))
    for label, v in INT_BAD:
        add(f"reserve(0, {label})", lambda c, v=v: c.reserve(0, v))
        add(f"set_priority(0, {label})", lambda c, v=v: c.set_priority(0, v))
        add(f"set_priority(0, 1, {label})", lambda c, v=v: c.set_priority(0, 1, v))
        add(f"set_priority(0, 1, 0, {label})", lambda c, v=v: c.set_priority(0, 1, 0, v))
        add(f"slot_mapping(0, {label}, 1)", lambda c, v=v: c.slot_mapping(0, v, 1))
        add(f"slot_mapping(0, 0, {label})", lambda c, v=v: c.slot_mapping(0, 0, v))
        add(f"gather(0, {label})", lambda c, v=v: c.gather(0, v))
        add(f"gather(0, 0, {label})", lambda c, v=v: c.gather(0, 0, v))
        add(f"block_tables([0], pad={label})", lambda c, v=v: c.block_tables([0], pad=v))
        add(f"block_tables([0], width={label})", lambda c, v=v: c.block_tables([0], width=v))
        add(f"write({label}, slots, k, v)", lambda c, v=v: c.write(v, torch.tensor([-1, -1]), k2, k2))
        add(f"can_admit([1]*8, {label})", lambda c, v=v: c.can_admit([1] * 8, v))
        add(f"add_sequence(9, priority={label})", lambda c, v=v: c.add_sequence(9, [1, 2], priority=v))
        add(f"pool.allocate({label})", lambda c, v=v: c.pool.allocate(v))
    for label, v in IDS_BAD:
        add(f"reserve({label}, 1)", lambda c, v=v: c.reserve(v, 1))
        add(f"commit({label}, 0)", lambda c, v=v: c.commit(v, 0))
        add(f"advance({label}, tokens)", lambda c, v=v: c.advance(v, [1] * (len(v) if isinstance(v, list) else 1)))
        add(f"free({label})", lambda c, v=v: c.free(v))
        add(f"block_tables({label})", lambda c, v=v: c.block_tables(v))
        add(f"page_table_csr({label})", lambda c, v=v: c.page_table_csr(v))
        add(f"seq_lens({label})", lambda c, v=v: c.seq_lens(v))
        add(f"fork({label}, 9)", lambda c, v=v: c.fork(v, 9))
        add(f"swap_in({label})", lambda c, v=v: c.swap_in(v))
        add(f"pool.free({label} as blocks)", lambda c, v=v: c.pool.free(v))
        add(f"pool.unpin({label} as blocks)", lambda c, v=v: c.pool.unpin(v))
    add("fork(0, 1) onto a live id", lambda c: c.fork(0, 1))
    add("add_sequence(0) again", lambda c: c.add_sequence(0))
    add("add_sequence(5) while swapped", lambda c: c.add_sequence(5))
    add("add_sequence(('req', 1)) tuple id then batch use", lambda c: c.add_sequence(("a", "b", "c"), [1]))
    add("swap_out(5) twice", lambda c: c.swap_out(5))
    add("pool.free(allocated block twice)", lambda c: c.pool.free([c.block_table(0)[0]] * 40))
    add("pool.unpin([-1])", lambda c: c.pool.unpin([-1]))
    for label, v in TOKENS_BAD:
        add(f"add_sequence(9, {label})", lambda c, v=v: c.add_sequence(9, v))
        add(f"advance([0], {label})", lambda c, v=v: c.advance([0], v))
        add(f"commit(['req-a'], 2, {label})", lambda c, v=v: c.commit(["req-a"], 2, v))
        add(f"match_prefix({label})", lambda c, v=v: c.match_prefix(v))
        add(f"pin_prefix({label})", lambda c, v=v: c.pin_prefix(v))
    for label, v in [("int", 5), ("list", ["x"]), ("object", object())]:
        add(f"add_sequence(9, cache_salt={label})", lambda c, v=v: c.add_sequence(9, [1], cache_salt=v))
        add(f"match_prefix(cache_salt={label})", lambda c, v=v: c.match_prefix([1], cache_salt=v))
    for label, v in _torch_bad():
        add(f"write(0, slots, key={label})", lambda c, v=v: c.write(0, torch.tensor([-1, -1]), v, k2))
        add(f"write(0, slots, value={label})", lambda c, v=v: c.write(0, torch.tensor([-1, -1]), k2, v))
    for label, v in _slots_bad():
        add(f"write(0, {label}, k, v)", lambda c, v=v: c.write(0, v, k2, k2))
    for label, v in _pairs_bad():
        add(f"copy_blocks({label})", lambda c, v=v: c.copy_blocks(v))
    return out


# Calls where a value in the catalog is valid in context (a count of 1 as 1.0 is not:
# floats are refused; but e.g. unreserving 0 tokens via False would be a bool and is refused).
def verdict(cache, fn) -> str:
    from pagedkv.errors import PagedKVError
    before = observe(cache)
    try:
        fn(cache)
    except PagedKVError:
        return "typed" if observe(cache) == before else "state-changed"
    except Exception as e:   # noqa: BLE001 - classifying is the point
        return f"untyped:{type(e).__name__}" + ("" if observe(cache) == before else "+state-changed")
    return "accepted"


def all_cases(surfaces, smoke: bool) -> List[Tuple[str, str, Callable[[], str]]]:
    """(surface, name, run) for every case; ``run()`` returns the case's verdict."""
    out: List[Tuple[str, str, Callable[[], str]]] = []
    if "api" in surfaces:
        for name, fn in cases():
            out.append(("api", name, lambda fn=fn: api_verdict(fn)))
    others = [s for s in surfaces if s != "api"]
    if others:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from hostile_surfaces import surface_cases
        out.extend(surface_cases([s for s in others if s not in _OWN_MODULE], smoke))
        for s in others:
            if s in _OWN_MODULE:
                out.extend(__import__(_OWN_MODULE[s]).surface_cases(smoke))
    return out


def api_verdict(fn) -> str:
    cache = fixture()
    v = verdict(cache, fn)
    try:
        cache.check_invariants()
    except Exception as e:   # noqa: BLE001 - a broken invariant is this case's verdict
        v = f"invariant-broken:{type(e).__name__}: {e}"
    return v


def child(start: int, surfaces, smoke: bool) -> None:
    todo = all_cases(surfaces, smoke)
    if any(s != "api" for s in surfaces):
        from hostile_surfaces import prepare
        prepare(surfaces)
        for s in surfaces:
            if s in _OWN_MODULE:
                __import__(_OWN_MODULE[s]).prepare()
    print(json.dumps({"ready": len(todo)}), flush=True)
    for i in range(start, len(todo)):
        surface, name, fn = todo[i]
        print(json.dumps({"start": i}), flush=True)
        try:
            v = fn()
        except BaseException as e:   # noqa: BLE001 - the harness itself must not die on a case
            v = f"untyped:{type(e).__name__} (in the case's own setup): {str(e)[:80]}"
        print(json.dumps({"case": i, "surface": surface, "name": name, "verdict": v}), flush=True)


class _LineReader:
    """The child's stdout, line by line, each wait bounded (select on the raw fd: a
    buffered reader would hide lines already read from select)."""

    def __init__(self, p):
        self.fd, self.buf = p.stdout.fileno(), b""

    def next(self, timeout: float):
        """The next line, or None at end of output; raises TimeoutError."""
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def run(surfaces=("api",), smoke: bool = False, case_timeout: float = 10.0) -> Dict[str, Any]:
    todo = all_cases(surfaces, smoke)
    names = [(s, n) for s, n, _ in todo]
    n = len(todo)
    results: List[Dict[str, Any]] = []
    start = 0
    scratch = tempfile.mkdtemp(prefix="pagedkv-hostile-")
    env = dict(os.environ, PAGEDKV_HOSTILE_TMP=scratch)
    extra = (["--kv-dtype", KV_DTYPE] if KV_DTYPE else []) + (["--kv-key-quant", KV_KEY_QUANT] if KV_KEY_QUANT else [])
    extra += ["--surfaces", ",".join(surfaces)] + (["--smoke"] if smoke else [])
    try:
        while start < n:
            errfile = tempfile.TemporaryFile(dir=scratch)
            p = subprocess.Popen([sys.executable, __file__, "--child", str(start)] + extra, stdout=subprocess.PIPE,
                                 stderr=errfile, env=env)
            reader = _LineReader(p)
            current, timeout, hung = start, 120.0, False      # a first, longer wait: the child imports torch
            try:
                while True:
                    line = reader.next(timeout)
                    if line is None:
                        break
                    rec = json.loads(line)
                    if "start" in rec:
                        # a demo run imports transformers and builds a model: a slower case
                        slow = rec["start"] < len(names) and " demo " in names[rec["start"]][1]
                        current, timeout = rec["start"], case_timeout * (6 if slow else 1)
                    elif "case" in rec:
                        results.append(rec)
                        current = rec["case"] + 1
            except TimeoutError:
                hung = True
                p.kill()
            p.communicate()
            errfile.seek(0)
            err = errfile.read().decode(errors="replace")
            errfile.close()
            if hung or p.returncode != 0:
                if current >= n:
                    break
                surface, name = names[current]
                why = (f"hang (no verdict in {case_timeout:g} s)" if hung
                       else f"crash (exit {p.returncode}): {err.strip().splitlines()[-1:]}")
                results.append({"case": current, "surface": surface, "name": name, "verdict": why})
                current += 1
            start = current
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts = Counter(verdict_class(r["verdict"]) for r in results)
    by_surface: Dict[str, Counter] = {}
    for r in results:
        by_surface.setdefault(r.get("surface", "api"), Counter())[verdict_class(r["verdict"])] += 1
    return {"inputs": len(results), "counts": dict(counts), "by_surface": {k: dict(v) for k, v in by_surface.items()},
            "results": results}


def counts(rep: Dict[str, Any]) -> Dict[str, int]:
    """The figures a report gives (issue 32): inputs; typed errors with the state
    unchanged; valid inputs accepted with their result checked (for the API catalog the
    inputs listed in ACCEPTABLE, each checked by hand); crashes; hangs; wrong KV served;
    untyped errors; and every other failure (state changed by a failing call, a bad
    input accepted, an escape from the tier directory, a broken invariant, a leak)."""
    out = dict(inputs=0, typed_state_unchanged=0, accepted_and_checked=0, crashes=0, hangs=0, wrong_kv=0,
               untyped=0, other_failures=0)
    names = {"typed": "typed_state_unchanged", "crash": "crashes", "hang": "hangs", "wrong-kv": "wrong_kv",
             "untyped": "untyped"}
    for r in rep["results"]:
        out["inputs"] += 1
        c = verdict_class(r["verdict"])
        if c == "accepted":
            out["accepted_and_checked" if not failed(r) else "other_failures"] += 1
        else:
            out[names.get(c, "other_failures")] += 1
    return out


def verdict_class(v: str) -> str:
    return v.split(":")[0].split(" ")[0]


def failed(r: Dict[str, Any]) -> bool:
    """Anything but a typed error, or an acceptance that is right: for the API catalog an
    input listed in ACCEPTABLE; for the other surfaces a case that checked what it served."""
    v = r["verdict"]
    if v == "typed":
        return False
    if v == "accepted":
        return r.get("surface", "api") == "api" and r["name"] not in ACCEPTABLE
    return True


# Inputs that are valid in the position they are tried in, so accepting them is right
# (each was checked by hand; the reason is given so the list stays honest):
ACCEPTABLE = {
    # -1 is the documented default padding value; np.int8(-1) is the same integer
    "block_tables([0], pad=-1)", "block_tables([0], pad=np.int8(-1))",
    # can_admit answers a question: a huge request is simply "no"; None is the default
    "can_admit([1]*8, 2**31)", "can_admit([1]*8, 2**62)", "can_admit([1]*8, 2**63)", "can_admit([1]*8, 2**64)",
    "can_admit([1]*8, None)",
    # None is each argument's documented default
    "gather(0, 0, None)", "block_tables([0], width=None)", "add_sequence(9, priority=None)",
    "set_priority(0, 1, 0, None)", "unreserve(['req-a'], None)",
    # one count per id: a one-element list for one id (req-a holds 2 reserved slots)
    "unreserve(['req-a'], [1])", "reserve(0, [1])",
    # any hashable is a sequence id, tuples included
    "add_sequence(('req', 1)) tuple id then batch use",
    # non-native byte order is converted, not misread (tests pin the converted values)
    "add_sequence(9, np >i4)", "match_prefix(np >i4)", "pin_prefix(np >i4)",
    # array-likes of block pairs are accepted like tensors
    "copy_blocks(numpy)",
    # K/V as nested lists are converted by torch like any array-like
    "write(0, slots, key=list)", "write(0, slots, value=list)",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print every case's verdict")
    ap.add_argument("--kv-dtype", default=None, help="quantize the cache (int8, fp8_e4m3, int4, int3...)")
    ap.add_argument("--kv-key-quant", default=None, help="int4 keys: token (default) or block")
    ap.add_argument("--surfaces", default="api",
                    help=f"comma-separated, of {','.join(SURFACES)} or 'all' (default: api, the cache's calls)")
    ap.add_argument("--smoke", action="store_true", help="a few cases of each surface (the API catalog is whole)")
    ap.add_argument("--case-timeout", type=float, default=10.0, help="seconds before a case is a hang")
    args = ap.parse_args(argv)
    surfaces = list(SURFACES) if args.surfaces == "all" else [x for x in args.surfaces.split(",") if x]
    unknown = [x for x in surfaces if x not in SURFACES]
    if unknown or not surfaces:
        ap.error(f"--surfaces: expected names from {','.join(SURFACES)} or 'all', got {args.surfaces!r}")
    set_kv_dtype(args.kv_dtype, args.kv_key_quant)
    if args.child is not None:
        if os.environ.get("PAGEDKV_HOSTILE_TMP"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import hostile_surfaces
            hostile_surfaces.TMP = tempfile.mkdtemp(dir=os.environ["PAGEDKV_HOSTILE_TMP"])
        child(args.child, surfaces, args.smoke)
        return 0
    rep = run(surfaces, args.smoke, args.case_timeout)
    bad = [r for r in rep["results"] if failed(r)]
    if args.json:
        for r in rep["results"]:
            print(json.dumps(r))
    for r in bad:
        print(f"FAIL {r['verdict'][:60]:60s} {r['name']}")
    summary = {"inputs": rep["inputs"], "verdicts": rep["counts"], "failures": len(bad), "counts": counts(rep)}
    if surfaces != ["api"]:
        summary["by_surface"] = rep["by_surface"]
    print(json.dumps(summary))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
