"""Continuous batching over a :class:`~pagedkv.manager.cache.PagedKVCache`: which requests
run in each engine step (as vLLM's scheduler plans them).

Each :meth:`ContinuousBatcher.schedule` plans one engine step of at most
``token_budget`` tokens: one token for every decoding request first, then prefill
chunks, the prompts already started first, then new admissions in arrival order. A
prompt longer than what the budget leaves is prefilled in chunks over several steps
(a partial chunk ends on a block boundary where it can), so a long prompt never makes
the decoding requests, or the requests behind it, wait for all of it: a request's
first token waits only for its own prompt's chunks. With ``token_budget=None`` every
admitted prompt is prefilled whole in the step that admits it.

**Prefixes shared within a step.** Requests that arrive together often share a prefix
(a system prompt) that the cache does not hold yet: admitted together, each would
compute it. Here the first one admitted computes it (the *leader*); a later one whose
prompt shares full blocks with a leader's prompt beyond what the cache already holds,
and whose leader has not computed those blocks yet, is *attached*: it holds a batch
slot and no blocks, and waits. When the leader's chunk commits, the blocks become
verified prefix hits through the cache's index, and the attached request is admitted
with ``add_sequence``, which hits them. So the pending state lives here, in the plan,
and never in the cache: a request only ever reads KV that a commit registered and the
index verified (tokens, chain and namespace), and the core's invariants are untouched.
An attached request waits only while its leader is prefilling and still owes some of
the shared blocks; a leader that is cancelled or finishes leaves its committed blocks
in the prefix cache, and the next attached request takes over the rest (it hits what
was committed and computes what was not; those behind it attach to it).

The engine runs each step's forwards itself (one per group of :attr:`Step.prefill`,
one for :attr:`Step.decode`); the cache's committed token counts are the only record
of progress, read back at the next :meth:`ContinuousBatcher.schedule`.

Thread safety: every method takes the batcher's lock. :meth:`~ContinuousBatcher.cancel`
may be called from any thread and takes effect at the next :meth:`schedule`, never in
the middle of a step; the other calls belong to the engine's thread, between steps.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
    expected,
)
from pagedkv.manager.arguments import as_int, as_token_ids
from pagedkv.manager.cache import PagedKVCache

__all__ = ["PrefillWork", "Step", "ContinuousBatcher", "prefill_groups", "PREFILL_PADDING",
           "WAITING", "ATTACHED", "PREFILLING", "RUNNING"]

WAITING = "waiting"          # submitted, not admitted: holds no blocks
ATTACHED = "attached"        # waiting for a leader to compute the prefix it shares: a batch slot, no blocks
PREFILLING = "prefilling"    # admitted: a sequence of the cache, prompt not yet computed
RUNNING = "running"          # prompt computed: decodes one token per step

#: a prefill group grows while its padded rectangle (rows x longest chunk) stays within
#: this many times its real tokens
PREFILL_PADDING = 1.25


@dataclass(frozen=True)
class PrefillWork:
    """One request's prefill chunk in a step: prompt positions ``[start, start + num_tokens)``.

    ``start`` is the request's committed tokens (a prefix hit included), so the chunk's
    forward reads positions ``[0, start)`` from the cache. ``last``: the chunk ends the
    prompt, so its last position's logits give the request's first token.
    """

    request_id: Hashable
    start: int
    num_tokens: int
    prompt_len: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def last(self) -> bool:
        return self.end == self.prompt_len


@dataclass(frozen=True)
class Step:
    """One engine step's plan (see :meth:`ContinuousBatcher.schedule`).

    Attributes:
        decode: ids of the requests that decode one token (in admission order).
        prefill: prefill chunks in groups; each group is one batched forward whose
            padded rectangle stays within :data:`PREFILL_PADDING` of its real tokens.
        admitted: ``(request id, prompt tokens found in the prefix cache)`` of the
            requests admitted by this call (each now a sequence of the cache).
        attached: request id -> the id of the leader whose prefill it waits for.
        cancelled: ids whose cancellation took effect in this call (their blocks freed).
    """

    decode: list
    prefill: list
    admitted: list
    attached: dict
    cancelled: list

    @property
    def prefill_tokens(self) -> int:
        return sum(w.num_tokens for group in self.prefill for w in group)

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes: one per decoding request plus the prefill chunks."""
        return len(self.decode) + self.prefill_tokens


class _Request:
    __slots__ = ("rid", "prompt", "max_new_tokens", "salt", "adapter", "state", "computed", "cached", "leader")

    def __init__(self, rid, prompt: np.ndarray, max_new_tokens: int, salt, adapter):
        self.rid = rid
        self.prompt = prompt               # int32 [n], read-only
        self.max_new_tokens = max_new_tokens
        self.salt, self.adapter = salt, adapter
        self.state = WAITING
        self.computed = 0                  # committed prompt tokens (PREFILLING), from the cache
        self.cached = 0                    # prompt tokens found in the prefix cache at admission
        self.leader = None                 # ATTACHED: the leader's id

    @property
    def total(self) -> int:
        """Tokens the request can hold at most: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_new_tokens


def prefill_groups(work: Iterable[PrefillWork], padding: float = PREFILL_PADDING) -> list[list[PrefillWork]]:
    """Prefill chunks in groups, each one batched forward over right-aligned rows.

    A batched forward takes every row's longest chunk, so one long chunk (a prompt that
    missed the prefix cache) next to several short ones (prompts that hit it) would cost
    the short ones the long one's length each. The chunks, longest first, are cut where
    the padded area would pass ``padding`` times the real one; chunks of similar length
    (the common case) take one forward."""
    order = sorted(work, key=lambda w: w.num_tokens, reverse=True)
    groups: list[list[PrefillWork]] = []
    real = 0
    for w in order:
        if groups and groups[-1][0].num_tokens * (len(groups[-1]) + 1) <= padding * (real + w.num_tokens):
            groups[-1].append(w)
            real += w.num_tokens
            continue
        groups.append([w])
        real = w.num_tokens
    return groups


def _shared_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class ContinuousBatcher:
    """Plans engine steps over a :class:`PagedKVCache` (see the module docstring).

    Args:
        kv: the paged cache the requests' sequences live in (a request's id is its
            sequence id there while it is admitted).
        max_batch: most requests admitted at once (prefilling, decoding or attached).
        token_budget: most tokens one step computes (decode tokens plus prefill chunks),
            greater than ``max_batch`` so that prefill always progresses; None: no
            budget, every admitted prompt is prefilled whole.
        share_prefixes: attach requests to a leader computing the prefix they share
            (needs ``enable_prefix_caching``; without it nothing is shared).
        padding: see :func:`prefill_groups`.

    Admission never over-commits: a request is admitted only while the free blocks
    cover its worst case (prompt plus ``max_new_tokens``, less its prefix hit) and the
    growth every admitted request may still need, so a step never runs out of blocks;
    the first request that does not fit waits (first come, first served). A request
    that cannot fit even alone raises :class:`~pagedkv.errors.OutOfBlocksError` from
    :meth:`schedule` (the request stays queued; cancel it to go on).

    The batcher owns the sequences of the requests it admits: the engine frees them
    through :meth:`finish`, :meth:`cancel` or :meth:`close`, never with ``kv.free``.
    """

    def __init__(self, kv: PagedKVCache, *, max_batch: int = 16, token_budget: int | None = 512,
                 share_prefixes: bool = True, padding: float = PREFILL_PADDING):
        if not isinstance(kv, PagedKVCache):
            raise InvalidArgumentError(expected("kv", "a PagedKVCache", type(kv).__name__))
        self.kv = kv
        self.max_batch = as_int(max_batch, "max_batch", 1)
        if token_budget is not None:
            token_budget = as_int(token_budget, "token_budget", 1)
            if token_budget <= self.max_batch:   # decode alone could fill every step: no prefill
                raise InvalidArgumentError(expected("token_budget", f"None or an int > max_batch ({self.max_batch})",
                                                    token_budget))
        self.token_budget = token_budget
        if share_prefixes is not True and share_prefixes is not False:
            raise InvalidArgumentError(expected("share_prefixes", "True or False", repr(share_prefixes)))
        self.share_prefixes = share_prefixes and kv.config.enable_prefix_caching
        if isinstance(padding, bool) or not isinstance(padding, (int, float)) or not padding >= 1:
            raise InvalidArgumentError(expected("padding", "a number >= 1", repr(padding)))
        self.padding = float(padding)
        self.block_size = kv.config.block_size
        self._lock = threading.RLock()
        self._requests: dict = {}          # id -> _Request, every request not finished
        self._waiting: list = []           # WAITING and ATTACHED, in arrival order
        self._prefilling: list = []        # in admission order
        self._running: list = []           # in admission order
        self._cancels: list = []           # ids whose cancel() waits for the next schedule()

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request_id: Hashable, prompt_token_ids: Iterable[int], max_new_tokens: int, *,
               cache_salt: str | None = None, adapter_id: Any = None) -> None:
        """Queue a request. ``max_new_tokens`` bounds what it may generate (its blocks are
        counted for that many at admission); ``cache_salt``/``adapter_id``: its
        prefix-cache namespace (requests share prefixes only within one)."""
        try:
            hash(request_id)
        except TypeError:
            raise InvalidArgumentError(expected("request_id", "a hashable id", type(request_id).__name__)) from None
        prompt = as_token_ids(prompt_token_ids, "prompt_token_ids").copy()
        if len(prompt) == 0:
            raise InvalidArgumentError(expected("prompt_token_ids", "at least one token", "an empty prompt"))
        prompt.flags.writeable = False
        max_new = as_int(max_new_tokens, "max_new_tokens", 1)
        with self._lock:
            if request_id in self._requests or request_id in self.kv:
                raise SequenceExistsError(request_id, "request_id")
            req = _Request(request_id, prompt, max_new, cache_salt, adapter_id)
            self._requests[request_id] = req
            self._waiting.append(req)

    def cancel(self, request_id: Hashable) -> None:
        """Drop a request at the next :meth:`schedule` (any thread may call this): its
        sequence is freed there (committed full blocks stay in the prefix cache), and
        requests attached to it re-plan (one takes over its prefill). A request that
        finishes first is not affected."""
        with self._lock:
            if request_id not in self._requests:
                raise SequenceNotFoundError(request_id, "request_id")
            self._cancels.append(request_id)

    def finish(self, request_id: Hashable) -> None:
        """The engine is done with a request (its last token, or an error of its own):
        its sequence is freed now (full blocks stay in the prefix cache). Call it
        between steps."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise SequenceNotFoundError(request_id, "request_id")
            self._drop(req)

    def close(self) -> None:
        """Free every admitted request's sequence and forget every request (an engine
        that stops, or fails, calls this)."""
        with self._lock:
            held = [r.rid for r in self._prefilling + self._running]
            self._requests.clear()
            self._waiting, self._prefilling, self._running, self._cancels = [], [], [], []
            if held:
                self.kv.free(held)

    def state(self, request_id: Hashable) -> str:
        """:data:`WAITING`, :data:`ATTACHED`, :data:`PREFILLING` or :data:`RUNNING` as of
        the last :meth:`schedule`."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise SequenceNotFoundError(request_id, "request_id")
            return req.state

    def leader(self, request_id: Hashable):
        """The id of the request an attached request waits for; None otherwise."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise SequenceNotFoundError(request_id, "request_id")
            return req.leader if req.state == ATTACHED else None

    def __len__(self) -> int:
        """Requests submitted and neither finished nor cancelled."""
        return len(self._requests)

    def _drop(self, req: _Request) -> None:
        del self._requests[req.rid]
        if req.state in (WAITING, ATTACHED):
            self._waiting.remove(req)
            return
        (self._prefilling if req.state == PREFILLING else self._running).remove(req)
        self.kv.free(req.rid)

    # ---- planning -----------------------------------------------------------------------
    def schedule(self) -> Step:
        """Plan the next step: apply the cancellations, read the prefill progress back
        from the cache, then fill the token budget (see the module docstring)."""
        with self._lock:
            cancelled = self._apply_cancels()
            self._refresh()
            budget = sys.maxsize if self.token_budget is None else self.token_budget
            decode = [r.rid for r in self._running]
            budget -= len(decode)
            work: list[PrefillWork] = []
            for req in self._prefilling:
                if budget <= 0:
                    break
                n = self._chunk(req, budget)
                work.append(PrefillWork(req.rid, req.computed, n, len(req.prompt)))
                budget -= n
            admitted, attached = self._admit(budget, work)
            return Step(decode, prefill_groups(work, self.padding), admitted, attached, cancelled)

    def _apply_cancels(self) -> list:
        done = []
        for rid in self._cancels:
            req = self._requests.get(rid)
            if req is not None:
                self._drop(req)
                done.append(rid)
        self._cancels = []
        return done

    def _refresh(self) -> None:
        """Prefill progress from the cache's committed counts: a computed prompt decodes."""
        if not self._prefilling:
            return
        lens = self.kv.seq_lens([r.rid for r in self._prefilling], computed=True)
        still = []
        for req, n in zip(self._prefilling, lens.tolist()):
            req.computed = int(n)
            if req.computed >= len(req.prompt):
                req.state = RUNNING
                self._running.append(req)
            else:
                still.append(req)
        self._prefilling = still

    def _chunk(self, req: _Request, budget: int) -> int:
        """The next chunk of ``req``'s prompt within ``budget``: what is left, or a
        partial chunk ending on a block boundary where one lies past its start (so each
        block is written by one chunk, and registered as a prefix when it commits)."""
        left = len(req.prompt) - req.computed
        if left <= budget:
            return left
        end = (req.computed + budget) // self.block_size * self.block_size
        return end - req.computed if end > req.computed else budget

    def _owed(self, req: _Request) -> int:
        """Blocks an admitted request may still allocate (to its worst case)."""
        have = len(self.kv.block_table(req.rid)) * self.block_size
        return max(0, self.kv.config.blocks_for_tokens(req.total) - have // self.block_size)

    def _admit(self, budget: int, work: list) -> tuple[list, dict]:
        admitted: list = []
        attached: dict = {}
        slots = len(self._running) + len(self._prefilling)
        owed = None              # computed on the first admission that needs it
        for req in list(self._waiting):
            if slots >= self.max_batch:
                break
            leader = self._leader_for(req) if self.share_prefixes else None
            if leader is not None:
                req.state, req.leader = ATTACHED, leader.rid
                attached[req.rid] = leader.rid
                slots += 1
                continue
            if budget <= 0:
                break
            need = self.kv.blocks_to_admit(req.prompt, req.total, cache_salt=req.salt, adapter_id=req.adapter)
            if owed is None:
                owed = sum(self._owed(r) for r in self._prefilling + self._running)
            if not self.kv.has_available_blocks(need + owed):
                if not (self._running or self._prefilling or attached):
                    raise OutOfBlocksError(need, self.kv.stats().free_blocks, f"request {req.rid!r}")
                break            # first come, first served: wait for blocks to be freed
            req.cached = req.computed = self.kv.add_sequence(req.rid, req.prompt, cache_salt=req.salt,
                                                             adapter_id=req.adapter)
            self._waiting.remove(req)
            req.state, req.leader = PREFILLING, None
            self._prefilling.append(req)
            owed += self._owed(req)
            admitted.append((req.rid, req.cached))
            slots += 1
            n = self._chunk(req, budget)
            work.append(PrefillWork(req.rid, req.computed, n, len(req.prompt)))
            budget -= n
        for req in self._waiting:            # not reached this step: plain waiting
            if req.rid not in attached:
                req.state, req.leader = WAITING, None
        return admitted, attached

    def _leader_for(self, req: _Request) -> _Request | None:
        """The prefilling request whose prompt shares the most full blocks with ``req``'s
        beyond what the cache holds now, when it has not computed them yet."""
        bs = self.block_size
        hit_cap = (len(req.prompt) - 1) // bs * bs      # the last prompt token is always computed
        if hit_cap == 0:
            return None
        best, best_shared = None, min(self.kv.match_prefix(req.prompt, cache_salt=req.salt,
                                                           adapter_id=req.adapter), hit_cap)
        for lead in self._prefilling:
            if lead.salt != req.salt or lead.adapter != req.adapter:
                continue
            shared = min(_shared_tokens(req.prompt, lead.prompt) // bs * bs, hit_cap)
            # Waiting pays only while the leader still owes part of the shared blocks:
            # once it has committed them, they are hits (or, if the index refused one,
            # computing them here is the only way forward).
            if shared > best_shared and lead.computed < shared:
                best, best_shared = lead, shared
        return best
