"""The conversation both transfers follow, and the checks on what a peer says.

1. sender -> receiver: a hello (see :mod:`pagedkv.transfer.wire`), then a JSON header
   (kind, KV format, namespace, counts, ...) and the token ids, or an abort with the
   sender's reason;
2. receiver -> sender: ``{"ok": true, "start_block": k}`` (it already holds the first
   ``k`` blocks, from its prefix cache or its tiers) or ``{"ok": false, "reason": ...}``;
3. sender -> receiver: the KV of blocks ``k..`` (and, for a sequence, its window rows),
   each payload framed with its size and checksum; or an abort;
4. receiver -> sender: ``{"ok": true}`` once it verified and committed (registered)
   them, or ``{"ok": false, "reason": ...}``.

Every message is checked before anything is done with it: the header against a strict
schema (:mod:`pagedkv.transfer.schema`) and this cache's KV format (every setting that
differs is named, with both values); the token ids and KV against the sizes announced
and their checksums. The receiver allocates before step 2 and commits after step 3,
only once everything arrived intact; any failure in between frees what it allocated,
so a failed transfer registers nothing and leaks nothing. Both sides raise
:class:`~pagedkv.errors.TransferError` with the same reason.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError, TransferError, expected
from pagedkv.format.fingerprint import describe, differences, kv_format
from pagedkv.transfer.schema import check, exactly
from pagedkv.transfer.wire import DATA, MAGIC, MAX_DEPTH, MAX_JSON, VERSION, Link, json_depth

__all__ = ["header", "recv_header", "refusal", "scratch_id", "jsonable", "abort", "expect_ok", "refuse", "send_tokens",
           "recv_tokens", "recv_kv", "MAX_TOKENS"]

MAX_TOKENS = (1 << 31) - 1


def scratch_id() -> str:
    """A private sequence id for blocks held during a transfer."""
    return f"pagedkv.transfer:{uuid.uuid4().hex}"


def jsonable(name: str, value: Any) -> Any:
    """``value``, refused unless a peer would accept it (JSON, bounded size and depth)."""
    try:
        raw = json.dumps(value).encode()
    except (TypeError, ValueError, RecursionError):
        raise InvalidArgumentError(expected(name, "a JSON-serializable value to send to a peer",
                                            type(value).__name__)) from None
    if len(raw) > MAX_JSON // 2 or json_depth(raw) > MAX_DEPTH // 2:
        raise InvalidArgumentError(expected(name, f"JSON of at most {MAX_JSON // 2} bytes and nesting "
                                            f"{MAX_DEPTH // 2} to send to a peer", f"{len(raw)} bytes"))
    return value


def header(kind: str, cache, **fields) -> dict[str, Any]:
    h = {"magic": MAGIC, "version": VERSION, "kind": kind, "format": kv_format(cache.store)}
    h.update(fields)
    return h


def abort(link: Link, kind: str, error: BaseException) -> None:
    """Tell a waiting receiver that this sender failed before sending anything."""
    link.send_hello()
    link.send_abort(str(error))


def refusal(h: Any, kind: str, cache, fields: dict[str, Any], link: Link) -> str | None:
    """Why a received header cannot be served here (None when it can): not a pagedkv
    header, another kind, another KV format (every differing setting named), or a field
    that fails ``fields`` (see :func:`pagedkv.transfer.schema.check`)."""
    if type(h) is not dict or h.get("magic") != MAGIC:
        return "not a pagedkv transfer header"
    if h.get("version") != VERSION:
        return f"protocol version {h.get('version')!r}, this side speaks {VERSION}"
    if h.get("kind") != kind:
        return f"a {h.get('kind')!r} transfer, this side expects {kind!r}"
    diff = differences(kv_format(cache.store), h.get("format"))
    if diff:
        return "KV format differs: " + describe(diff, f"on the sender (rank {link.peer})", "on the receiver")
    return check(h, fields, "header")


def recv_header(link: Link, kind: str, cache, fields: dict[str, Any]):
    """``(header, why it is refused or None)``; a header that is not even JSON is refused
    (after its tokens are drained) rather than raised, so the sender learns why."""
    try:
        h = link.recv_json("waiting for the header")
    except TransferError as e:
        if link.broken:
            raise
        return None, str(e)
    return h, refusal(h, kind, cache, fields, link)


def expect_ok(link: Link, what: str, fields: dict[str, Any] | None = None, last: bool = False) -> dict[str, Any]:
    """The peer's ``{"ok": true, ...}`` reply, checked against ``fields``. A refusal or a
    malformed reply raises TransferError; ``last``: the peer expects nothing after it."""
    reply = link.recv_json(what)        # a malformed one raises; the peer still waits for this side
    if type(reply) is dict and reply.get("ok") is False:
        link.broken = True          # the peer gave up: it reads nothing more
        reason = reply.get("reason")
        raise TransferError(f"rank {link.peer} refused the transfer: "
                            f"{reason if type(reason) is str else '(no reason given)'}")
    why = check(reply, dict({"ok": exactly(True)}, **(fields or {})), "reply")
    if last:
        link.broken = True
    if why is not None:
        raise TransferError(f"transfer with rank {link.peer}: {what}: {why} (corrupt stream)")
    return reply


def refuse(link: Link, reason: str) -> None:
    """Tell the sender why the transfer is refused, then raise the same reason here."""
    link.send_json({"ok": False, "reason": reason}, "refusing")
    link.broken = True
    raise TransferError(f"refused the transfer from rank {link.peer}: {reason}")


def send_tokens(link: Link, tokens: np.ndarray) -> None:
    link.send_data(torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)), "sending tokens")


def recv_tokens(link: Link, n: int | None) -> np.ndarray | None:
    """The ``n`` token ids the header announced, verified (size and checksum); with
    ``n=None`` (a header this side refuses) whatever came is received and dropped."""
    what = "receiving tokens"
    if n is None:
        _, size, _ = link.recv_frame(what, DATA)
        link.drain(size, what)
        return None
    t = torch.empty(n, dtype=torch.int32, device=link.ctl)
    link.recv_data(t, what)
    return t.cpu().numpy()


def recv_kv(link: Link, cache, blocks, window: bool) -> None:
    """Step 3 on the receiver: ``blocks``' KV (and the window rows when ``window``), each
    part verified before it lands in blocks no reader can see yet. On a bad part the
    rest is received and dropped, the sender is told why, and TransferError is raised."""
    error: TransferError | None = None
    try:
        link.recv_blocks(cache.store.arenas, blocks)
        cache.store.replaced(blocks)
    except TransferError as e:
        if link.broken:
            raise
        error = e
    if window:
        cfg = cache.config
        try:
            link.recv_window(None if error is not None else cache.store.window, blocks,
                             (cfg.num_layers, 2, cfg.block_size, cfg.kv_heads_per_rank, cfg.head_dim))
        except TransferError as e:
            if link.broken or error is not None:
                raise error or e
            error = e
    if error is not None:
        refuse(link, str(error))


def send_state(link: Link, state: bytes) -> None:
    """A recurrent-state sequence's state (``export_state``'s bytes), after its KV."""
    link.send_data(torch.frombuffer(bytearray(state), dtype=torch.uint8), "sending the recurrent state")


def recv_state(link: Link, cache) -> bytes:
    """The state :func:`send_state` sent, verified (size and checksum); a bad one is
    refused (the sender is told why) and raises :class:`TransferError`."""
    t = torch.empty(cache.state_nbytes(), dtype=torch.uint8, device=link.ctl)
    try:
        link.recv_data(t, "receiving the recurrent state")
    except TransferError as e:
        if link.broken:
            raise
        refuse(link, str(e))
    return bytes(t.cpu().numpy())
