"""Move one sequence (its tokens, metadata and committed KV) to another process."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pagedkv.errors import InvalidArgumentError, PagedKVError, TransferError, expected
from pagedkv.manager.handoff import admit_restored
from pagedkv.transfer.protocol import (
    MAX_TOKENS,
    abort,
    expect_ok,
    header,
    jsonable,
    recv_header,
    recv_kv,
    recv_state,
    recv_tokens,
    refuse,
    scratch_id,
    send_state,
    send_tokens,
)
from pagedkv.transfer.schema import Invalid, anything, integer, optional, scalar, text
from pagedkv.transfer.wire import Link

__all__ = ["send_sequence", "recv_sequence", "ReceivedSequence"]

KIND = "sequence"


def _seq_id(v):
    if v is not None and type(v) is not str and (type(v) is not int or not -(1 << 63) <= v < (1 << 63)):
        raise Invalid("null, a str or a 64-bit int")
    return v


def _sendable_id(v):
    try:
        return _seq_id(v)
    except Invalid:
        return None         # the receiver then needs seq_id=


#: the header's fields past magic, version, kind and format
HEADER = {"seq_id": _seq_id, "cache_salt": optional(text()), "adapter_id": scalar, "metadata": anything,
          "priority": optional(integer(0, 127)), "num_tokens": integer(0, MAX_TOKENS),
          "num_computed": integer(0, MAX_TOKENS)}
# and "groups" (checked by _held_positions): absent or null without layer groups


def _held_positions(cache, h) -> list[np.ndarray] | None:
    """With layer groups: per group, the table positions whose KV the sender sends (a
    sliding group sends only what its window and sinks hold), checked against this
    cache; None without groups. Raises ``Invalid`` naming what is wrong."""
    plan = cache.config.layer_groups
    groups = h.get("groups")
    if plan is None:
        if groups is not None:
            raise Invalid("no layer groups (null)")
        return None
    nb = -(-h["num_computed"] // cache.config.block_size)
    if type(groups) is not list or len(groups) != len(plan.groups):
        raise Invalid(f"a list of {len(plan.groups)} position lists (one per layer group)")
    out = []
    for g, (pos, lg) in enumerate(zip(groups, plan.groups)):
        if type(pos) is not list or not all(type(p) is int for p in pos):
            raise Invalid(f"group {g}: a list of ints")
        arr = np.asarray(pos, dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() >= nb or (np.diff(arr) <= 0).any()):
            raise Invalid(f"group {g}: increasing positions in [0, {nb})")
        if not lg.releases_blocks and len(arr) != nb:     # a group that keeps every block sends them all
            raise Invalid(f"group {g} (full attention): all {nb} positions")
        out.append(arr)
    return out


class ReceivedSequence(NamedTuple):
    seq_id: Any            # the id it lives under in the receiving cache
    num_tokens: int        # committed tokens (as on the sender, or more if already cached here)
    cached_tokens: int     # of those, found in this cache (device or tiers): not transferred
    metadata: Any          # what the sender passed as ``metadata``


def _require_store(cache):
    if cache.store is None:
        raise InvalidArgumentError(expected("cache", "a PagedKVCache with a KV store", "a bookkeeping-only cache"))


def send_sequence(cache, seq_id, dst: int, *, metadata: Any = None, group=None, timeout: float = 60.0) -> int:
    """Send sequence ``seq_id`` of ``cache`` to rank ``dst`` (which calls
    :func:`recv_sequence`); returns the KV blocks sent.

    Sends the known token ids, the namespace, the priority, ``metadata`` (any
    JSON-serializable value, e.g. the first sampled token of a prefill) and the KV of
    every committed token, layer by layer, scales included. Blocks the receiver already
    holds (a cached prefix) are not sent. The sequence stays here; it may be freed or
    extended meanwhile (its blocks are held by a private fork until the send ends).
    Raises :class:`~pagedkv.errors.TransferError` when the receiver refuses, dies or
    times out.
    """
    _require_store(cache)
    link = Link(dst, group, timeout, cache.store.device)
    tmp = scratch_id()
    try:
        jsonable("metadata", metadata)
        info = cache.sequence_info(seq_id)
        salt, adapter = info["namespace"]
        jsonable("adapter_id", adapter)
        cache.fork(seq_id, tmp)
    except PagedKVError as e:
        abort(link, KIND, e)
        raise
    try:
        state = cache.export_state(tmp) if cache.state_store is not None else b""
    except PagedKVError as e:
        cache.free(tmp)
        abort(link, KIND, e)
        raise
    try:
        tokens = cache.token_ids(seq_id)
        computed = cache.num_tokens(tmp)
        bs = cache.config.block_size
        nb = -(-computed // bs)
        groups = None
        if cache.config.layer_groups is not None:    # each group's held blocks (a sliding group: its window)
            tables = [cache.block_table(tmp, group=g)[:nb] for g in range(len(cache.config.layer_groups.groups))]
            groups = [np.flatnonzero(t >= 0).tolist() for t in tables]
        link.send_hello()
        link.send_json(header(KIND, cache, seq_id=_sendable_id(seq_id),
                              cache_salt=salt, adapter_id=adapter, metadata=metadata,
                              priority=info["priority"] if info["priority"] >= 0 else None,
                              num_tokens=len(tokens), num_computed=computed, groups=groups), "sending the header")
        send_tokens(link, tokens)
        start = expect_ok(link, "waiting for the receiver's allocation",
                          {"start_block": integer(0, -(-len(tokens) // bs))})["start_block"]
        if groups is not None:       # the receiver reuses no prefix of a grouped sequence: start is 0
            blocks = np.concatenate([t[np.asarray(p, dtype=np.int64)] for t, p in zip(tables, groups)]).tolist() \
                if start == 0 else []
        else:
            blocks = cache.block_table(tmp)[start:nb].tolist() if start * bs < computed else []
        link.send_blocks(cache.store.arenas, blocks)
        link.send_window(cache.store.window, blocks)
        if cache.state_store is not None and start * bs < computed:
            send_state(link, state)         # the state after every committed token
        expect_ok(link, "waiting for the receiver's commit", last=True)
        return len(blocks)
    except TransferError as e:
        link.send_abort(str(e))          # when the receiver still waits for this side
        raise
    finally:
        cache.free(tmp)


def recv_sequence(cache, src: int, *, seq_id: Any = None, group=None, timeout: float = 60.0) -> ReceivedSequence:
    """Receive a sequence sent by rank ``src`` with :func:`send_sequence`.

    The sequence is admitted (under ``seq_id``, by default the sender's id) exactly as
    if its prefill had run here: blocks allocated, KV written, tokens committed, full
    blocks registered for prefix reuse; decode continues with :meth:`reserve`/
    :meth:`advance`. On any failure (refusal, dead or silent peer) it is freed before
    :class:`~pagedkv.errors.TransferError` is raised: nothing half-registered, nothing
    leaked.
    """
    _require_store(cache)
    link = Link(src, group, timeout, cache.store.device)
    link.recv_hello()
    h, reason = recv_header(link, KIND, cache, HEADER)
    if reason is None and h["num_computed"] > h["num_tokens"]:
        reason = f"header: num_computed={h['num_computed']} exceeds num_tokens={h['num_tokens']}"
    try:
        tokens = recv_tokens(link, h["num_tokens"] if reason is None else None)   # also when refusing
    except TransferError as e:
        if link.broken:
            raise
        reason = str(e)
    sid = seq_id if seq_id is not None else (h["seq_id"] if reason is None else None)
    if reason is None and sid is None:
        reason = "the sender's sequence id cannot be sent: pass seq_id= to recv_sequence"
    positions = None
    if reason is None:
        try:
            positions = _held_positions(cache, h)
        except Invalid as e:
            reason = f"header: field 'groups': expected {e}"
    added = False
    hit = need = 0
    if reason is None:
        try:
            if positions is None:
                hit = cache.add_sequence(sid, tokens, cache_salt=h["cache_salt"], adapter_id=h["adapter_id"],
                                         priority=h["priority"])
            else:   # every block comes (no prefix reuse), sliding groups untracked: no blank block registers
                admit_restored(cache, sid, tokens, h["cache_salt"], h["adapter_id"], h["priority"])
            added = True
            need = max(0, h["num_computed"] - hit)
            if need:
                cache.reserve(sid, need)
        except PagedKVError as e:
            reason = str(e)
            if added:
                cache.free(sid)
    if reason is not None:
        refuse(link, reason)
    try:
        bs = cache.config.block_size
        start = hit // bs
        link.send_json({"ok": True, "start_block": start}, "sending the allocation")
        if positions is not None:
            blocks = np.concatenate([cache.block_table(sid, group=g)[p] for g, p in enumerate(positions)]).tolist() \
                if need else []
        else:
            blocks = cache.block_table(sid)[start:].tolist() if need else []
        recv_kv(link, cache, blocks, window=True)        # verified before anything is committed
        if need and cache.state_store is not None:
            cache.import_state(sid, recv_state(link, cache))   # the commit snapshots it where due
        if need:
            cache.commit(sid, need)
        link.send_json({"ok": True}, "confirming the commit")
    except BaseException:
        cache.free(sid)
        raise
    return ReceivedSequence(sid, cache.num_tokens(sid), hit, h["metadata"])
