"""Hostile input against the surfaces beyond the cache's calls (issue 25, item 3): the
disk tier's directory, a transfer peer, configs (CacheConfig, HF and GGUF), the CLI.

Each case runs one hostile input and returns its verdict:

- ``typed``: a pagedkv error, with the state unchanged (the tier directory's bytes, the
  receiving cache's sequences and pool) and, where the case names one, the right
  builtin base (``wrong-base`` otherwise);
- ``accepted``: the input is valid, or harmless, and what was served is right;
- ``accepted-bad``: a bad input taken silently (a config misread);
- ``wrong-kv``: KV served that is not what was written (checked on every hit);
- ``escape``: a file outside the tier directory used, written or created;
- ``untyped:<class>``: any other exception; ``state-changed``: a typed error after
  state changed.

The runner (``hostile_inputs.py``) adds ``crash`` (the child process died) and
``hang`` (no verdict within the case timeout).

Transfers: ``send_sequence``/``recv_sequence`` and ``send_prefix``/``recv_prefix`` run
over an in-process loopback: both ends in one process (the sender on a thread), with
:class:`~pagedkv.transfer.wire.Link`'s two primitives (``send``/``recv``) replaced by
mailboxes matched by tag, as gloo matches them. Everything above the primitives (JSON
framing, token and block receives, window rows, the protocol) is pagedkv's own code.
The hostile peer is the real sender with one message changed on the way out. A message
shorter than the receive posted fills its start (gloo does the same, leaving the rest
as it was); a longer one aborts the process, as gloo's size check does.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import stat
import struct
import tempfile
import threading
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

L, H, D, BS = 2, 2, 8, 4
PROMPT = list(range(300, 317))          # 4 full blocks and one token
TMP = None                              # a scratch directory per child process


def scratch() -> str:
    global TMP
    if TMP is None:
        TMP = tempfile.mkdtemp(prefix="pagedkv-hostile-")
    return TMP


def fresh_dir(name: str) -> str:
    path = os.path.join(scratch(), name)
    if os.path.lexists(path):
        _rmtree(path)
    os.makedirs(path)
    return path


def _rmtree(path: str) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for n in files + dirs:
            p = os.path.join(root, n)
            if os.path.islink(p) or not os.path.isdir(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(path)


# ---- verdicts ---------------------------------------------------------------------------------
def judge(call: Callable[[], Any], *, state: Optional[Callable[[], Any]] = None, base=None,
          accept: Optional[Callable[[Any], str]] = None) -> str:
    """Run ``call``; ``state()`` must not change when it raises; ``accept(result)`` gives
    the verdict when it returns (``accepted-bad`` when the case has none)."""
    from pagedkv.errors import PagedKVError
    before = state() if state else None
    try:
        result = call()
    except PagedKVError as e:
        if state is not None and state() != before:
            return "state-changed"
        if base is not None and not isinstance(e, base):
            return f"wrong-base:{type(e).__name__} is not a {base.__name__}"
        return "typed"
    except RecursionError:
        return "untyped:RecursionError"
    except Exception as e:   # noqa: BLE001 - classifying is the point
        return f"untyped:{type(e).__name__}: {str(e)[:80]}"
    if accept is None:
        return "accepted-bad"
    return accept(result)


# ---- the KV every case writes: a function of (token, position) ----------------------------------
def kv_of(tokens, start=0):
    import torch
    g = torch.Generator().manual_seed(7)
    table = torch.randn(2, 512, 64, H, D, generator=g)
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64) % 512)
    p = torch.arange(start, start + len(tokens)) % 64
    return table[0][t, p], table[1][t, p]


def config(**kw):
    import torch
    from pagedkv import CacheConfig
    base = dict(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=32, dtype=torch.float32)
    base.update(kw)
    return CacheConfig(**base)


def fill(cache, sid, tokens):
    """Admit ``sid`` and write and commit its tokens after the hit; returns the hit."""
    hit = cache.add_sequence(sid, tokens)
    n = len(tokens) - hit
    if n:
        slots = cache.reserve(sid, n)
        k, v = kv_of(tokens[hit:], hit)
        for layer in range(L):
            cache.write(layer, slots, k, v)
        cache.commit(sid, n)
    return hit


def kv_right(cache, sid, tokens, upto: int, atol: float = 0.0) -> bool:
    """Whether ``sid``'s first ``upto`` tokens read back as written (``atol``: quantized)."""
    if not upto:
        return True
    k, v = kv_of(tokens[:upto])
    for layer in range(L):
        gk, gv = cache.gather(sid, layer, upto)
        if float((gk - k).abs().max()) > atol or float((gv - v).abs().max()) > atol:
            return False
    return True


# ---- disk tier ----------------------------------------------------------------------------------
def tier_config(path, **kw):
    return config(prefix_disk_dir=path, prefix_disk_blocks=16, prefix_tier_write="through", **kw)


_TEMPLATE = None


def tier_template() -> str:
    """A tier directory holding PROMPT's 4 full blocks (written once per child)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from pagedkv import PagedKVCache
        path = fresh_dir("template")
        with PagedKVCache(tier_config(path)) as c:
            fill(c, "w", PROMPT)
            c.free("w")
        _TEMPLATE = path
    return _TEMPLATE


def dir_state(path: str) -> Tuple:
    """Names, kinds and bytes of a directory's entries (links not followed)."""
    out = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        st = os.lstat(p)
        digest = ""
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            digest = os.readlink(p)
        out.append((name, stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0, digest))
    return tuple(out)


def outside_state(paths) -> Tuple:
    out = []
    for p in paths:
        if os.path.lexists(p):
            with open(p, "rb") as f:
                out.append((p, hashlib.sha256(f.read()).hexdigest()))
        else:
            out.append((p, None))
    return tuple(out)


def tier_case(tamper: Callable[[str, str], Optional[List[str]]]) -> str:
    """Copy the template, ``tamper(dir, outside_dir)`` it (returning outside paths to
    watch), open a cache on it and admit PROMPT: a typed refusal must leave the directory
    as it was; a cache that opens must serve the written KV on any hit."""
    from pagedkv import PagedKVCache
    path = os.path.join(scratch(), "case")
    if os.path.lexists(path):
        _rmtree(path)
    shutil.copytree(tier_template(), path)
    outside = fresh_dir("outside")
    watched = tamper(path, outside) or []
    before_out = outside_state(watched)
    result = {}

    def call():
        cache = PagedKVCache(tier_config(path))
        result["cache"] = cache
        hit = cache.add_sequence("r", PROMPT)
        ok = kv_right(cache, "r", PROMPT, hit)
        cache.free("r")
        return ok

    def accept(ok):
        return "accepted" if ok else "wrong-kv"

    try:
        v = judge(call, state=lambda: dir_state(path), accept=accept)
    finally:
        if "cache" in result:
            result["cache"].close()
    if outside_state(watched) != before_out or (watched and "cache" in result):
        return "escape"
    return v


def _write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def _json_edit(name, fn):
    def tamper(d, _):
        p = os.path.join(d, name)
        with open(p) as f:
            obj = json.load(f)
        obj = fn(obj)
        _write(p, obj if isinstance(obj, bytes) else json.dumps(obj).encode())
    return tamper


def _set(key, value):
    def fn(obj):
        obj[key] = value
        return obj
    return fn


def _bytes_edit(name, fn):
    def tamper(d, _):
        p = os.path.join(d, name)
        with open(p, "rb") as f:
            raw = f.read()
        _write(p, fn(raw))
    return tamper


def _replace_with(name, kind):
    def tamper(d, outside):
        p = os.path.join(d, name)
        if os.path.lexists(p):
            os.unlink(p)
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            os.mkdir(p)
        elif kind == "missing":
            pass
        return []
    return tamper


def _symlink(name, copy: bool):
    def tamper(d, outside):
        p = os.path.join(d, name)
        target = os.path.join(outside, name + ".target")
        if copy and os.path.exists(p):
            shutil.copyfile(p, target)
        if os.path.lexists(p):
            os.unlink(p)
        os.symlink(target, p)
        return [target]
    return tamper


def _deep(n):
    return ("[" * n + "]" * n).encode()


def _index_field(field, value):
    def tamper(d, _):
        from pagedkv.tiers.chain import slot_dtype
        p = os.path.join(d, "index.bin")
        rec = np.fromfile(p, dtype=slot_dtype(BS))
        s = int(np.flatnonzero(rec["valid"] == 1)[0])
        rec[field][s] = value
        rec.tofile(p)
    return tamper


def tier_cases(smoke: bool):
    cases = []

    def add(name, tamper):
        cases.append(("tier", name, lambda t=tamper: tier_case(t)))

    add("tier: untouched (control)", lambda d, o: None)
    metas = [("kv_format list", _set("kv_format", [1])), ("kv_format str", _set("kv_format", "x")),
             ("kv_format int", _set("kv_format", 1)), ("capacity -1", _set("capacity", -1)),
             ("capacity 2**64", _set("capacity", 2**64)), ("capacity str", _set("capacity", "16")),
             ("record_bytes 1", _set("record_bytes", 1)), ("block_size 0", _set("block_size", 0)),
             ("version '1'", _set("version", "1")), ("magic wrong", _set("magic", "x")),
             ("not a dict", lambda o: [o]), ("null", lambda o: None), ("deep 100000", lambda o: _deep(100_000)),
             ("truncated", lambda o: json.dumps(o).encode()[:20]), ("garbage", lambda o: os.urandom(64)),
             ("not utf-8", lambda o: b"\xff\xfe{}"), ("empty", lambda o: b"")]
    for label, fn in metas[:6] if smoke else metas:
        add(f"tier: meta.json {label}", _json_edit("meta.json", fn))
    nss = [("dict", lambda o: {}), ("ints", lambda o: [1, 2]), ("non-hex", lambda o: ["zz"]),
           ("deep 100000", lambda o: _deep(100_000)), ("truncated", lambda o: b"[\"ab")]
    for label, fn in nss[:2] if smoke else nss:
        add(f"tier: namespaces.json {label}", _json_edit("namespaces.json", fn))
    bins = [("index.bin truncated", "index.bin", lambda r: r[:len(r) // 2]),
            ("index.bin extended", "index.bin", lambda r: r + b"\0" * 64),
            ("index.bin garbage", "index.bin", lambda r: os.urandom(len(r))),
            ("index.bin zeros", "index.bin", lambda r: b"\0" * len(r)),
            ("blocks.bin truncated", "blocks.bin", lambda r: r[:len(r) // 3]),
            ("blocks.bin one byte flipped", "blocks.bin", lambda r: bytes([r[0] ^ 0xFF]) + r[1:]),
            ("blocks.bin garbage", "blocks.bin", lambda r: os.urandom(len(r)))]
    for label, name, fn in bins[:3] if smoke else bins:
        add(f"tier: {label}", _bytes_edit(name, fn))
    if not smoke:
        add("tier: index.bin stamp 2**64-1", _index_field("stamp", np.uint64(2**64 - 1)))
        add("tier: index.bin valid 2", _index_field("valid", 2))
        add("tier: index.bin crc flipped", _index_field("crc", 1))
    for name in ("meta.json", "namespaces.json", "blocks.bin", "index.bin", "lock"):
        for kind in ("fifo", "dir", "missing"):
            if smoke and kind != "fifo" and name != "meta.json":
                continue
            add(f"tier: {name} is a {kind}" if kind != "missing" else f"tier: {name} missing",
                _replace_with(name, kind))
    for name, copy in (("blocks.bin", True), ("index.bin", True), ("meta.json", True), ("namespaces.json", True),
                       ("lock", False), ("meta.json.tmp", False), ("namespaces.json.tmp", False)):
        if smoke and name not in ("blocks.bin", "lock"):
            continue
        add(f"tier: {name} symlink out of the directory", _symlink(name, copy))
    return cases


def tier_arg_cases(smoke: bool):
    from pagedkv import PagedKVCache

    def open_with(**kw):
        def call():
            c = PagedKVCache(config(**kw))
            c.close()
        return call

    args = [("prefix_disk_dir with NUL", dict(prefix_disk_dir="a\0b", prefix_disk_blocks=4), ValueError),
            ("prefix_disk_dir a regular file", "file", OSError),
            ("prefix_disk_dir 5000 chars", dict(prefix_disk_dir="x" * 5000, prefix_disk_blocks=4), OSError),
            ("prefix_disk_blocks 2**40", "huge", ValueError),     # past the format's int32 slot ids
            ("prefix_disk_blocks -1", dict(prefix_disk_dir="DIR", prefix_disk_blocks=-1), ValueError),
            ("prefix_disk_blocks '4'", dict(prefix_disk_dir="DIR", prefix_disk_blocks="4"), TypeError),
            ("prefix_disk_dir int", dict(prefix_disk_dir=5, prefix_disk_blocks=4), TypeError)]
    cases = []
    for label, kw, base in args[:3] if smoke else args:
        def run(kw=kw, base=base):
            d = fresh_dir("argdir")
            if kw == "file":
                _write(os.path.join(d, "f"), b"x")
                kw = dict(prefix_disk_dir=os.path.join(d, "f"), prefix_disk_blocks=4)
            elif kw == "huge":
                kw = dict(prefix_disk_dir=d, prefix_disk_blocks=2**40)
            else:
                kw = {k: (d if v == "DIR" else v) for k, v in kw.items()}
            return judge(open_with(**kw), base=base)
        cases.append(("tier", f"tier: {label}", run))
    return cases


# ---- transfers over an in-process loopback ------------------------------------------------------
class _Mailboxes:
    def __init__(self):
        self.boxes = {0: {}, 1: {}}
        self.cond = threading.Condition()

    def put(self, rank, tag, raw):
        with self.cond:
            self.boxes[rank][tag] = raw
            self.cond.notify_all()

    def take(self, rank, tag, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: tag in self.boxes[rank], timeout):
                return None
            return self.boxes[rank].pop(tag)


class _Done:
    def wait(self, timeout=None):
        return True


class _Pending:
    def __init__(self, boxes, rank, tag, t):
        self.boxes, self.rank, self.tag, self.t = boxes, rank, tag, t

    def wait(self, timeout=None):
        import torch
        raw = self.boxes.take(self.rank, self.tag, timeout.total_seconds() if timeout else None)
        if raw is None:
            raise RuntimeError(f"timed out waiting for tag {self.tag}")
        dst = self.t.view(-1).view(torch.uint8) if self.t.dtype != torch.uint8 else self.t.view(-1)
        if len(raw) > dst.numel():
            os.abort()          # gloo: "message too long" ends in terminate
        if raw:
            dst[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return True


def _loop_link_class():
    from pagedkv.transfer.wire import _FRAME_INTS, FRAME_MAGIC as _FRAME_MAGIC, Link

    class LoopLink(Link):
        """A :class:`Link` whose send/recv go through in-process mailboxes."""

        def __init__(self, boxes, me, peer, timeout, mutate=None):   # noqa: D107 - no process group
            import torch
            self.boxes, self.me, self.peer, self.group = boxes, me, peer, None
            self.timeout = datetime.timedelta(seconds=timeout)
            self.ctl = self.comm = torch.device("cpu")
            self.step, self.bytes_moved = 0, 0
            self.broken = False
            self.mutate = mutate

        def send_json(self, obj, what):
            if self.mutate is not None and "json" in self.mutate:
                obj = self.mutate["json"](obj, what)
                if isinstance(obj, bytes):      # raw bytes in place of the JSON text
                    self.send_ints([len(obj)], what)
                    if obj:
                        self.send_bytes(obj, what)
                    return
            super().send_json(obj, what)

        def send(self, t, what):
            # The hostile peer is buggy, not lying: a frame (protocol 2 sends one before
            # every payload) is held back and then announces the size and checksum of the
            # payload as altered, as a peer that believes what it sends would; dropping a
            # payload drops its frame. (A peer whose frame lies about its size makes gloo
            # abort the receiver: documented in docs/trust.md, not modelled here.)
            import zlib

            import torch
            tag = self._tag()
            raw = bytes(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()) \
                if t.numel() else b""
            frame = np.frombuffer(raw, dtype=np.int64) if len(raw) == 8 * _FRAME_INTS else None
            if frame is not None and int(frame[0]) == _FRAME_MAGIC:
                if int(frame[2]) == 0:                   # no payload follows
                    self.boxes.put(self.peer, tag, raw)
                else:
                    self.held = (tag, frame.copy())
                return _Done()
            if self.mutate is not None and "raw" in self.mutate:
                raw = self.mutate["raw"](raw, what)
            held, self.held = getattr(self, "held", None), None
            if raw is not None:
                if held is not None:
                    ftag, fr = held
                    fr[2], fr[3] = len(raw), zlib.crc32(raw)
                    self.boxes.put(self.peer, ftag, fr.tobytes())
                self.boxes.put(self.peer, tag, raw)
            return _Done()

        def recv(self, t, what):
            return _Pending(self.boxes, self.me, self._tag(), t)

    return LoopLink


def transfer_case(kind: str, mutate: dict, kv_dtype=None) -> str:
    """Send PROMPT's sequence (or prefix) from one cache to another over the loopback,
    one message changed by ``mutate``; judge the receiver."""
    import pagedkv.transfer.prefix as tp
    import pagedkv.transfer.sequence as ts
    from pagedkv import PagedKVCache
    from pagedkv.errors import PagedKVError

    boxes = _Mailboxes()
    LoopLink = _loop_link_class()

    def factory(peer, group=None, timeout=60.0, device=None):
        me = 1 - peer
        return LoopLink(boxes, me, peer, 1.0, mutate if me == 0 else None)

    sender = PagedKVCache(config(kv_dtype=kv_dtype))
    receiver = PagedKVCache(config(kv_dtype=kv_dtype))
    fill(sender, "s", PROMPT)
    fill(receiver, "other", [1, 2, 3, 4, 5])      # something to keep unchanged
    tol = 0.0 if kv_dtype is None else 1.0

    def state():
        # every block's state (free / in use / cached: an eviction shows), not the free
        # queue's order, which any allocate-then-free reorders without meaning anything
        return (tuple(sorted(map(repr, receiver.sequences()))), tuple(receiver.pool.ref_cnt.tolist()),
                tuple(receiver.pool.states().tolist()), receiver.match_prefix(PROMPT))

    old = (ts.Link, tp.Link)
    ts.Link = tp.Link = factory
    side = threading.Thread(target=_quiet, args=(
        (lambda: ts.send_sequence(sender, "s", 1, metadata={"m": 1})) if kind == "sequence"
        else (lambda: tp.send_prefix(sender, PROMPT[:16], 1)),), daemon=True)
    try:
        side.start()
        if kind == "sequence":
            def call():
                got = ts.recv_sequence(receiver, 0)
                return got
        else:
            def call():
                return tp.recv_prefix(receiver, 0)

        def accept(got):
            if kind == "sequence":
                sid = got.seq_id
                toks = receiver.token_ids(sid).tolist()
                ok = toks == PROMPT and kv_right(receiver, sid, PROMPT, receiver.num_tokens(sid), tol)
                receiver.free(sid)
            else:
                receiver.add_sequence("probe", PROMPT)
                ok = kv_right(receiver, "probe", PROMPT, receiver.num_tokens("probe"), tol)
                receiver.free("probe")
            return "accepted" if ok else "wrong-kv"

        v = judge(call, state=state, accept=accept)
        side.join(5.0)
        receiver.free("other")
        try:
            receiver.check_invariants()
            if (np.asarray(receiver.pool.ref_cnt) > 0).any():    # a block still held after every free
                v = "leak" if v in ("typed", "accepted") else v
        except PagedKVError as e:
            v = f"invariant-broken:{e}"
        return v
    finally:
        ts.Link, tp.Link = old
        sender.free("s")


def _quiet(fn):
    try:
        fn()
    except BaseException:   # noqa: BLE001 - the hostile side's own outcome is not judged
        pass


def _header(fn):
    def mutate(obj, what):
        if what == "sending the header" and isinstance(obj, dict):
            obj = dict(obj)
            r = fn(obj)
            return obj if r is None else r
        return obj
    return {"json": mutate}


def _raw(match, fn):
    def mutate(raw, what):
        return fn(raw) if what.startswith(match) else raw
    return {"raw": mutate}


def transfer_cases(smoke: bool):
    heads = [("num_computed 'abc'", lambda h: h.update(num_computed="abc")),
             ("num_computed null", lambda h: h.update(num_computed=None)),
             ("num_computed -5", lambda h: h.update(num_computed=-5)),
             ("num_computed 2**62", lambda h: h.update(num_computed=2**62)),
             ("num_tokens true", lambda h: h.update(num_tokens=True)),
             ("num_tokens 13 (17 sent)", lambda h: h.update(num_tokens=13)),
             ("format list", lambda h: h.update(format=[1])), ("format str", lambda h: h.update(format="x")),
             ("format missing", lambda h: h.pop("format")), ("cache_salt missing", lambda h: h.pop("cache_salt")),
             ("cache_salt list", lambda h: h.update(cache_salt=[1])), ("priority 'x'", lambda h: h.update(priority="x")),
             ("seq_id list", lambda h: h.update(seq_id=[1])), ("version 2", lambda h: h.update(version=2)),
             ("an unknown field", lambda h: h.update(extra=1)),
             ("header deep 100000", lambda h: _deep(100_000)), ("header not JSON", lambda h: b"\xff{"),
             ("header a list", lambda h: [1, 2])]
    prefix_heads = [("hashes list of ints", lambda h: h.update(hashes=[1, 2])),
                    ("hashes missing", lambda h: h.pop("hashes", None)),
                    ("num_tokens 2**40", lambda h: h.update(num_tokens=2**40))]
    payloads = [("3 token ids of 17", _raw("sending tokens", lambda r: r[:12])),
                ("token ids with extra bytes", _raw("sending tokens", lambda r: r + b"\0" * 8)),
                ("1 block per layer of 4", _raw("sending layer", lambda r: r[:len(r) // 4])),
                ("a layer's blocks dropped", _raw("sending layer 1", lambda r: None)),
                ("window rows header garbage", _raw("sending the window rows", lambda r: r[:3]))]
    replies = [("reply without start_block", {"json": lambda o, w: {"ok": True} if w == "sending the allocation"
                                                else o})]
    cases = []
    for label, fn in heads[:5] if smoke else heads:
        cases.append(("transfer", f"transfer: sequence header {label}",
                      lambda fn=fn: transfer_case("sequence", _header(fn))))
    for label, m in payloads[:3] if smoke else payloads:
        cases.append(("transfer", f"transfer: sequence {label}", lambda m=m: transfer_case("sequence", m)))
    if not smoke:
        for label, fn in prefix_heads + heads[5:7]:
            cases.append(("transfer", f"transfer: prefix header {label}",
                          lambda fn=fn: transfer_case("prefix", _header(fn))))
        for label, m in payloads[:4]:
            cases.append(("transfer", f"transfer: prefix {label}", lambda m=m: transfer_case("prefix", m)))
        # a hostile receiver's reply, judged on the sender: the receiver here is honest
        for label, m in replies:
            cases.append(("transfer", f"transfer: {label} (sender judged)", lambda m=m: reply_case(m)))
        cases.append(("transfer", "transfer: int4 sequence, 1 block per layer of 4",
                      lambda: transfer_case("sequence", payloads[2][1], kv_dtype="int4")))
    cases.append(("transfer", "transfer: sequence untouched (control)", lambda: transfer_case("sequence", {})))
    return cases


def reply_case(mutate: dict) -> str:
    """The receiver's replies changed: the sender must fail typed and keep its sequence."""
    import pagedkv.transfer.sequence as ts
    from pagedkv import PagedKVCache
    boxes = _Mailboxes()
    LoopLink = _loop_link_class()

    def factory(peer, group=None, timeout=60.0, device=None):
        me = 1 - peer
        return LoopLink(boxes, me, peer, 1.0, mutate if me == 1 else None)

    sender, receiver = PagedKVCache(config()), PagedKVCache(config())
    fill(sender, "s", PROMPT)
    old = ts.Link
    ts.Link = factory
    side = threading.Thread(target=_quiet, args=(lambda: ts.recv_sequence(receiver, 0),), daemon=True)
    try:
        side.start()
        v = judge(lambda: ts.send_sequence(sender, "s", 1),
                  state=lambda: (tuple(sender.pool.ref_cnt.tolist()), tuple(map(repr, sender.sequences()))),
                  accept=lambda n: "accepted" if kv_right(sender, "s", PROMPT, len(PROMPT)) else "wrong-kv")
        side.join(5.0)
        for sid in receiver.sequences():
            receiver.free(sid)
        return v
    finally:
        ts.Link = old
        sender.free("s")


# ---- configs ------------------------------------------------------------------------------------
HF_BASE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}


def config_cases(smoke: bool):
    from pagedkv import CacheConfig, PagedKVCache
    cases = []

    def make(kw, allocate=False):
        def call():
            cfg = config(**kw)
            if allocate:
                PagedKVCache(cfg).close()
            return cfg
        return call

    fields = [("num_layers '8'", dict(num_layers="8"), TypeError), ("num_layers 8.0", dict(num_layers=8.0), TypeError),
              ("num_layers None", dict(num_layers=None), TypeError), ("num_layers 0", dict(num_layers=0), ValueError),
              ("num_layers 2**63", dict(num_layers=2**63), ValueError),
              ("head_dim True", dict(head_dim=True), TypeError), ("block_size '4'", dict(block_size="4"), TypeError),
              ("num_blocks 2**40 (allocated)", dict(num_blocks=2**40), MemoryError),
              ("memory_budget '1TiB' (allocated)", dict(num_blocks=None, memory_budget="1TiB"), MemoryError),
              ("memory_budget of 5000 digits", dict(num_blocks=None, memory_budget="9" * 5000), ValueError),
              ("memory_budget nan", dict(num_blocks=None, memory_budget=float("nan")), TypeError),
              ("memory_budget '-1GiB'", dict(num_blocks=None, memory_budget="-1GiB"), ValueError),
              ("kv_window 10**12 (allocated)", dict(kv_dtype="int4", kv_window=10**12), MemoryError),
              ("prefix_host_blocks 2**40 (allocated)", dict(prefix_host_blocks=2**40), MemoryError),
              # a config may name a device this machine lacks (planning); the cache refuses it
              ("device 'cuda:99' (allocated)", dict(device="cuda:99"), ValueError),
              ("device 'nope'", dict(device="nope"), ValueError),
              # a dict keyed by every layer is read in layer order; a partial one is refused
              ("layer_windows {0: 4} (layer 1 missing)", dict(layer_windows={0: 4}), ValueError),
              ("kv_dtype 'int5'", dict(kv_dtype="int5"), TypeError),    # DTypeError, a TypeError
              ("dtype list", dict(dtype=["f"]), TypeError),
              ("kv_rotation_seed 2**64", dict(kv_dtype="int4", kv_rotation_seed=2**64), ValueError),
              ("kv_full_precision_layers (5,)", dict(kv_dtype="int4", kv_full_precision_layers=(5,)), ValueError)]
    for label, kw, base in fields[:6] if smoke else fields:
        cases.append(("config", f"config: {label}",
                      lambda kw=kw, base=base, label=label: judge(make(kw, "allocated" in label), base=base)))

    hf = [("num_attention_heads 0", dict(num_attention_heads=0)), ("hidden_size 'big'", dict(hidden_size="big")),
          ("hidden_size nan", dict(hidden_size=float("nan"))), ("hidden_size inf", dict(hidden_size=float("inf"))),
          ("hidden_size list", dict(hidden_size=[32])), ("num_hidden_layers -1", dict(num_hidden_layers=-1)),
          ("model_type list", dict(model_type=["llama"])), ("model_type dict", dict(model_type={"a": 1})),
          ("sliding_window 'x'", dict(sliding_window="x", layer_types=["sliding_attention"] * 2)),
          ("layer_types of 3 for 2 layers", dict(layer_types=["full_attention"] * 3)),
          ("text_config a path string", "path"), ("text_config a list", dict(text_config=[1]))]
    for label, extra in hf[:4] if smoke else hf:
        def run(extra=extra):
            src = dict(HF_BASE)
            if extra == "path":
                p = os.path.join(scratch(), "inner.json")
                _write(p, json.dumps(HF_BASE).encode())
                src["text_config"] = p
            else:
                src.update(extra)
            return judge(lambda: CacheConfig.from_hf_config(src, num_blocks=8))
        cases.append(("config", f"config: from_hf_config {label}", run))

    files = [("config.json nested 100000 deep", lambda p: _write(p, _deep(100_000))),
             ("config.json a FIFO", lambda p: os.mkfifo(p)),
             ("config.json not UTF-8", lambda p: _write(p, b"\xff\xfe")),
             ("config.json 'null'", lambda p: _write(p, b"null")),
             ("GGUF truncated header", lambda p: _write(p, b"GGUF" + struct.pack("<I", 3) + b"\0" * 4)),
             ("GGUF 2**63 pairs", lambda p: _write(p, _gguf([], count=2**63))),
             ("GGUF string of 2**63 bytes", lambda p: _write(p, b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**63))),
             ("GGUF block_count -1", lambda p: _write(p, _gguf([("llama.block_count", 5, -1)]))),
             ("GGUF head_count 0", lambda p: _write(p, _gguf([("llama.attention.head_count", 4, 0)]))),
             ("GGUF embedding_length nan", lambda p: _write(p, _gguf([("llama.embedding_length", 6, float("nan"))]))),
             ("GGUF unknown value type", lambda p: _write(p, _gguf([("llama.x", 99, None)])))]
    for label, make_file in files[:2] if smoke else files:
        def run(make_file=make_file):
            d = fresh_dir("cfgfile")
            p = os.path.join(d, "config.json")
            make_file(p)
            return judge(lambda: CacheConfig.from_hf_config(p, num_blocks=8))
        cases.append(("config", f"config: {label}", run))
    return cases


def _gguf(extra, count=None) -> bytes:
    """A little-endian GGUF v3 header: a llama shape, then ``extra`` (key, type, value)."""
    pairs = [("general.architecture", 8, "llama"), ("llama.block_count", 4, 2),
             ("llama.attention.head_count", 4, 4), ("llama.attention.head_count_kv", 4, 2),
             ("llama.embedding_length", 4, 32)]
    keys = {k for k, _, _ in extra}
    pairs = [p for p in pairs if p[0] not in keys] + list(extra)
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs) if count is None else count)
    codes = {4: "<I", 5: "<i", 6: "<f"}
    for key, vtype, value in pairs:
        kb = key.encode()
        out += struct.pack("<Q", len(kb)) + kb + struct.pack("<I", vtype)
        if vtype == 8:
            vb = value.encode()
            out += struct.pack("<Q", len(vb)) + vb
        elif vtype in codes:
            out += struct.pack(codes[vtype], value)
    return out


# ---- the command line ---------------------------------------------------------------------------
def cli_case(argv: List[str]) -> str:
    """``pagedkv.cli.main(argv)``: exit 2 with a one-line error (no traceback) is typed,
    0 is a legitimate answer; an exception out of main is untyped."""
    import contextlib
    import io
    from pagedkv.cli import main
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    except Exception as e:   # noqa: BLE001
        return f"untyped:{type(e).__name__}: {str(e)[:80]}"
    if "Traceback" in err.getvalue():
        return "untyped:traceback printed"
    return "typed" if rc == 2 else ("accepted" if rc == 0 else f"untyped:exit {rc}")


def cli_cases(smoke: bool):
    shape = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]
    plans = [("plan --budget abc", ["plan", "--budget", "abc"] + shape),
             ("plan --budget 5000 digits", ["plan", "--budget", "9" * 5000] + shape),
             ("plan --budget -1", ["plan", "--budget", "-1"] + shape),
             ("plan --num-layers 0", ["plan", "--budget", "1GiB", "--num-layers", "0", "--num-kv-heads", "2",
                                      "--head-dim", "8"]),
             ("plan --block-size 2**40", ["plan", "--budget", "1GiB", "--block-size", str(2**40)] + shape),
             ("plan --max-seq-len -5", ["plan", "--budget", "1GiB", "--max-seq-len", "-5"] + shape),
             ("plan --kv-dtype int5", ["plan", "--budget", "1GiB", "--kv-dtype", "int5"] + shape),
             ("plan --model-config missing", ["plan", "--budget", "1GiB", "--model-config", "/nonexistent/x.json"]),
             ("plan --model-config nested JSON", "deep"), ("plan --model-config hidden_size 'big'", "big"),
             ("plan --budget 1GiB (control)", ["plan", "--budget", "1GiB"] + shape)]
    cases = []
    for label, argv in plans[:4] + plans[-1:] if smoke else plans:
        def run(argv=argv):
            if argv in ("deep", "big"):
                p = os.path.join(fresh_dir("cli"), "config.json")
                _write(p, _deep(100_000) if argv == "deep" else json.dumps(dict(HF_BASE, hidden_size="big")).encode())
                argv = ["plan", "--budget", "1GiB", "--model-config", p]
            return cli_case(argv)
        cases.append(("cli", f"cli: {label}", run))
    if not smoke:
        cases.append(("cli", "cli: demo --num-blocks 3000000000",
                      lambda: cli_case(["demo", "--model", "tiny", "--requests", "1", "--max-new-tokens", "2",
                                        "--num-blocks", "3000000000", "--no-progress"])))
        cases.append(("cli", "cli: demo --arrival-gap 10**12",
                      lambda: cli_case(["demo", "--model", "tiny", "--requests", "2", "--max-new-tokens", "2",
                                        "--arrival-gap", str(10**12), "--no-progress"])))
    return cases


SURFACES = {"tier": lambda smoke: tier_cases(smoke) + tier_arg_cases(smoke), "transfer": transfer_cases,
            "config": config_cases, "cli": cli_cases}


def prepare(names) -> None:
    """Work every child does once before its first case (not timed as a case)."""
    if "tier" in names:
        tier_template()


def surface_cases(names, smoke: bool):
    out = []
    for n in names:
        out.extend(SURFACES[n](smoke))
    return out
