"""Hostile input against the serving entry points added since 0.1 (issue 32):
``PagedCache.select`` (an engine's continuous batching), ``PagedKVCache.attention`` and
``gather_pages`` (paged reads over caller-built tables, with ``pending``), the layer
groups' tables (``page_table_csr``/``released_tokens``/``block_table``/``slot_mapping``
with ``group=``, ``gather_window``, ``match_prefix_groups``), the window and rollback
calls (``hold_window``, ``slide_window``, ``truncate``, ``relocate``, ``compact``) and
the newer CLI options (``plan`` and ``demo``).

The cache is int4 with sliding-window layer groups, a recent window and sinks, so every
read overlays window rows; each case checks that the cache (sequences, tables, pool,
K/V bytes, window arena) is unchanged after a refusal. A valid input that looks odd
(a NaN in ``q``, NumPy tables) is ``accepted`` only when its result equals the float64
definition's (``backend="reference"``) or the same call with plain tensors.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from hostile_surfaces import PROMPT, cli_case, dir_state, fill, fresh_dir, judge, kv_right, tier_config

L, H, D, BS = 4, 2, 8, 4

_CACHES: dict = {}


def cache():
    """The child's cache: two sequences written (13 and 6 tokens), both committed."""
    if "kv" not in _CACHES:
        import torch

        from pagedkv import CacheConfig, PagedKVCache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kv = PagedKVCache(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=48,
                                          dtype="float32", kv_dtype="int4", kv_window=4, kv_sink_tokens=4,
                                          layer_windows=(8, 0, 8, 0)))
        g = torch.Generator().manual_seed(3)
        for sid, n in ((0, 13), (1, 6)):
            kv.add_sequence(sid, list(range(100 * sid, 100 * sid + n)))
            slots = kv.reserve(sid, n)
            for layer in range(L):
                kv.write(layer, slots, torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
            kv.commit(sid, n)
        _CACHES["kv"] = kv
    return _CACHES["kv"]


def observe(kv) -> tuple:
    import hashlib

    import torch
    seqs = []
    for s in sorted(kv.sequences(), key=repr):
        tables = tuple(tuple(kv.block_table(s, group=g).tolist()) for g in range(2))
        seqs.append((repr(s), kv.num_tokens(s), kv.num_reserved(s), tables, tuple(kv.token_ids(s).tolist())))
    h = hashlib.sha256()
    for t in kv.store.arenas:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    w = kv.store.window
    h.update(w.data.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(w.valid.numpy().tobytes())
    pool = kv.pool
    return (tuple(seqs), tuple(pool.ref_cnt.tolist()), tuple(pool.states().tolist()), h.hexdigest())


def tables(seq: int = 0, group: int = 0):
    import torch
    kv = cache()
    ptr, idx, _ = kv.page_table_csr([seq], group=group)
    lens = kv.seq_lens([seq]).astype(np.int32) - kv.released_tokens([seq], group=group).astype(np.int32)
    return torch.from_numpy(ptr), torch.from_numpy(idx), torch.from_numpy(lens), torch.tensor([0, 1], dtype=torch.int32)


def q_ok():
    import torch
    return torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(9))


def serve(call: Callable[[Any], Any], accept=None) -> str:
    kv = cache()
    return judge(lambda: call(kv), state=lambda: observe(kv), accept=accept)


def same_as_reference(kw_layer=1):
    """Accept a paged attention result equal (NaN where NaN) to the definition's."""
    def accept(out, layer=kw_layer):
        import torch
        ptr, idx, lens, qp = tables(0, cache().config.layer_groups.layer_group[layer])
        ref = cache().attention(layer, _ACCEPT_Q["q"], ptr, idx, lens, qp, backend="reference")
        same = torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.allclose(
            torch.nan_to_num(out), torch.nan_to_num(ref), rtol=1e-4, atol=1e-4)
        return "accepted" if same else "wrong-kv"
    return accept


_ACCEPT_Q: dict = {}


def attention_cases(smoke: bool):
    import torch
    cases = []

    def add(label, call, accept=None):
        cases.append(("serving", f"serving: attention {label}", lambda c=call, a=accept: serve(c, a)))

    qs = [("q float16", q_ok().half()), ("q float64", q_ok().double()), ("q int", q_ok().int()),
          ("q 2-D", q_ok()[0]), ("q head_dim 9", torch.randn(1, 4, 9)), ("q 3 heads", torch.randn(1, 3, D)),
          ("q meta", q_ok().to("meta")), ("q sparse", q_ok().to_sparse()), ("q a list", q_ok().tolist()),
          ("q numpy", q_ok().numpy()), ("q 2 tokens for 1", torch.randn(2, 4, D)), ("q None", None)]
    for label, q in qs[:4] if smoke else qs:
        add(label, lambda kv, q=q: kv.attention(1, q, *tables(0, 0)))
    for label, bad in [("q with NaN", math.nan), ("q with inf", math.inf), ("q with -inf", -math.inf)]:
        def call(kv, bad=bad):
            q = q_ok()
            q[0, 1, 3] = bad
            _ACCEPT_Q["q"] = q
            return kv.attention(1, q, *tables(0, 0))
        add(label, call, same_as_reference(1))
    tbl = [("indptr [0, 99]", 0, torch.tensor([0, 99], dtype=torch.int32)),
           ("indptr float", 0, torch.tensor([0.0, 4.0])), ("indptr 2-D", 0, torch.tensor([[0, 4]], dtype=torch.int32)),
           ("indptr -1", 0, torch.tensor([-1, 4], dtype=torch.int32)),
           ("indptr int64 2**40", 0, torch.tensor([0, 2**40])),
           ("indices block 10**6", 1, torch.tensor([0, 1, 2, 10**6], dtype=torch.int32)),
           ("indices -1", 1, torch.tensor([-1, 1, 2, 3], dtype=torch.int32)),
           ("indices float", 1, torch.tensor([0.0, 1.0, 2.0, 3.0])),
           ("seq_lens past its blocks", 2, torch.tensor([10**6], dtype=torch.int32)),
           ("seq_lens -1", 2, torch.tensor([-1], dtype=torch.int32)), ("seq_lens 2 for 1 row", 2, torch.tensor([4, 4])),
           ("q_indptr [0, 5]", 3, torch.tensor([0, 5], dtype=torch.int32)),
           ("q_indptr decreasing", 3, torch.tensor([1, 0], dtype=torch.int32)), ("q_indptr None", 3, None)]
    for label, pos, v in tbl[:5] if smoke else tbl:
        def call(kv, pos=pos, v=v):
            t = list(tables(0, 0))
            t[pos] = v
            return kv.attention(1, q_ok(), *t)
        add(label, call)
    opts = [("sm_scale nan", dict(sm_scale=math.nan)), ("sm_scale '1'", dict(sm_scale="1")),
            ("sm_scale True", dict(sm_scale=True)), ("soft_cap 0", dict(soft_cap=0.0)), ("soft_cap -1", dict(soft_cap=-1.0)),
            ("soft_cap inf", dict(soft_cap=math.inf)), ("window 0", dict(window=0)), ("window -1", dict(window=-1)),
            ("window 1.5", dict(window=1.5)), ("window 2**63", dict(window=2**63)), ("sink_tokens -1", dict(sink_tokens=-1)),
            ("num_splits 0", dict(num_splits=0)),
            ("num_splits 1.5", dict(num_splits=1.5)), ("out float16", dict(out=torch.empty(1, 4, D).half())),
            ("out wrong shape", dict(out=torch.empty(2, 4, D))), ("out non-contiguous", dict(out=torch.empty(1, D, 4).mT)),
            ("backend 'x'", dict(backend="x")), ("backend None", dict(backend=None)), ("backend 'cuda'", dict(backend="cuda")),
            ("layout 'HND'", dict(layout="HND")), ("kv_scale", dict(kv_scale=torch.ones(1))), ("exact_rows", dict(exact_rows=1)),
            ("an unknown keyword", dict(foo=1))]
    for label, kw in opts[:6] if smoke else opts:
        add(label, lambda kv, kw=kw: kv.attention(1, q_ok(), *tables(0, 0), **kw))
    for label, layer in [("layer -1", -1), ("layer 4", 4), ("layer 1.0", 1.0), ("layer True", True), ("layer '1'", "1")]:
        add(label, lambda kv, layer=layer: kv.attention(layer, q_ok(), *tables(0, 0)))
    # valid, if unusual: each result is checked against the definition's
    for label, kw, table in [("num_splits 3 (control)", dict(num_splits=3), None),
                             ("num_splits 2**40 (more splits than keys)", dict(num_splits=2**40), None),
                             ("window 8 (control)", dict(window=8), None),
                             ("indptr np >i4 (converted)", {}, (0, np.array([0, 4], ">i4")))]:
        def call(kv, kw=kw, table=table):
            _ACCEPT_Q["q"] = q_ok()
            t = list(tables(0, 0))
            if table is not None:
                t[table[0]] = table[1]
            return kv.attention(1, _ACCEPT_Q["q"], *t, **kw)

        def accept(out, kw=kw):
            import torch
            ref = cache().attention(1, _ACCEPT_Q["q"], *tables(0, 0), backend="reference",
                                    **{k: v for k, v in kw.items() if k != "num_splits"})
            return "accepted" if torch.allclose(out, ref, rtol=1e-4, atol=1e-4) else "wrong-kv"
        add(label, call, accept)
    return cases


def gather_cases(smoke: bool):
    import torch
    cases = []

    def add(label, call, accept=None):
        cases.append(("serving", f"serving: gather_pages {label}", lambda c=call, a=accept: serve(c, a)))

    pend = [("pending -1", [-1]), ("pending past seq_lens", [10**6]), ("pending 1.5", [1.5]), ("pending 2-D", [[1]]),
            ("pending 2 for 1 row", [1, 1]), ("pending 'x'", "x"), ("pending float tensor", torch.tensor([1.0])),
            ("pending None in a list", [None])]
    for label, p in pend[:3] if smoke else pend:
        add(label, lambda kv, p=p: kv.gather_pages(1, *tables(0, 0)[:3], pending=p))
    for label, r in [("rotated 1", 1), ("rotated 'yes'", "yes"), ("rotated None", None)]:
        add(label, lambda kv, r=r: kv.gather_pages(1, *tables(0, 0)[:3], rotated=r))
    for label, pos, v in [("indptr [0, 99]", 0, np.array([0, 99], np.int32)), ("indices 10**6", 1, np.array([10**6])),
                          ("indices int64 past int32", 1, np.array([2**40, 1, 2, 3])),
                          ("seq_lens 10**6", 2, np.array([10**6], np.int32))]:
        def call(kv, pos=pos, v=v):
            t = list(tables(0, 0)[:3])
            t[pos] = v
            return kv.gather_pages(1, *t)
        add(label, call)

    def numpy_tables(kv):
        return kv.gather_pages(1, *(t.numpy() for t in tables(0, 0)[:3]), pending=np.array([2]))

    def same(out):
        import torch
        want = cache().gather_pages(1, *tables(0, 0)[:3], pending=np.array([2]))
        return "accepted" if all(torch.equal(a, b) for a, b in zip(out, want)) else "wrong-kv"
    add("numpy tables (control)", numpy_tables, same)
    return cases


def select_cases(smoke: bool):
    bad = [("True", [0, 1], True), ("[True, 1]", [0, 1], [True, 1]), ("[1.5, 1]", [0, 1], [1.5, 1]),
           ("'ab' as ids", "ab", 1), ("['x', 1]", [0, 1], ["x", 1]), ("None", [0, 1], None),
           ("[1, nan]", [0, 1], [1, math.nan]), ("2.0", [0, 1], 2.0), ("[2**70, 1]", [0, 1], [2**70, 1]),
           ("10**9", [0, 1], 10**9), ("2**63", [0, 1], 2**63), ("np float", [0, 1], np.array([1.0, 1.0])),
           ("np 2-D", [0, 1], np.ones((1, 2), np.int64)), ("'11'", [0, 1], "11"), ("ids None", None, 1),
           ("[0, 0]", [0, 0], 1), ("unknown id", [0, 9], 1), ("[1, 0]", [0, 1], [1, 0]), ("no ids", [], 1),
           ("3 counts for 2", [0, 1], [1, 1, 1]), ("np uint64 max", [0, 1], np.array([2**64 - 1] * 2, np.uint64)),
           ("a dict of ids", {0: 1}, 1), ("an object", [0, 1], object())]
    cases = []
    for label, ids, n in bad[:6] if smoke else bad:
        cases.append(("serving", f"serving: select({label})", lambda ids=ids, n=n: select_case(ids, n)))
    cases.append(("serving", "serving: select np.int64 counts (control)",
                  lambda: select_case([0, 1], np.array([1, 2], np.int64), control=True)))
    return cases


def select_case(ids, n, control: bool = False) -> str:
    from pagedkv import CacheConfig, PagedKVCache
    from pagedkv.integrations.transformers import PagedCache
    if "select" not in _CACHES:
        kv = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                                      dtype="float32"))
        for s in (0, 1):
            kv.add_sequence(s, [1, 2, 3])
            kv.reserve(s, 3)
            kv.commit(s, 3)
        _CACHES["select"] = (kv, PagedCache(kv))
    kv, pc = _CACHES["select"]

    def state():
        return (list(pc.seq_ids), pc._pads.tolist(), pc._columns, kv.seq_lens([0, 1]).tolist(), len(kv))

    def accept(r):
        mask, pos = r
        ok = tuple(mask.shape) == (2, 5) and pos[:, -1].tolist() == [3, 4]
        return "accepted" if control and ok else ("wrong-kv" if control else "accepted-bad")
    try:
        return judge(lambda: pc.select(ids, n), state=state, accept=accept)
    finally:
        pc.release()


def table_cases(smoke: bool):
    cases = []

    def add(label, call, accept=None):
        cases.append(("serving", f"serving: {label}", lambda c=call, a=accept: serve(c, a)))

    groups = [("2", 2), ("-1", -1), ("1.0", 1.0), ("True", True), ("'0'", "0"), ("2**63", 2**63)]
    for label, g in groups[:3] if smoke else groups:
        add(f"page_table_csr([0], group={label})", lambda kv, g=g: kv.page_table_csr([0], group=g))
        add(f"released_tokens([0], group={label})", lambda kv, g=g: kv.released_tokens([0], group=g))
        add(f"block_table(0, group={label})", lambda kv, g=g: kv.block_table(0, group=g))
        add(f"slot_mapping(0, 0, 1, group={label})", lambda kv, g=g: kv.slot_mapping(0, 0, 1, group=g))
    if smoke:
        return cases
    for label, v in [("-1", -1), ("2**63", 2**63), ("1.5", 1.5), ("None (control)", None)]:
        add(f"gather_window([0], 1, {label})", lambda kv, v=v: kv.gather_window([0], 1, v),
            (lambda out: "accepted") if v is None else None)
    for label, v in [("'x'", "x"), ("1", 1), ("None", None)]:
        add(f"hold_window([0], {label})", lambda kv, v=v: kv.hold_window([0], v))
    for label, ids in [("unknown", [9]), ("None", None), ("[0, 0]", [0, 0])]:
        add(f"slide_window({label})", lambda kv, ids=ids: kv.slide_window(ids))
    for label, ids in [("unknown", [9]), ("'x'", "x"), ("[0, 0] (a set of movable sequences)", [0, 0]),
                       ("None (every sequence)", None)]:
        cases.append(("serving", f"serving: compact({label})", lambda ids=ids: compact_case(ids)))
    for label, n in [("-1", -1), ("past its length", 10**6), ("1.5", 1.5), ("'1'", "1"), ("[2**63]", [2**63])]:
        add(f"truncate([0], {label})", lambda kv, n=n: kv.truncate([0], n))
    for label, moves in [("'x'", "x"), ("[(0, 10**6)]", [(0, 10**6)]), ("[(-1, 0)]", [(-1, 0)]), ("[[0.5, 1]]", [[0.5, 1]]),
                         ("3 columns", np.zeros((1, 3), np.int64)), ("None", None)]:
        add(f"relocate(0, {label})", lambda kv, m=moves: kv.relocate(0, m))
    for label, toks in [("'abc'", "abc"), ("[2**40]", [2**40]), ("floats", [1.5, 2.5]), ("None", None)]:
        add(f"match_prefix_groups({label})", lambda kv, t=toks: kv.match_prefix_groups(t))
    return cases


def compact_case(ids) -> str:
    """``compact`` moves blocks: refused typed with nothing moved, or accepted with every
    sequence reading what it read before (window rows included) and the invariants kept."""
    import torch
    kv = cache()
    before = {s: [kv.gather(s, layer) for layer in range(L)] for s in (0, 1)}

    def accept(_):
        kv.check_invariants()
        for s in (0, 1):
            for layer in range(L):
                k, v = kv.gather(s, layer)
                if not (torch.equal(k, before[s][layer][0]) and torch.equal(v, before[s][layer][1])):
                    return "wrong-kv"
        return "accepted"
    return judge(lambda: kv.compact(ids), state=lambda: observe(kv), accept=accept)


def cli_cases(smoke: bool):
    shape = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--budget", "1GiB"]
    plans = [("plan --kv-sink-tokens -1", ["--kv-dtype", "int4", "--kv-sink-tokens", "-1"]),
             ("plan --kv-sink-tokens 2**62", ["--kv-dtype", "int4", "--kv-sink-tokens", str(2**62)]),
             ("plan --attention-sinks -5", ["--attention-sinks", "-5"]),
             ("plan --kv-key-quant block with int8", ["--kv-dtype", "int8", "--kv-key-quant", "block"]),
             ("plan --dtype fp7", ["--dtype", "fp7"]), ("plan --layout XYZ", ["--layout", "XYZ"]),
             ("plan --head-dim 72 --kv-dtype int4 (control)", ["--kv-dtype", "int4", "--head-dim", "72"])]
    out = [("serving", f"cli: {label}", lambda a=argv: cli_case(["plan"] + shape + a))
           for label, argv in (plans[:2] + plans[-1:] if smoke else plans)]
    if not smoke:
        demo = ["demo", "--model", "tiny", "--requests", "2", "--max-new-tokens", "2", "--no-progress"]
        for label, extra in [("demo --kv-dtype int5", ["--kv-dtype", "int5"]), ("demo --max-batch 0", ["--max-batch", "0"]),
                             ("demo --kv-sink-tokens -3", ["--kv-dtype", "int4", "--kv-sink-tokens", "-3"]),
                             ("demo --block-size 0", ["--block-size", "0"])]:
            out.append(("serving", f"cli: {label}", lambda e=extra: cli_case(demo + e)))
    return out


def tiered():
    """A cache whose prefix tiers (host and disk, written through) hold PROMPT's blocks."""
    if "tiers" not in _CACHES:
        from pagedkv import PagedKVCache
        path = fresh_dir("serving-tiers")
        kv = PagedKVCache(tier_config(path, prefix_host_blocks=8))
        fill(kv, "w", PROMPT)
        kv.free("w")
        _CACHES["tiers"] = (kv, path)
    return _CACHES["tiers"]


def tier_case(call: Callable[[Any], Any], accept=None) -> str:
    kv, path = tiered()

    def state():
        return dir_state(path), tuple(kv.pool.ref_cnt.tolist()), tuple(kv.pool.states().tolist()), \
            tuple((t.used_blocks, t.pinned_blocks) for t in kv.stats().tiers)
    return judge(lambda: call(kv), state=state, accept=accept)


def _same_as_prompt(name: str):
    def accept(r):
        want = getattr(tiered()[0], name)(PROMPT) if name != "unpin_prefix" else 0
        return "accepted" if np.array_equal(np.asarray(r), np.asarray(want)) else "wrong-kv"
    return accept


def tier_cases(smoke: bool):
    """The prefix tiers through the calls that reach them: lookups, pins, events, stats."""
    cases = []

    def add(label, call, accept=None):
        cases.append(("serving", f"tiers: {label}", lambda c=call, a=accept: tier_case(c, a)))

    toks = [("'abc'", "abc"), ("[2**40]", [2**40]), ("floats", [1.5]), ("None", None), ("np 2-D", np.ones((2, 2), np.int32)),
            ("np >i4", np.array(PROMPT, ">i4"))]
    for label, t in toks[:3] if smoke else toks:
        for name in ("match_prefix", "pin_prefix", "unpin_prefix", "match_prefix_groups"):
            if label == "np >i4" and name == "pin_prefix":
                continue           # a pin changes the tiers' state
            # big-endian ids are converted, not misread: the same answer as for PROMPT
            add(f"{name}({label})", lambda kv, n=name, t=t: getattr(kv, n)(t),
                _same_as_prompt(name) if label == "np >i4" else None)
    if not smoke:
        for label, salt in [("an int", 5), ("a list", ["x"]), ("bytes", b"x")]:
            add(f"pin_prefix(cache_salt={label})", lambda kv, s=salt: kv.pin_prefix(PROMPT, cache_salt=s))
        add("stats().tiers (control)", lambda kv: kv.stats().tiers,
            lambda t: "accepted" if len(t) == 2 and all(x.used_blocks >= 4 for x in t) else "wrong-kv")

    def served(kv):
        hit = kv.add_sequence("r", PROMPT)
        try:
            return hit, kv_right(kv, "r", PROMPT, hit)
        finally:
            kv.free("r")
    cases.append(("serving", "tiers: a prefix promoted from the tiers reads as written (control)",
                  lambda: judge(lambda: served(tiered()[0]),
                                accept=lambda r: "accepted" if r == (16, True) else "wrong-kv")))
    return cases


def surface_cases(smoke: bool) -> list[tuple[str, str, Callable[[], str]]]:
    return (attention_cases(smoke) + gather_cases(smoke) + select_cases(smoke) + table_cases(smoke)
            + tier_cases(smoke) + cli_cases(smoke))


def prepare() -> None:
    cache()
    tiered()
