"""Cross-instance prefix sharing: send the cached blocks of a prefix to a peer that
lacks them.

The sender offers its cached full blocks of ``token_ids`` (device, or promoted from its
tiers) with their chained, process-independent block hashes; the receiver checks that
the tokens it got reproduce those hashes, looks the prefix up in its own cache (device
and tiers) and asks only for the blocks past what it already holds. The blocks it
receives are committed and registered like computed ones, then left cached-free: the
next admission with that prefix hits them.

With sliding-window layer groups every group's chain travels, the part that left a
sliding group's window too (see :mod:`pagedkv.manager.handoff`): the receiver registers
each group's blocks as a prefix, and an admission that shares only the chain's first
blocks reads them in its window, so a blank block must never register. What is offered
is the longest prefix *every* group still holds on the sender (a sliding group whose
chain start was evicted offers less, or nothing: ``num_tokens`` in the header, and the
count returned on both sides, say how far the receiver can reuse it).

Window and sink rows (a quantized ``kv_dtype`` with ``kv_window`` or
``kv_sink_tokens``) travel after the blocks, as for a sequence: the receiver reads a
received prefix's sink and window tokens in model precision exactly where the sender
would have, and its sink blocks are pinned in its window arena like those of a prefix
computed here.
"""
from __future__ import annotations

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import InvalidArgumentError, PagedKVError, TransferError, expected
from pagedkv.manager.cache import as_token_ids, namespace_key
from pagedkv.manager.handoff import hold_chains, release_chains
from pagedkv.tiers.chain import ROOT_HASH, chain_hash
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
from pagedkv.transfer.schema import check, integer, list_of_digits, optional, scalar, text
from pagedkv.transfer.wire import Link

__all__ = ["send_prefix", "recv_prefix", "block_hashes"]

KIND = "prefix"

#: the header's fields past magic, version, kind and format (``hashes`` is checked once
#: ``num_tokens`` is known)
HEADER = {"cache_salt": optional(text()), "adapter_id": scalar, "num_tokens": integer(0, MAX_TOKENS)}


def block_hashes(tokens: np.ndarray, block_size: int, cache_salt=None, adapter_id=None) -> list:
    """Chained hashes of the full blocks of ``tokens``: the same in every process (a
    fixed seed, unlike the device index's per-process root)."""
    ns_hash = hash_bytes(namespace_key(cache_salt, adapter_id))
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, ns_hash, tokens[i * block_size:(i + 1) * block_size], False)
        out.append(parent)
    return out


def send_prefix(cache, token_ids, dst: int, *, cache_salt=None, adapter_id=None, group=None,
                timeout: float = 60.0) -> int:
    """Offer rank ``dst`` (calling :func:`recv_prefix`) the cached full blocks of
    ``token_ids`` (the longest prefix every layer group holds here); returns the blocks
    it lacked and received (counted over all layer groups)."""
    if cache.store is None:
        raise InvalidArgumentError(expected("cache", "a PagedKVCache with a KV store", "a bookkeeping-only cache"))
    link = Link(dst, group, timeout, cache.store.device)
    bs = cache.config.block_size
    tmp = scratch_id()
    try:
        tokens = as_token_ids(token_ids)
        jsonable("adapter_id", adapter_id)
        full = tokens[:len(tokens) // bs * bs]
        # One token past the full blocks, so admission may reuse every one of them.
        held = cache.add_sequence(tmp, np.append(full, np.int32(0)), cache_salt=cache_salt, adapter_id=adapter_id)
    except PagedKVError as e:
        abort(link, KIND, e)
        raise
    chains: list = []
    try:
        # every group's chain of the hit (a sliding group's whole chain, not only its window)
        chains = hold_chains(cache, full[:held // bs * bs], cache_salt, adapter_id)
        m = len(chains[0])
        state = b""
        if cache.state_store is not None:
            # the prefix travels with the snapshot at its end: the admission resumed from it
            if m * bs != held:
                release_chains(cache, chains)
                chains, m = [np.empty(0, dtype=np.int32) for _ in chains], 0
            state = cache.export_state(tmp)
        offered = full[:m * bs]
        link.send_hello()
        link.send_json(header(KIND, cache, cache_salt=cache_salt, adapter_id=adapter_id, num_tokens=len(offered),
                              hashes=[str(h) for h in block_hashes(offered, bs, cache_salt, adapter_id)]),
                       "sending the header")
        send_tokens(link, offered)
        start = expect_ok(link, "waiting for the receiver's allocation", {"start_block": integer(0, m)})["start_block"]
        blocks = np.concatenate([c[start:m] for c in chains]).tolist()      # group by group
        link.send_blocks(cache.store.arenas, blocks)
        link.send_window(cache.store.window, blocks)
        if cache.state_store is not None and start < m:
            send_state(link, state)
        expect_ok(link, "waiting for the receiver's commit", last=True)
        return len(blocks)
    except TransferError as e:
        link.send_abort(str(e))          # when the receiver still waits for this side
        raise
    finally:
        release_chains(cache, chains)
        cache.free(tmp)


def recv_prefix(cache, src: int, *, group=None, timeout: float = 60.0) -> int:
    """Receive the prefix blocks rank ``src`` offers with :func:`send_prefix`; returns
    the blocks received, over all layer groups (0 when this cache already held them all).
    On failure nothing
    is registered and nothing leaks."""
    if cache.store is None:
        raise InvalidArgumentError(expected("cache", "a PagedKVCache with a KV store", "a bookkeeping-only cache"))
    link = Link(src, group, timeout, cache.store.device)
    bs = cache.config.block_size
    link.recv_hello()
    h, reason = recv_header(link, KIND, cache, HEADER)
    if reason is None:
        if h["num_tokens"] % bs:
            reason = f"header: num_tokens={h['num_tokens']} is not whole blocks of {bs}"
        else:
            reason = check(h, {"hashes": list_of_digits(h["num_tokens"] // bs)}, "header")
    try:
        tokens = recv_tokens(link, h["num_tokens"] if reason is None else None)   # also when refusing
    except TransferError as e:
        if link.broken:
            raise
        reason = str(e)
    tmp = scratch_id()
    added = False
    k = m = 0
    if reason is None and tokens is not None:     # tokens arrive whenever the header was accepted
        try:
            salt, adapter = h["cache_salt"], h["adapter_id"]
            if [str(x) for x in block_hashes(tokens, bs, salt, adapter)] != h["hashes"]:
                raise TransferError("the tokens received do not reproduce the sender's block hashes")
            m = len(tokens) // bs
            k = cache.add_sequence(tmp, np.append(tokens, np.int32(0)), cache_salt=salt, adapter_id=adapter) // bs
            added = True
            if k < m:
                cache.reserve(tmp, (m - k) * bs)
        except PagedKVError as e:
            reason = str(e)
            if added:
                cache.free(tmp)
    if reason is not None:
        refuse(link, reason)
    try:
        link.send_json({"ok": True, "start_block": min(k, m)}, "sending the allocation")
        # every group's new blocks, group by group (a sliding group's whole chain: its
        # commit registers them all, then releases what left its window)
        blocks = np.concatenate([_table(cache, tmp, g)[k:m] for g in range(_num_groups(cache))]).tolist() \
            if k < m else []
        recv_kv(link, cache, blocks, window=True)        # verified before anything is committed
        if k < m and cache.state_store is not None:      # the state at the prefix's end: snapshotted at the commit
            cache.import_state(tmp, recv_state(link, cache))
        if blocks:
            _pin_sinks(cache, tmp, k)
            cache.commit(tmp, (m - k) * bs)
        link.send_json({"ok": True}, "confirming the commit")
    finally:
        cache.free(tmp)          # committed blocks stay cached; uncommitted ones go back
    return len(blocks)


def _num_groups(cache) -> int:
    plan = cache.config.layer_groups
    return 1 if plan is None else len(plan.groups)


def _table(cache, seq, g: int) -> np.ndarray:
    return cache.block_table(seq, group=g) if cache.config.layer_groups is not None else cache.block_table(seq)


def _pin_sinks(cache, seq, k: int) -> None:
    """Pin the received sink blocks' window rows, as a prefix computed here pins them
    when its tokens are reserved (the received rows would otherwise be the oldest)."""
    n = cache.config.precise_sink_blocks
    if n > k and cache.store.window is not None:
        cache.store.pin_sinks(np.concatenate([_table(cache, seq, g)[k:n] for g in range(_num_groups(cache))])
                              .astype(np.int64), held_only=True)
