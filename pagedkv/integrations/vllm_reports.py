"""The worker side's reports of its copies, and how the scheduler side settles them.

Each worker (one per tensor-parallel rank) reports, per step and arena, what it loaded
and saved (:class:`ArenaReport`, keyed by rank in :class:`PagedKVWorkerMetadata`); vLLM
aggregates the ranks' metadata into one. :func:`settle_reports` then commits a save, or
counts a load, only when every rank reported it: a rank that failed or did not report
makes the block a miss (its load failed on every rank).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from pagedkv.integrations.vllm_store import store_of_arena

__all__ = ["ArenaReport", "PagedKVWorkerMetadata", "settle_reports"]


@dataclass
class ArenaReport:
    arena: str = ""                                        # the arena's name
    step: int = 0                                          # the step whose metadata this reports on
    rank: int = 0                                          # the reporting worker's tensor-parallel rank
    opened: bool = False
    refused: str | None = None
    loaded: list[int] = field(default_factory=list)        # slots copied into vLLM blocks
    load_failed: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)         # slots written from vLLM blocks
    save_failed: list[int] = field(default_factory=list)

    def merge(self, o: ArenaReport) -> None:
        self.opened = self.opened or o.opened
        self.refused = self.refused or o.refused
        for k in ("loaded", "load_failed", "saved", "save_failed"):
            getattr(self, k).extend(getattr(o, k))


@dataclass
class PagedKVWorkerMetadata(KVConnectorWorkerMetadata):
    # "<arena>@<step>#<rank>" -> that step's report by that rank (vLLM aggregates the ranks')
    reports: dict[str, ArenaReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PagedKVWorkerMetadata):
            for name, r in other.reports.items():
                self.reports.setdefault(name, ArenaReport(arena=r.arena, step=r.step, rank=r.rank)).merge(r)
        return self


def _all_ranks(reports: list[ArenaReport], tp_size: int, ok: str, failed: str) -> tuple[list[int], list[int]]:
    """``(slots every rank reported in ok, the other slots any rank reported)``: under
    tensor parallelism a block is whole only when every rank copied its shard. Counted
    with multiplicity: two loads of one slot in a step hold two leases."""
    per_rank: dict[int, Counter] = {}
    seen: Counter = Counter()
    for r in reports:
        good = Counter(getattr(r, ok))
        per_rank[r.rank] = good
        seen |= good + Counter(getattr(r, failed))     # a rank reports each copy once, ok or failed
    whole: Counter = Counter()
    if set(per_rank) == set(range(tp_size)):
        whole = per_rank[0]
        for c in per_rank.values():
            whole &= c
    return sorted(whole.elements()), sorted((seen - whole).elements())


def settle_reports(meta: PagedKVWorkerMetadata) -> None:
    """The scheduler side's part of a step's output: every rank's reports (vLLM aggregated
    them) settle what each step sent, per store (see the module on tensor parallelism)."""
    steps: dict[tuple[str, int], list[ArenaReport]] = {}    # every rank's report of one step
    for r in meta.reports.values():
        steps.setdefault((r.arena, r.step), []).append(r)
    for (name, step), reports in steps.items():
        s = store_of_arena(name)
        if s is None:
            continue
        refused = next((r for r in reports if r.refused), None)
        if refused is not None:
            s.refuse(f"the worker of rank {refused.rank} refused arena {name}: {refused.refused}")
        else:
            opened = {r.rank for r in reports if r.opened}
            s.opened_ranks |= opened
            if opened and s.opened_ranks >= set(range(s.tp_size)):
                s.worker_ready = True
                s.arena.unlink()               # every side holds it mapped: a crash leaves nothing
        # each settles only what step `step` sent (a report that comes after its step
        # expired, or names slots that step did not send, changes nothing)
        loaded, load_failed = _all_ranks(reports, s.tp_size, "loaded", "load_failed")
        saved, save_failed = _all_ranks(reports, s.tp_size, "saved", "save_failed")
        if loaded:
            s.loaded(loaded, ok=True, step=step)
        if load_failed:
            s.loaded(load_failed, ok=False, step=step)
        if saved:
            s.committed(saved, step=step)
        if save_failed:
            s.abandon(save_failed, step=step)
