"""Framing over torch.distributed point-to-point: control messages and KV blocks.

Every operation is an ``isend``/``irecv`` waited with a timeout, so a dead or silent
peer surfaces as :class:`~pagedkv.errors.TransferError` in bounded time. With NCCL the
messages live on the GPU, as NCCL requires.

A conversation opens with one int64 *hello* (magic and protocol version; a single int,
so a peer of another version, which posts its own first receive, fails with a typed
error rather than a size mismatch). After it, every message is a *frame* (int64
``[FRAME_MAGIC, kind, nbytes, checksum]``) followed by its payload of ``nbytes``
bytes: a JSON control message, a data payload (token ids, one layer of one arena, window
rows), or an abort with the peer's reason. The receiver checks the frame against what it
expects before it posts the payload's receive (gloo ends the process when a payload is
larger than its receive buffer), drains a payload of the wrong size when it is small
enough and refuses, and verifies the checksum of every payload before the data is used.
What the framing cannot stop is a peer that lies in its frame *and* sends more bytes;
see docs/trust.md.

KV moves layer by layer and arena by arena (data, then quantization scales): the
sender sends a view of its arena when the blocks form one run (no copy) and gathers
them otherwise; the receiver receives into a staging buffer of one layer's blocks
(a few, rotating, so the next receives are posted before the current one is copied
in), verifies it, and copies it into its arena only then. A transfer that fails
therefore never leaves a partly received or corrupt layer in a block the cache can
read, and a receive still in flight after a timeout can only land in its own buffer.
"""
from __future__ import annotations

import datetime
import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagedkv.errors import InvalidArgumentError, TransferError, expected

__all__ = ["Link", "MAGIC", "VERSION", "PeerAborted", "checksum", "json_depth"]

MAGIC = 0x706B7678          # "pkvx"
VERSION = 2
HELLO = (MAGIC << 16) | VERSION
FRAME_MAGIC = 0x706B76786672     # "pkvxfr"
JSON, DATA, ABORT = 1, 2, 3
_FRAME_INTS = 4
_FRAME_ROOM = 8             # a frame is received into this many int64s: a later version may add fields
_TAG = 0x5000               # gloo matches by tag; NCCL keeps p2p order per peer
_DEPTH = 3                  # KV messages in flight per direction (receive buffers: one more per arena)
MAX_JSON = 1 << 24          # bytes of one control message
MAX_DEPTH = 64              # nesting of one control message
DRAIN_LIMIT = 1 << 26       # a payload of the wrong size up to this is received and dropped


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """``t`` zeroed before a receive lands in it. gloo completes a receive that got fewer
    bytes than were posted and does not say how many arrived, so whatever a short payload
    did not overwrite is checksummed with it: left uninitialized, that could be memory that
    still holds the very bytes the frame announced (a buffer freed by an earlier transfer of
    the same tokens), and a truncated payload would pass or fail by chance."""
    return t.zero_()


class PeerAborted(TransferError):
    """The peer sent an abort in place of the message this side expected."""


def checksum(t: torch.Tensor) -> int:
    """Checksum of a contiguous tensor's bytes: CRC-32 on the CPU (gloo); on a GPU (NCCL,
    where both peers are on GPUs) a position-weighted sum computed on the device."""
    b = t.reshape(-1).view(torch.uint8)
    if b.device.type == "cpu":
        return zlib.crc32(b.numpy())  # type: ignore[arg-type]  # numpy: a buffer
    x = b.to(torch.int64)
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % 65521
    return (int(x.sum()) & 0xFFFFFFFF) | ((int((x * w).sum()) & 0x7FFFFFFF) << 32)


def json_depth(raw: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text ``raw`` (strings skipped), computed
    without recursion, so that a hostile message cannot exhaust the stack of json.loads."""
    a = np.frombuffer(raw, dtype=np.uint8)
    if not len(a):
        return 0
    quote = a == ord('"')
    esc = np.zeros(len(a), dtype=bool)
    bs = np.flatnonzero(a == ord("\\"))
    if len(bs):                 # a quote preceded by an odd run of backslashes is escaped
        run = np.zeros(len(a), dtype=np.int64)
        for i in bs.tolist():   # backslashes are rare in control messages
            run[i] = (run[i - 1] if i else 0) + 1
        esc[1:] = run[:-1] % 2 == 1
    quote &= ~esc
    inside = (np.cumsum(quote) - quote) % 2 == 1
    opens = ((a == ord("[")) | (a == ord("{"))) & ~inside & ~quote
    closes = ((a == ord("]")) | (a == ord("}"))) & ~inside & ~quote
    return int(np.max(np.cumsum(opens.astype(np.int64) - closes), initial=0))


class Link:
    """One conversation with ``peer`` in ``group`` (default: the world)."""

    def __init__(self, peer: int, group=None, timeout: float = 60.0, device: torch.device | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(expected("torch.distributed", "an initialized process group "
                                                "(torch.distributed.init_process_group)", "none"))
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise InvalidArgumentError(expected("peer rank", "an int", type(peer).__name__))
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        if not 0 <= peer < world or peer == me:
            raise InvalidArgumentError(expected("peer rank", f"another rank in [0, {world}) (this is {me})", peer))
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(expected("timeout", "seconds > 0", repr(timeout)))
        self.peer = peer
        self.group = group
        self.timeout = datetime.timedelta(seconds=float(timeout))
        nccl = dist.get_backend(group) == "nccl"
        self.ctl = device if (nccl and device is not None) else torch.device("cpu")
        self.comm = self.ctl                 # where tensors must be to cross
        self.step = 0
        self.bytes_moved = 0
        self.broken = False                  # the peer died, timed out or aborted: say nothing more

    # ---- primitives ---------------------------------------------------------------------
    def _tag(self) -> int:
        self.step += 1
        return _TAG + self.step

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            self.broken = True
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None

    def send(self, t: torch.Tensor, what: str):
        """Start sending ``t`` (contiguous); returns the work to wait on."""
        try:
            work = dist.isend(t, self.peer, group=self.group, tag=self._tag())
        except RuntimeError as e:
            self.broken = True
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None
        self.bytes_moved += t.numel() * t.element_size()
        return work

    def recv(self, t: torch.Tensor, what: str):
        try:
            work = dist.irecv(t, self.peer, group=self.group, tag=self._tag())
        except RuntimeError as e:
            self.broken = True
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None
        self.bytes_moved += t.numel() * t.element_size()
        return work

    def wait(self, work, what: str) -> None:
        self._wait(work, what)

    def corrupt(self, what: str, why: str) -> TransferError:
        return TransferError(f"transfer with rank {self.peer}: {what}: {why} (corrupt stream)")

    # ---- hello and frames -----------------------------------------------------------------
    def send_hello(self) -> None:
        self.send_ints([HELLO], "opening the transfer")

    def recv_hello(self) -> None:
        what = "opening the transfer"
        t = torch.zeros(_FRAME_ROOM, dtype=torch.int64, device=self.ctl)
        self.wait(self.recv(t, what), what)
        got = int(t[0])
        if got >> 16 != MAGIC:
            self.broken = True          # not our protocol: nothing we send would be understood
            raise self.corrupt(what, f"not a pagedkv transfer of protocol version {VERSION} "
                                     f"(first message {got}; a peer speaking version 1?)")
        if got & 0xFFFF != VERSION:
            self.broken = True
            raise TransferError(f"transfer with rank {self.peer}: protocol version {got & 0xFFFF}, "
                                f"this side speaks {VERSION}")

    def send_ints(self, values: Sequence[int], what: str) -> None:
        self.wait(self.send(torch.tensor(list(values), dtype=torch.int64, device=self.ctl), what), what)

    def send_frame(self, kind: int, payload: torch.Tensor | None, what: str, check: int | None = None):
        """Send a frame and start sending ``payload`` (contiguous, on the comm device) after
        it; returns the payload's work (None for an empty one)."""
        n = 0 if payload is None else payload.numel() * payload.element_size()
        if check is None:
            check = checksum(payload) if payload is not None and n else 0
        self.send_ints([FRAME_MAGIC, kind, n, check], what)
        return self.send(payload, what) if payload is not None and n else None

    def recv_frame(self, what: str, kind: int) -> list[int]:
        """``[kind, nbytes, checksum]`` of the next frame; an abort raises :class:`PeerAborted`."""
        t = torch.zeros(_FRAME_ROOM, dtype=torch.int64, device=self.ctl)
        self.wait(self.recv(t, what), what)
        magic, got, n, check = t[:_FRAME_INTS].tolist()
        if magic != FRAME_MAGIC or not 0 <= n or got not in (JSON, DATA, ABORT):
            self.broken = True          # out of step with the peer: no reply could be matched
            raise self.corrupt(what, f"a malformed frame {t[:_FRAME_INTS].tolist()}")
        if got == ABORT:
            raw = self._payload(n, check, what, MAX_JSON)
            self.broken = True
            try:
                reason = json.loads(raw.decode()) if json_depth(raw) <= MAX_DEPTH else "(unreadable reason)"
            except ValueError:
                reason = "(unreadable reason)"
            raise PeerAborted(f"rank {self.peer} aborted the transfer: {reason}")
        if got != kind:
            self.drain(n, what)
            raise self.corrupt(what, f"a {_KINDS[got]} message where a {_KINDS[kind]} message was due")
        return [got, n, check]

    def drain(self, n: int, what: str) -> None:
        """Receive and drop a payload of ``n`` bytes, so the peer's send completes and the
        conversation stays in step; too large a payload is left (the peer times out)."""
        if 0 < n <= DRAIN_LIMIT:
            self.wait(self.recv(torch.empty(n, dtype=torch.uint8, device=self.ctl), what), what)
        elif n:
            self.broken = True

    def _payload(self, n: int, check: int, what: str, limit: int) -> bytes:
        if n > limit:
            self.drain(n, what)
            raise self.corrupt(what, f"a message of {n} bytes (at most {limit})")
        if not n:
            return b""
        t = torch.empty(n, dtype=torch.uint8, device=self.ctl)
        self.wait(self.recv(_fresh(t), what), what)
        if checksum(t) != check:
            raise self.corrupt(what, "a message whose checksum does not match its frame")
        return bytes(t.cpu().numpy())

    def send_abort(self, reason: str) -> None:
        """Tell the peer, in place of the next message it expects from this side, that this
        side gave up (best effort: the peer may be gone)."""
        if self.broken:
            return
        raw = json.dumps(str(reason)[:4096]).encode()
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.ctl)
        try:
            w = self.send_frame(ABORT, t, "sending an abort")
            self.wait(w, "sending an abort")
        except TransferError:
            pass

    # ---- control messages -------------------------------------------------------------------
    def send_json(self, obj: Any, what: str) -> None:
        raw = json.dumps(obj, sort_keys=True).encode()
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.ctl)
        self.wait(self.send_frame(JSON, t, what), what)

    def recv_json(self, what: str, limit: int = MAX_JSON) -> Any:
        _, n, check = self.recv_frame(what, JSON)
        raw = self._payload(n, check, what, limit)
        if json_depth(raw) > MAX_DEPTH:
            raise self.corrupt(what, f"a message nested deeper than {MAX_DEPTH}")
        try:
            return json.loads(raw.decode())
        except (ValueError, RecursionError):
            raise self.corrupt(what, "a message that is not JSON") from None

    def send_data(self, t: torch.Tensor, what: str) -> None:
        """One data payload (``t`` contiguous on any device)."""
        t = t.contiguous().to(self.comm)
        work = self.send_frame(DATA, t, what)
        if work is not None:
            self.wait(work, what)

    def recv_data(self, t: torch.Tensor, what: str) -> None:
        """Receive a payload of exactly ``t``'s size into ``t`` (contiguous, comm device)
        and verify it; the wrong size is drained (when small) and raises."""
        _, n, check = self.recv_frame(what, DATA)
        want = t.numel() * t.element_size()
        if n != want:
            self.drain(n, what)
            raise self.corrupt(what, f"{n} bytes where {want} were announced")
        if n:
            self.wait(self.recv(_fresh(t), what), what)
            if checksum(t) != check:
                raise self.corrupt(what, "data whose checksum does not match its frame")

    # ---- KV blocks ----------------------------------------------------------------------------
    def send_blocks(self, arenas: list[torch.Tensor], blocks: Sequence[int]) -> None:
        """Send ``blocks`` of every layer of every arena (``[L, NB, ...]``), in order, each
        part framed with its size and checksum."""
        if not len(blocks):
            return
        run = _as_run(blocks)
        idx = None if run is not None else torch.tensor(list(blocks), dtype=torch.int64, device=arenas[0].device)
        window: list[Any] = []
        for layer in range(arenas[0].shape[0]):
            for a in arenas:
                src = a[layer]
                part = src[run[0]:run[1]] if run is not None else src.index_select(0, idx)  # type: ignore[arg-type]  # idx: set unless a run
                part = _wire(part).to(self.comm).contiguous()     # no copy for a run on the comm device
                window.append((self.send_frame(DATA, part, f"sending layer {layer}"), part, layer))
                if len(window) > _DEPTH:
                    w, _, lay = window.pop(0)
                    self.wait(w, f"sending layer {lay}")
        for w, _, lay in window:
            self.wait(w, f"sending layer {lay}")

    def recv_blocks(self, arenas: list[torch.Tensor], blocks: Sequence[int]) -> None:
        """Receive what :meth:`send_blocks` sends into ``blocks`` of ``arenas``. Each part
        is checked (size, then checksum) before it is copied in; after a bad part the rest
        are received and dropped (the conversation stays in step) and TransferError is
        raised. The blocks must be ones no reader can see yet (allocated, uncommitted)."""
        if not len(blocks):
            return
        n = len(blocks)
        idx = torch.tensor(list(blocks), dtype=torch.int64, device=arenas[0].device)
        jobs = [(layer, a) for layer in range(arenas[0].shape[0]) for a in arenas]
        buffers = {}
        error: TransferError | None = None
        pending: list[Any] = []

        def land(entry):
            nonlocal error
            work, buf, check, layer, a = entry
            self.wait(work, f"receiving layer {layer}")
            if error is None and checksum(buf) != check:
                error = self.corrupt(f"receiving layer {layer}", "data whose checksum does not match its frame")
            if error is None:
                _wire(a[layer]).index_copy_(0, idx, buf.to(a.device))

        for i, (layer, a) in enumerate(jobs):
            what = f"receiving layer {layer}"
            _, size, check = self.recv_frame(what, DATA)
            key = (id(a), i % (_DEPTH + 1))
            if key not in buffers:
                buffers[key] = torch.empty((n,) + tuple(a.shape[2:]), dtype=_wire_dtype(a.dtype), device=self.comm)
            buf = buffers[key]
            want = buf.numel() * buf.element_size()
            if size != want:
                self.drain(size, what)
                if error is None:
                    error = self.corrupt(what, f"{size} bytes where {want} were announced ({n} block(s))")
                if self.broken:
                    break
                continue
            pending.append((self.recv(_fresh(buf), what), buf, check, layer, a))   # landed: free to reuse
            if len(pending) >= _DEPTH:
                land(pending.pop(0))
        for entry in pending:
            land(entry)
        if error is not None:
            raise error

    # ---- recent-window rows -------------------------------------------------------------------
    def send_window(self, window, blocks: Sequence[int]) -> None:
        """After :meth:`send_blocks`: the model-precision window rows that ``window`` (a
        :class:`~pagedkv.store.window.RecentWindow`, or None) holds for ``blocks``, so the
        receiver reads the sequence's newest tokens exactly as this side does."""
        if window is None or not len(blocks):
            self.send_json({"window": []}, "sending the window rows")
            return
        which, data, valid = window.export_rows(np.asarray(list(blocks), dtype=np.int64))
        self.send_json({"window": which.tolist(), "shape": list(data.shape),
                        "dtype": str(data.dtype).replace("torch.", "")}, "sending the window rows")
        if len(which):
            for t in (data, valid):
                self.send_data(t.contiguous().view(torch.uint8), "sending the window rows")

    def recv_window(self, window, blocks: Sequence[int], geometry: Sequence[int]) -> None:
        """Receive what :meth:`send_window` sends into ``window`` for ``blocks`` (read and
        dropped when this cache keeps no window, or keeps one of another shape).
        ``geometry``: this cache's ``(num_layers, 2, block_size, heads, head_dim)``, which
        bounds what a corrupt stream could make this side allocate."""
        what = "receiving the window rows"
        msg = self.recv_json(what)
        which = msg.get("window") if isinstance(msg, dict) else None
        if not isinstance(which, list):
            raise self.corrupt(what, "not a window message")
        if not which:
            return
        shape, name = msg.get("shape"), msg.get("dtype")
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(name) \
            if isinstance(name, str) else None
        ok = (isinstance(shape, list) and len(shape) == 6 and all(type(x) is int for x in shape)
              and dtype is not None and 0 < shape[0] <= geometry[0] and shape[1] == len(which)
              and shape[2:] == list(geometry[1:]) and all(type(i) is int and 0 <= i < len(blocks) for i in which)
              and len(set(which)) == len(which))
        if not ok:
            for _ in range(2):          # the rows the sender sends after its header
                _, n, _ = self.recv_frame(what, DATA)
                self.drain(n, what)
            raise self.corrupt(what, "a malformed window header")
        data = torch.empty(shape, dtype=dtype, device=self.comm)
        valid = torch.empty(shape[:2] + [shape[3]], dtype=torch.bool, device=self.comm)
        for t in (data, valid):
            self.recv_data(t.view(torch.uint8), what)
        if window is None or list(window.data.shape[2:]) != shape[2:] or window.data.shape[0] != shape[0]:
            return
        window.import_rows(np.asarray(list(blocks), dtype=np.int64)[np.asarray(which, dtype=np.int64)], data, valid)


_KINDS = {JSON: "control", DATA: "data", ABORT: "abort"}


def _as_run(blocks: Sequence[int]):
    b = list(blocks)
    if all(b[i + 1] == b[i] + 1 for i in range(len(b) - 1)):
        return b[0], b[-1] + 1
    return None


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp8 has no collective or index_copy kernels everywhere; its bytes travel as uint8.
    return torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
