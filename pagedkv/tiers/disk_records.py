"""Checking a disk tier's slot records: all of them (a first open), or just the slots
another process changed since this one last looked (its journal's entries).

Both drop, as a miss, every record that cannot be trusted and keep the rest: a bad
valid flag, a record or (``verify_blocks``) block whose CRC-32 disagrees, a hash that
disagrees with its tokens or repeats another's (corruption, or a write torn by a
crash), and what an interrupted writer can leave (a record whose parent slot was
emptied or whose namespace never reached namespaces.json). A dropped record's
descendants go with it (their chain is broken): a damaged record costs that record,
never the tier, and is never served.
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np

from pagedkv.tiers.chain import ROOT, ROOT_HASH, chain_hash

__all__ = ["check_all", "check_changed"]


def _record_ok(tier, s: int) -> bool:
    return zlib.crc32(tier._raw_records[s, :tier._checked_bytes]) == int(tier.records["rec_crc"][s])


def check_all(tier, verify_blocks: bool = True) -> None:
    """Every record of ``tier`` (a :class:`~pagedkv.tiers.disk.DiskPrefixTier` whose
    ``records`` were just read): counted in ``num_corrupt_dropped`` and
    ``num_orphans_dropped``, and warned about."""
    r = tier.records
    raw_valid = np.array(r["valid"])
    bad = set(np.flatnonzero(~np.isin(raw_valid, (0, 1))).tolist())
    valid = np.where(np.isin(raw_valid, (0, 1)), raw_valid, 0)
    n = len(r)
    parent, pgen, gen = np.array(r["parent"]), np.array(r["parent_gen"]), np.array(r["gen"])
    ns, stored = np.array(r["ns"]), np.array(r["hash"])
    held = np.flatnonzero(valid == 1).tolist()
    kids: dict[int, list[int]] = {}
    for s in held:
        if not _record_ok(tier, s) or (verify_blocks and not tier.verify(s)):
            bad.add(s)
            continue
        p = int(parent[s])
        if (p == ROOT or (0 <= p < n and valid[p] == 1 and gen[p] == pgen[s])) and 0 <= ns[s] < len(tier.ns_keys):
            kids.setdefault(p, []).append(s)
    # Recompute every hash from the root down (parents first): a record that decodes
    # but lies about its content is dropped too, with its subtree.
    hashes, owner = {ROOT: ROOT_HASH}, {}
    frontier = kids.get(ROOT, [])
    while frontier:
        nxt: list[int] = []
        for s in frontier:
            h = chain_hash(hashes[int(parent[s])], tier.ns_hashes[int(ns[s])], np.asarray(r["tokens"][s]),
                           tier.weak_hash)
            if h != int(stored[s]) or h in owner:
                bad.add(s)
                continue
            hashes[s], owner[h] = h, s
            nxt.extend(kids.get(s, ()))
        frontier = nxt
    kept = set(owner.values())
    dropped = sorted(bad | (set(held) - kept))
    if dropped:
        tier.journal.append(dropped)
    for s in dropped:
        r["valid"][s] = 0
        r["gen"][s] += 1
        tier._store_record(s)
    tier.num_corrupt_dropped = len(bad)
    tier.num_orphans_dropped = len(dropped) - len(bad)
    if bad:
        warnings.warn(f"pagedkv: {tier.dir.file('index.bin')}: dropped {len(bad)} damaged record(s) and "
                      f"{tier.num_orphans_dropped} record(s) below them (a miss each, never served)",
                      RuntimeWarning, stacklevel=4)
    # hits and stamp are outside the CRC and only order eviction: renumber the stamps
    # (any stored value, 2**64-1 included, becomes a rank) so the clock cannot overflow.
    live = np.flatnonzero(r["valid"] == 1)
    order = live[np.argsort(np.array(r["stamp"][live]), kind="stable")]
    r["stamp"][:] = 0
    r["stamp"][order] = np.arange(1, len(live) + 1)


def check_changed(tier, slots: np.ndarray) -> bool:
    """Take another process's changes to ``slots`` into ``tier``'s index: forget their
    old occupants, read their records, check each (CRC, namespace, link, hash) parents
    first, and drop what fails (persisted: the lock is held). Costs what changed, not
    the directory. False: the changes reach past ``slots`` (a crash left an occupant's
    children unjournaled); the caller checks everything instead."""
    index, r = tier.index, tier.records
    slots = np.unique(slots[(slots >= 0) & (slots < len(r))])
    if not len(slots):
        return True
    if (index.busy[slots] != 0).any():
        return False
    _report_lost(tier, slots)
    if not index.forget(slots.tolist()):
        return False
    r[slots] = tier._disk[slots]
    todo = []
    for s in slots.tolist():
        v = int(r["valid"][s])
        if v == 1 and _record_ok(tier, s) and 0 <= int(r["ns"][s]) < len(tier.ns_keys):
            r["valid"][s] = 0            # adopted below, once its parent is in
            todo.append(s)
        elif v != 0:                     # a damaged record: dropped, persisted
            _drop(tier, s)
    while todo:                          # parents first: adopt what links to what is in
        left = []
        waiting = set(todo)
        for s in todo:
            p = int(r["parent"][s])
            if p != ROOT and p in waiting:
                left.append(s)
                continue
            if not index.adopt(s, tier.ns_hashes[int(r["ns"][s])]):
                _drop(tier, s)
        if len(left) == len(todo):
            for s in left:
                _drop(tier, s)
            break
        todo = left
    live = r["valid"][slots] == 1
    if live.any():                       # newest in eviction order: another process just used them
        for s in slots[live].tolist():
            index.touch(s)
    return True


def _report_lost(tier, slots: np.ndarray) -> None:
    """Tell ``tier.on_lost`` which of ``slots`` another process emptied or gave to
    another block (a slot it only touched keeps its block), before they are forgotten."""
    if tier.on_lost is None:
        return
    r, d = tier.records, tier._disk
    lost = slots[(r["valid"][slots] == 1) & ((d["valid"][slots] != 1) | (d["gen"][slots] != r["gen"][slots])
                                             | (d["hash"][slots] != r["hash"][slots]))]
    if len(lost):
        tier.on_lost(lost.tolist())


def _drop(tier, s: int) -> None:
    r = tier.records
    tier.journal.append([s])
    r["valid"][s] = 0
    r["gen"][s] += 1
    tier._store_record(s)
