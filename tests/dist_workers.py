"""Rank programs for the multi-process tests (gloo on 127.0.0.1).

Run as ``python dist_workers.py SCENARIO RANK PORT OUTDIR``; each rank writes
``OUTDIR/rank<RANK>.json`` with what it observed (the test asserts on it), or the
traceback of what went wrong.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tier_helpers import assert_clean, assert_kv, expected_kv, fill, make  # noqa: E402

import pagedkv.distributed as pd  # noqa: E402
from pagedkv import CacheConfig, PagedKVCache  # noqa: E402
from pagedkv.errors import PagedKVError, TransferError  # noqa: E402

TIMEOUT = 30.0
# quantized handoffs: per-token scales; int4 with its recent window (head_dim 8, a window
# of 6 tokens over blocks of 4), whose model-precision rows travel with the codes; int4
# block keys, whose per-channel parameters travel as an arena
QUANTIZED_HANDOFFS = [("int8", {}), ("fp8_e4m3", {}), ("int4", dict(head_dim=8, kv_window=6)),
                      ("int4", dict(head_dim=8, kv_window=0, kv_key_quant="block")),
                      # one sequence's window: the first block keeps its sink rows only by its pin
                      ("int4", dict(head_dim=8, kv_window=4, kv_window_sequences=1))]


def tokens(start, n):
    return np.arange(start, start + n, dtype=np.int32)


def expect_error(fn, kind=TransferError):
    try:
        fn()
    except kind as e:
        return str(e)
    raise AssertionError(f"expected {kind.__name__}")


def reference_kv(toks, **cfg):
    ref = make(num_blocks=32, **cfg)
    fill(ref, "r", toks)
    out = [ref.gather("r", layer) for layer in range(ref.config.num_layers)]
    ref.free("r")
    return out


# ---- scenarios --------------------------------------------------------------------------------
def handoff(rank, out):
    req = tokens(100, 21)                      # 5 full blocks + 1 token
    cache = make(num_blocks=32)
    if rank == 0:
        fill(cache, "req", req)
        out["sent_full"] = pd.send_sequence(cache, "req", 1, metadata={"next_token": 5}, timeout=TIMEOUT)
        out["sent_partly_cached"] = pd.send_sequence(cache, "req", 1, timeout=TIMEOUT)
        cache.free("req")
        for kv_dtype, extra in QUANTIZED_HANDOFFS:
            q = make(num_blocks=32, kv_dtype=kv_dtype, **extra)
            fill(q, "req", req)
            pd.send_sequence(q, "req", 1, timeout=TIMEOUT)
            q.free("req")
            assert_clean(q)
        sys_prompt = tokens(500, 17)
        fill(cache, "sys", sys_prompt)
        cache.free("sys")
        out["prefix_sent"] = [pd.send_prefix(cache, sys_prompt, 1, timeout=TIMEOUT) for _ in range(2)]
        fill(cache, "req", req)
        out["refused"] = [expect_error(lambda: pd.send_sequence(cache, "req", 1, timeout=TIMEOUT))
                          for _ in range(3)]
        out["abort"] = expect_error(lambda: pd.send_sequence(cache, "missing", 1, timeout=TIMEOUT), PagedKVError)
        cache.free("req")
        assert_clean(cache)
    else:
        got = pd.recv_sequence(cache, 0, timeout=TIMEOUT)
        out["first"] = [got.seq_id, got.num_tokens, got.cached_tokens, got.metadata]
        assert_kv(cache, "req", req)
        out["registered_tokens"] = cache.match_prefix(req)
        cache.check_invariants()
        cache.advance(["req"], np.array([5], dtype=np.int32))   # decode continues here
        out["decode_reserved"] = cache.num_reserved("req")
        cache.free("req")
        cache.reset_prefix_cache()
        fill(cache, "pre", req[:9])                          # this side caches the first 2 blocks
        cache.free("pre")
        got = pd.recv_sequence(cache, 0, seq_id="again", timeout=TIMEOUT)
        out["second"] = [got.seq_id, got.num_tokens, got.cached_tokens, got.metadata]
        assert_kv(cache, "again", req)
        cache.free("again")
        for kv_dtype, extra in QUANTIZED_HANDOFFS:
            q = make(num_blocks=32, kv_dtype=kv_dtype, **extra)
            pd.recv_sequence(q, 0, timeout=TIMEOUT)
            want = reference_kv(req, kv_dtype=kv_dtype, **extra)
            name = kv_dtype + ("_window" if extra.get("kv_window") else "") + (
                "_block_keys" if extra.get("kv_key_quant") == "block" else "") + (
                "_one_sequence" if extra.get("kv_window_sequences") == 1 else "")
            out[f"{name}_exact"] = all(torch.equal(q.gather("req", layer)[0], k) and
                                       torch.equal(q.gather("req", layer)[1], v)
                                       for layer, (k, v) in enumerate(want))
            exact = reference_kv(req, **{k: v for k, v in extra.items() if k == "head_dim"})
            out[f"{name}_sink_exact"] = all(torch.equal(q.gather("req", layer)[0][:4], k[:4])
                                            for layer, (k, _) in enumerate(exact))
            if extra.get("kv_window_sequences") == 1:   # decoding goes on: only the pin keeps the sink
                more = tokens(100, 33)
                slots = q.reserve("req", 12)
                for layer in range(q.config.num_layers):
                    k, v = expected_kv(more, layer, q.config.kv_heads_per_rank, q.config.head_dim)
                    q.write(layer, slots, k[21:], v[21:])
                q.commit("req", 12)
                out[f"{name}_sink_kept"] = all(
                    torch.equal(q.gather("req", layer)[0][:4],
                                expected_kv(more, layer, q.config.kv_heads_per_rank, q.config.head_dim)[0][:4])
                    for layer in range(q.config.num_layers))
            if extra.get("kv_window"):   # the window rows made it: not what the codes alone give
                codes_only = reference_kv(req, kv_dtype=kv_dtype, **dict(extra, kv_window=0))
                out[f"{name}_differs_from_codes"] = any(not torch.equal(q.gather("req", layer)[0], k)
                                                        for layer, (k, _) in enumerate(codes_only))
            q.free("req")
            assert_clean(q)
        sys_prompt = tokens(500, 17)
        out["prefix_received"] = [pd.recv_prefix(cache, 0, timeout=TIMEOUT) for _ in range(2)]
        out["prefix_hit"] = fill(cache, "x", sys_prompt)
        assert_kv(cache, "x", sys_prompt)
        cache.free("x")
        before = cache.stats()
        wide = make(num_blocks=32, head_dim=8)
        small = make(num_blocks=2)
        out["refusals"] = [expect_error(lambda: pd.recv_sequence(c, 0, timeout=TIMEOUT)) for c in (wide, small)]
        fill(cache, "req", req[:5])                           # the id is live here
        out["refusals"].append(expect_error(lambda: pd.recv_sequence(cache, 0, timeout=TIMEOUT)))
        cache.free("req")
        out["abort"] = expect_error(lambda: pd.recv_sequence(cache, 0, timeout=TIMEOUT))
        for c in (wide, small, cache):
            assert_clean(c)
        out["cached_unchanged"] = cache.stats().cached_free_blocks >= before.cached_free_blocks


def killed(rank, out):
    """The sender dies after a few layers: the receiver must be left as it was."""
    req = tokens(100, 64)
    cache = make(num_blocks=64, num_layers=8)
    if rank == 0:
        fill(cache, "req", req)
        real = dist.isend
        calls = {"n": 0}

        def dying_isend(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 8:                # header (2), tokens (1), then a few KV layers
                os._exit(17)
            return real(*args, **kwargs)

        dist.isend = dying_isend
        pd.send_sequence(cache, "req", 1, timeout=TIMEOUT)
        raise AssertionError("the sender should have died")
    fill(cache, "warm", req[:16])                             # a prefix this side already caches
    cache.free("warm")
    cached_before = sorted(cache.index.cached_blocks().tolist())
    out["error"] = expect_error(lambda: pd.recv_sequence(cache, 0, timeout=TIMEOUT))
    assert_clean(cache)
    out["cached_unchanged"] = sorted(cache.index.cached_blocks().tolist()) == cached_before
    out["live"] = cache.sequences()
    out["hit_after"] = fill(cache, "later", req)              # still serves; its own KV is right
    assert_kv(cache, "later", req)
    cache.free("later")
    assert_clean(cache)


def receiver_killed(rank, out):
    """The receiver dies after a few layers: the sender's cache must be left as it was
    (its sequence live with intact KV, the transfer's private fork gone), and a later
    transfer to the dead peer fails the same way."""
    req = tokens(100, 64)
    cache = make(num_blocks=64, num_layers=8)
    if rank == 1:
        real = dist.irecv
        calls = {"n": 0}

        def dying_irecv(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 6:                # header (2), tokens (1), then a few KV layers
                os._exit(18)
            return real(*args, **kwargs)

        dist.irecv = dying_irecv
        pd.recv_sequence(cache, 0, timeout=TIMEOUT)
        raise AssertionError("the receiver should have died")
    fill(cache, "req", req)
    fill(cache, "sys", req[:32])
    cache.free("sys")
    cached_before = sorted(cache.index.cached_blocks().tolist())
    out["error"] = expect_error(lambda: pd.send_sequence(cache, "req", 1, timeout=10.0))
    cache.check_invariants()
    out["live"] = cache.sequences()
    out["num_tokens"] = cache.num_tokens("req")
    assert_kv(cache, "req", req)
    out["prefix_error"] = expect_error(lambda: pd.send_prefix(cache, req[:32], 1, timeout=10.0))
    cache.check_invariants()
    out["live_after_prefix"] = cache.sequences()
    cache.free("req")
    assert_clean(cache)
    out["cached_unchanged"] = sorted(cache.index.cached_blocks().tolist()) == cached_before


def timeout(rank, out):
    """The sender goes silent mid-transfer: the receiver gives up after its timeout."""
    req = tokens(100, 32)
    cache = make(num_blocks=32)
    if rank == 0:
        fill(cache, "req", req)
        from pagedkv.transfer import wire

        wire.Link.send_blocks = lambda self, arenas, blocks: time.sleep(4)
        out["error"] = expect_error(lambda: pd.send_sequence(cache, "req", 1, timeout=TIMEOUT))  # its peer gave up
        cache.free("req")
        assert_clean(cache)
        return
    out["error"] = expect_error(lambda: pd.recv_sequence(cache, 0, timeout=1.0))
    assert_clean(cache)
    out["cached_blocks"] = int(cache.index.num_cached)


def _tp_ops(cache, record):
    """One op sequence with prefix hits, forks, evictions and frees; block tables and
    hits recorded after each step."""
    cfg = cache.config
    heads, dim = cfg.num_kv_heads, cfg.head_dim
    picked = list(cfg.kv_head_indices)

    def fill_sharded(sid, toks):
        hit = cache.add_sequence(sid, toks)
        n = len(toks) - hit
        slots = cache.reserve(sid, n)
        for layer in range(cfg.num_layers):
            k, v = expected_kv(toks, layer, heads, dim)          # the model's heads ...
            cache.write(layer, slots, k[hit:, picked].contiguous(), v[hit:, picked].contiguous())  # ... this rank's
        cache.commit(sid, n)
        record.append(["fill", sid, hit, cache.block_table(sid).tolist()])

    shared = tokens(300, 12)
    fill_sharded("a", np.concatenate([shared, tokens(10, 7)]))
    fill_sharded("b", np.concatenate([shared, tokens(40, 9)]))
    cache.fork("b", "c")
    cache.reserve("c", 3)
    record.append(["fork", cache.block_table("c").tolist()])
    cache.free(["a", "c"])
    for i in range(3):                                         # pressure: evictions
        fill_sharded(f"p{i}", tokens(1000 + 40 * i, 21))
        cache.free(f"p{i}")
    fill_sharded("d", np.concatenate([shared, tokens(10, 7)]))
    record.append(["cached", sorted(cache.index.cached_blocks().tolist()), cache.stats().hit_tokens])
    return ["b", "d"]


def tp(rank, out):
    for heads in (2, 1):                                       # split, then replicated heads
        cfg = dict(num_layers=2, num_kv_heads=heads, head_dim=4, block_size=4, dtype="float32",
                   num_blocks=14, hash_seed=7)
        cache = PagedKVCache(CacheConfig(**cfg, tp_size=2, tp_rank=rank))
        record = []
        live = _tp_ops(cache, record)
        shards = {sid: [cache.gather(sid, layer) for layer in range(2)] for sid in live}
        everything = [None, None]
        dist.all_gather_object(everything, (record, list(cache.config.kv_head_indices), shards))
        if rank == 0:
            out[f"heads{heads}_same_bookkeeping"] = everything[0][0] == everything[1][0]
            out[f"heads{heads}_indices"] = [everything[0][1], everything[1][1]]
            full = PagedKVCache(CacheConfig(**cfg))
            full_record = []
            _tp_ops(full, full_record)
            out[f"heads{heads}_same_as_unsharded"] = full_record == record
            exact = True
            for sid in live:
                for layer in range(2):
                    k, v = full.gather(sid, layer)
                    got = {}
                    for rec_, idx, sh in everything:
                        for j, hidx in enumerate(idx):
                            got[hidx] = (sh[sid][layer][0][:, j], sh[sid][layer][1][:, j])
                    cat_k = torch.stack([got[h][0] for h in range(heads)], dim=1)
                    cat_v = torch.stack([got[h][1] for h in range(heads)], dim=1)
                    exact &= torch.equal(cat_k, k) and torch.equal(cat_v, v)
            out[f"heads{heads}_concat_equals_unsharded"] = exact
            full.free(live)
            assert_clean(full)
        cache.free(live)
        assert_clean(cache)


def smollm2(rank, out):
    """Prefill on rank 0, decode on rank 1: greedy tokens as in one process."""
    from model_fixtures import chat_ids
    from pagedkv.integrations.transformers import PagedCache

    try:
        from pagedkv.testing.models import load_smollm2
    except ImportError:
        from pagedkv.models import load_smollm2
    model, tok = load_smollm2()
    ids = torch.tensor([chat_ids(tok, "Name three prime numbers.")])
    kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=64, dtype="float32", block_size=16))
    steps = 12

    @torch.no_grad()
    def decode(first, n):
        out_tokens = [first]
        pc = PagedCache(kv)
        for _ in range(n):
            mask, pos = pc.select(["req"], 1)
            nxt = torch.tensor([[out_tokens[-1]]])
            pc.set_input_ids(nxt)
            logits = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=pc, use_cache=True).logits
            out_tokens.append(int(logits[0, -1].argmax()))
        return out_tokens

    if rank == 0:
        kv.add_sequence("req", ids[0])                          # the engine owns the request
        with torch.no_grad():
            pc = PagedCache(kv)
            mask, pos = pc.select(["req"], ids.shape[1])        # prefill: the whole prompt
            pc.set_input_ids(ids)
            logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=pc, use_cache=True).logits
            first = int(logits[0, -1].argmax())
        out["blocks_sent"] = pd.send_sequence(kv, "req", 1, metadata={"first_token": first}, timeout=120)
        out["local"] = decode(first, steps)                    # the one-process reference
        kv.free("req")
    else:
        got = pd.recv_sequence(kv, 0, timeout=120)
        out["remote"] = decode(got.metadata["first_token"], steps)
        out["prompt_tokens"] = got.num_tokens
        kv.free("req")
    assert_clean(kv)


SCENARIOS = {"handoff": handoff, "killed": killed, "receiver_killed": receiver_killed, "timeout": timeout, "tp": tp, "smollm2": smollm2}


def main():
    scenario, rank, port, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        SCENARIOS[scenario](rank, out)
        out["ok"] = True
    except BaseException:
        out["ok"] = False
        out["traceback"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)    # no barrier at exit: a peer may be gone on purpose


if __name__ == "__main__":
    main()
