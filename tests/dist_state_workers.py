"""Rank programs for the recurrent-state transfers (registered in dist_workers.SCENARIOS):
prefill on rank 0, decode on rank 1, the state crossing with the KV."""
from __future__ import annotations

import torch
from tier_helpers import expected_kv

import pagedkv.transfer.distributed as pd
from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError, TransferError
from pagedkv.testing.state_model import state_of

TIMEOUT = 30.0
BS = 4
A = list(range(1, 11))
B = A[:8] + [40, 41, 42]


def _cache():
    return PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=16,
                                    dtype="float32", layer_kinds=("state", "attention", "state"),
                                    state_tensors=[("conv", (3, 4)), ("ssm", (2, 2, 2))], state_slots=8,
                                    state_checkpoint_every=2))


def _step(kv, sid, tokens, n):
    pos = kv.num_tokens(sid)
    slots = kv.reserve(sid, n)
    k, v = expected_kv(tokens[:pos + n], 0, 1, 4)
    kv.write(0, slots, k[pos:], v[pos:])
    for layer in range(2):
        kv.write_state(sid, layer, state_of(kv.config.state_spec, [tokens[:pos + n]], layer))
    kv.commit(sid, n)


def _kv_exact(kv, sid, tokens) -> bool:
    k, v = kv.gather(sid, 0)
    ek, ev = expected_kv(tokens, 0, 1, 4)
    return torch.equal(k, ek) and torch.equal(v, ev)


def _is_state(kv, sid, tokens) -> bool:
    for layer in range(2):
        got = kv.read_state(sid, layer)
        want = state_of(kv.config.state_spec, [tokens], layer)
        if not all(torch.equal(got[n], want[n]) for n in got):
            return False
    return True


def states(rank, out):
    kv = _cache()
    if rank == 0:
        w = list(range(90, 100))
        kv.add_sequence("w", w)           # a state written past its commit is not sent: the receiver is told
        _step(kv, "w", w, 4)
        kv.reserve("w", 2)
        kv.write_state("w", 0, state_of(kv.config.state_spec, [w[:6]], 0))
        try:
            pd.send_sequence(kv, "w", 1, timeout=TIMEOUT)
        except InvalidArgumentError as e:
            out["refused"] = str(e)
        kv.unreserve("w")
        kv.free("w")
        out["left"] = len(kv)
        kv.add_sequence("req", A)
        for n in (3, 7):                 # chunks off the grid: the only snapshots are periodic (8)
            _step(kv, "req", A, n)
        out["sent"] = pd.send_sequence(kv, "req", 1, timeout=TIMEOUT)
        kv.add_sequence("p", B)
        _step(kv, "p", B, 8)
        _step(kv, "p", B, 3)
        kv.free("p")
        out["prefix_sent"] = pd.send_prefix(kv, B, 1, timeout=TIMEOUT)
        kv.free("req")
        kv.check_invariants()
        return
    try:
        pd.recv_sequence(kv, 0, timeout=TIMEOUT)
    except TransferError as e:
        out["aborted"] = str(e)
    out["left"] = len(kv)
    got = pd.recv_sequence(kv, 0, timeout=TIMEOUT)
    out["received"] = [got.seq_id, got.num_tokens, got.cached_tokens]
    out["state_exact"] = _is_state(kv, "req", A)
    out["kv_exact"] = _kv_exact(kv, "req", A)
    _step(kv, "req", A + [9], 1)                       # decode here
    out["decoded_state_exact"] = _is_state(kv, "req", (A + [9])[:11])
    out["prefix_received"] = pd.recv_prefix(kv, 0, timeout=TIMEOUT)
    out["prefix_hit"] = kv.add_sequence("b", B[:8] + [50])
    out["prefix_state_exact"] = _is_state(kv, "b", B[:8])
    out["prefix_kv_exact"] = _kv_exact(kv, "b", B[:8])
    kv.free(["req", "b"])
    kv.check_invariants()


STATE_SCENARIOS = {"states": states}
