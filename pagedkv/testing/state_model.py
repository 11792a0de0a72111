"""A ground truth for caches with recurrent-state layers (the hypothesis state machine of
tests/state_machines.py, fuzz runs).

A state here is a function of the tokens it covers (:func:`state_of`): a test that
writes ``state_of(tokens[:n])`` after computing ``n`` tokens can check, at any moment,
that every sequence's state, a prefix hit's state included, is the state of exactly
its tokens. A snapshot of another prefix, a rollback that resumed at the wrong place or
a copy-on-write that wrote a shared state reads back as a different value.

:class:`StateOracle` predicts the snapshots the checkpoint rule takes and the longest
prefix an admission resumes from, for runs where nothing was evicted.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["state_value", "state_of", "StateOracle"]

_MOD = 1 << 20      # values stay exact in float32 (below 2**24)


def state_value(tokens: Sequence[int]) -> float:
    """A number that depends on every token and its position (0.0 for no token)."""
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + (int(t) + 1) * (i + 7)) % _MOD
    return float(h + 1) if len(tokens) else 0.0


def state_of(spec, tokens_per_row: Sequence[Sequence[int]], layer: int = 0) -> dict:
    """States ``name -> [B, *shape]`` (float32) of rows of tokens, as a test writes them:
    each tensor filled with :func:`state_value`, negated for every other tensor, plus
    the layer index."""
    import torch

    out = {}
    for i, t in enumerate(spec.tensors):
        sign = -1.0 if i % 2 else 1.0
        vals = [sign * state_value(row) + layer for row in tokens_per_row]
        out[t.name] = torch.tensor(vals, dtype=torch.float32).reshape(-1, *([1] * len(t.shape))).expand(
            -1, *t.shape).contiguous()
    return out


class _Seq:
    __slots__ = ("tokens", "pos", "ns", "junction")

    def __init__(self, tokens: list[int], pos: int, ns: object, junction: int):
        self.tokens = tokens      # known token ids (prompt, then what the test fed)
        self.pos = pos            # committed
        self.ns = ns
        self.junction = junction


class StateOracle:
    """What a cache with recurrent-state layers should hold, in a run without eviction.

    Args:
        block_size: the cache's block size.
        every: ``state_checkpoint_every`` (blocks).
    """

    def __init__(self, block_size: int, every: int):
        self.bs = block_size
        self.every = every * block_size
        self.seqs: dict[object, _Seq] = {}
        self.registered: set[tuple] = set()     # (ns, prefix) of every committed full block
        self.snapshots: set[tuple] = set()      # (ns, prefix) the checkpoint rule filed

    def expected_hit(self, tokens: Sequence[int], ns: object, cap: int | None = None) -> tuple[int, int]:
        """``(tokens an admission resumes from, tokens of the attention chain)``."""
        top = (len(tokens) - 1) // self.bs
        if cap is not None:
            top = min(top, cap // self.bs)
        chain = 0
        while chain < top and (ns, tuple(tokens[:(chain + 1) * self.bs])) in self.registered:
            chain += 1
        hit = 0
        for k in range(chain, 0, -1):
            if (ns, tuple(tokens[:k * self.bs])) in self.snapshots:
                hit = k
                break
        return hit * self.bs, chain * self.bs

    def add(self, sid, tokens: Sequence[int], ns: object, hit: int, chain: int) -> None:
        self.seqs[sid] = _Seq(list(tokens), hit, ns, chain if chain > hit else 0)

    def commit(self, sid, n: int, prefill: bool = True) -> None:
        """``n`` more of the sequence's known tokens (``seqs[sid].tokens``) are computed;
        ``prefill``: they were known before the step (a prompt chunk), not decoded."""
        s = self.seqs[sid]
        old = s.pos
        s.pos += n
        for b in range(old // self.bs + 1, s.pos // self.bs + 1):
            self.registered.add((s.ns, tuple(s.tokens[:b * self.bs])))
        p = s.pos
        if n and p % self.bs == 0 and (prefill or p % self.every == 0 or p == s.junction):
            self.snapshots.add((s.ns, tuple(s.tokens[:p])))

    def rewound(self, sid, pos: int, tokens: Sequence[int]) -> None:
        """A rollback left the sequence at ``pos`` committed tokens, ``tokens`` known."""
        s = self.seqs[sid]
        s.pos = pos
        s.tokens = list(tokens)

    def fork(self, src, dst, tokens: Sequence[int]) -> None:
        """``dst`` forked from ``src``, knowing ``tokens`` (a fork inherits the committed ones)."""
        s = self.seqs[src]
        self.seqs[dst] = _Seq(list(tokens), s.pos, s.ns, s.junction)

    def free(self, sid) -> None:
        del self.seqs[sid]

    def state_tokens(self, sid) -> list[int]:
        s = self.seqs[sid]
        return s.tokens[:s.pos]
