"""The conversation both transfers follow, and the checks on what a peer says.

1. sender -> receiver: a JSON header (kind, KV format, namespace, counts, ...) or an
   ``abort`` with the sender's reason; then the token ids;
2. receiver -> sender: ``{"ok": true, "start_block": k}`` (it already holds the first
   ``k`` blocks, from its prefix cache or its tiers) or ``{"ok": false, "reason": ...}``;
3. sender -> receiver: the KV of blocks ``k..`` (see :mod:`pagedkv.transfer.wire`);
4. receiver -> sender: ``{"ok": true}`` once it committed (registered) them.

The receiver allocates before step 2 and commits after step 3; any failure in between
frees what it allocated, so a failed transfer registers nothing and leaks nothing.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Dict, Optional

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError, TransferError, expected
from pagedkv.kvformat import kv_format
from pagedkv.transfer.wire import MAGIC, VERSION, Link

__all__ = ["header", "refusal", "scratch_id", "jsonable", "abort", "expect_ok", "send_tokens", "recv_tokens"]

_MAX_TOKENS = 1 << 31


def scratch_id() -> str:
    """A private sequence id for blocks held during a transfer."""
    return f"pagedkv.transfer:{uuid.uuid4().hex}"


def jsonable(name: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(expected(name, "a JSON-serializable value to send to a peer",
                                            type(value).__name__)) from None
    return value


def header(kind: str, cache, **fields) -> Dict[str, Any]:
    h = {"magic": MAGIC, "version": VERSION, "kind": kind, "format": kv_format(cache.store)}
    h.update(fields)
    return h


def abort(link: Link, kind: str, error: BaseException) -> None:
    """Tell a waiting receiver that this sender failed before sending anything."""
    link.send_json({"magic": MAGIC, "version": VERSION, "kind": kind, "abort": str(error)}, "sending an abort")


def refusal(h: Any, kind: str, cache) -> Optional[str]:
    """Why a received header cannot be served here (None when it can)."""
    if not isinstance(h, dict) or h.get("magic") != MAGIC:
        return "not a pagedkv transfer"
    if h.get("version") != VERSION:
        return f"protocol version {h.get('version')!r}, this side speaks {VERSION}"
    if h.get("kind") != kind:
        return f"a {h.get('kind')!r} transfer, this side expects {kind!r}"
    if "abort" in h:
        return None
    mine, theirs = kv_format(cache.store), h.get("format")
    if theirs != mine:
        keys = sorted(set(mine) | set(theirs or {}))
        diff = [k for k in keys if (theirs or {}).get(k) != mine.get(k)]
        k = diff[0] if diff else "format"
        return f"KV format differs: {k}={(theirs or {}).get(k)!r} there, {mine.get(k)!r} here"
    return None


def expect_ok(link: Link, what: str) -> Dict[str, Any]:
    reply = link.recv_json(what)
    if not isinstance(reply, dict) or not reply.get("ok"):
        reason = reply.get("reason") if isinstance(reply, dict) else reply
        raise TransferError(f"rank {link.peer} refused the transfer: {reason}")
    return reply


def refuse(link: Link, reason: str) -> None:
    """Tell the sender why the transfer is refused, then raise the same reason here."""
    link.send_json({"ok": False, "reason": reason}, "refusing")
    raise TransferError(f"refused the transfer from rank {link.peer}: {reason}")


def send_tokens(link: Link, tokens: np.ndarray) -> None:
    if len(tokens):
        t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)).to(link.ctl)
        link.wait(link.send(t, "sending tokens"), "sending tokens")


def recv_tokens(link: Link, h: Any) -> np.ndarray:
    """The token ids a header announced (none for an abort or a foreign header)."""
    n = h.get("num_tokens", 0) if isinstance(h, dict) and "abort" not in h else 0
    if not isinstance(n, int) or not 0 <= n < _MAX_TOKENS:
        raise TransferError(f"transfer with rank {link.peer}: a header announcing {n!r} tokens (corrupt stream)")
    if not n:
        return np.empty(0, dtype=np.int32)
    t = torch.empty(n, dtype=torch.int32, device=link.ctl)
    link.wait(link.recv(t, "receiving tokens"), "receiving tokens")
    return t.cpu().numpy()
