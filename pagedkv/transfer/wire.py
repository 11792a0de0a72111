"""Framing over torch.distributed point-to-point: control messages and KV blocks.

Every operation is an ``isend``/``irecv`` waited with a timeout, so a dead or silent
peer surfaces as :class:`~pagedkv.errors.TransferError` in bounded time. Control
messages are int64 vectors and length-prefixed bytes (UTF-8 JSON); with NCCL they live
on the GPU, as NCCL requires.

KV moves layer by layer and arena by arena (data, then quantization scales): the
sender sends a view of its arena when the blocks form one run (no copy) and gathers
them otherwise; the receiver receives into a staging buffer of one layer's blocks
(a few, rotating, so the next receives are posted before the current one is copied
in) and copies it into its arena only once it has fully arrived. A transfer that
fails therefore never leaves a partly received layer in a block the cache can read,
and a receive still in flight after a timeout can only land in its own buffer.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from pagedkv.errors import InvalidArgumentError, TransferError, expected

__all__ = ["Link", "MAGIC", "VERSION"]

MAGIC = 0x706B7678          # "pkvx"
VERSION = 1
_TAG = 0x5000               # gloo matches by tag; NCCL keeps p2p order per peer
_DEPTH = 3                  # KV messages in flight per direction (receive buffers: one more per arena)


class Link:
    """One conversation with ``peer`` in ``group`` (default: the world)."""

    def __init__(self, peer: int, group=None, timeout: float = 60.0, device: Optional[torch.device] = None):
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

    # ---- primitives ---------------------------------------------------------------------
    def _tag(self) -> int:
        self.step += 1
        return _TAG + self.step

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None

    def send(self, t: torch.Tensor, what: str):
        """Start sending ``t`` (contiguous); returns the work to wait on."""
        try:
            work = dist.isend(t, self.peer, group=self.group, tag=self._tag())
        except RuntimeError as e:
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None
        self.bytes_moved += t.numel() * t.element_size()
        return work

    def recv(self, t: torch.Tensor, what: str):
        try:
            work = dist.irecv(t, self.peer, group=self.group, tag=self._tag())
        except RuntimeError as e:
            raise TransferError(f"transfer with rank {self.peer} failed while {what}: {e}") from None
        self.bytes_moved += t.numel() * t.element_size()
        return work

    def wait(self, work, what: str) -> None:
        self._wait(work, what)

    # ---- control messages -------------------------------------------------------------------
    def send_ints(self, values: Sequence[int], what: str) -> None:
        self.wait(self.send(torch.tensor(list(values), dtype=torch.int64, device=self.ctl), what), what)

    def recv_ints(self, n: int, what: str) -> List[int]:
        t = torch.empty(n, dtype=torch.int64, device=self.ctl)
        self.wait(self.recv(t, what), what)
        return t.tolist()

    def send_json(self, obj: Any, what: str) -> None:
        raw = json.dumps(obj, sort_keys=True).encode()
        self.send_ints([len(raw)], what)
        if raw:
            self.send_bytes(raw, what)

    def recv_json(self, what: str, limit: int = 1 << 26) -> Any:
        (n,) = self.recv_ints(1, what)
        if not 0 <= n <= limit:
            raise TransferError(f"transfer with rank {self.peer}: {what}: a message of {n} bytes (corrupt stream)")
        raw = self.recv_bytes(n, what) if n else b""
        try:
            return json.loads(raw.decode())
        except ValueError:
            raise TransferError(f"transfer with rank {self.peer}: {what}: a message that is not JSON") from None

    def send_bytes(self, raw: bytes, what: str) -> None:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.ctl)
        self.wait(self.send(t, what), what)

    def recv_bytes(self, n: int, what: str) -> bytes:
        t = torch.empty(n, dtype=torch.uint8, device=self.ctl)
        self.wait(self.recv(t, what), what)
        return bytes(t.cpu().numpy())

    # ---- KV blocks ----------------------------------------------------------------------------
    def send_blocks(self, arenas: List[torch.Tensor], blocks: Sequence[int]) -> None:
        """Send ``blocks`` of every layer of every arena (``[L, NB, ...]``), in order."""
        if not len(blocks):
            return
        run = _as_run(blocks)
        idx = None if run is not None else torch.tensor(list(blocks), dtype=torch.int64, device=arenas[0].device)
        window: List[Any] = []
        for layer in range(arenas[0].shape[0]):
            for a in arenas:
                src = a[layer]
                part = src[run[0]:run[1]] if run is not None else src.index_select(0, idx)
                part = _wire(part).to(self.comm).contiguous()     # no copy for a run on the comm device
                window.append((self.send(part, f"sending layer {layer}"), part, layer))
                if len(window) > _DEPTH:
                    w, _, lay = window.pop(0)
                    self.wait(w, f"sending layer {lay}")
        for w, _, lay in window:
            self.wait(w, f"sending layer {lay}")

    def recv_blocks(self, arenas: List[torch.Tensor], blocks: Sequence[int]) -> None:
        """Receive what :meth:`send_blocks` sends into ``blocks`` of ``arenas``."""
        if not len(blocks):
            return
        n = len(blocks)
        idx = torch.tensor(list(blocks), dtype=torch.int64, device=arenas[0].device)
        jobs = [(layer, a) for layer in range(arenas[0].shape[0]) for a in arenas]
        buffers = {}

        def post(i):
            layer, a = jobs[i]
            key = (id(a), i % (_DEPTH + 1))
            if key not in buffers:
                buffers[key] = torch.empty((n,) + tuple(a.shape[2:]), dtype=_wire_dtype(a.dtype), device=self.comm)
            buf = buffers[key]
            return self.recv(buf, f"receiving layer {layer}"), buf

        pending = [post(i) for i in range(min(_DEPTH, len(jobs)))]
        for i, (layer, a) in enumerate(jobs):
            work, buf = pending.pop(0)
            if i + _DEPTH < len(jobs):
                pending.append(post(i + _DEPTH))
            self.wait(work, f"receiving layer {layer}")
            _wire(a[layer]).index_copy_(0, idx, buf.to(a.device))


    # ---- recent-window rows -------------------------------------------------------------------
    def send_window(self, window, blocks: Sequence[int]) -> None:
        """After :meth:`send_blocks`: the model-precision window rows that ``window`` (a
        :class:`~pagedkv.window.RecentWindow`, or None) holds for ``blocks``, so the
        receiver reads the sequence's newest tokens exactly as this side does."""
        if window is None or not len(blocks):
            self.send_json({"window": []}, "sending the window rows")
            return
        which, data, valid = window.export_rows(np.asarray(list(blocks), dtype=np.int64))
        self.send_json({"window": which.tolist(), "shape": list(data.shape),
                        "dtype": str(data.dtype).replace("torch.", "")}, "sending the window rows")
        if len(which):
            for t in (data, valid):
                raw = t.contiguous().view(torch.uint8).to(self.comm)
                self.wait(self.send(raw, "sending the window rows"), "sending the window rows")

    def recv_window(self, window, blocks: Sequence[int], geometry: Sequence[int]) -> None:
        """Receive what :meth:`send_window` sends into ``window`` for ``blocks`` (read and
        dropped when this cache keeps no window, or keeps one of another shape).
        ``geometry``: this cache's ``(num_layers, 2, block_size, heads, head_dim)``, which
        bounds what a corrupt stream could make this side allocate."""
        what = "receiving the window rows"
        msg = self.recv_json(what)
        which = msg.get("window") if isinstance(msg, dict) else None
        if not isinstance(which, list):
            raise TransferError(f"transfer with rank {self.peer}: {what}: not a window message (corrupt stream)")
        if not which:
            return
        try:
            shape = [int(x) for x in msg["shape"]]
            dtype = getattr(torch, msg["dtype"])
            ok = (len(shape) == 6 and 0 < shape[0] <= geometry[0] and shape[1] == len(which)
                  and shape[2:] == list(geometry[1:]) and dtype in (torch.float32, torch.float16, torch.bfloat16)
                  and all(isinstance(i, int) and 0 <= i < len(blocks) for i in which)
                  and len(set(which)) == len(which))
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise TransferError(f"transfer with rank {self.peer}: {what}: a malformed window header (corrupt stream)")
        data = torch.empty(shape, dtype=dtype, device=self.comm)
        valid = torch.empty(shape[:2] + [shape[3]], dtype=torch.bool, device=self.comm)
        for t in (data, valid):
            self.wait(self.recv(t.view(torch.uint8), what), what)
        if window is None or list(window.data.shape[2:]) != shape[2:] or window.data.shape[0] != shape[0]:
            return
        window.import_rows(np.asarray(list(blocks), dtype=np.int64)[np.asarray(which, dtype=np.int64)], data, valid)


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
