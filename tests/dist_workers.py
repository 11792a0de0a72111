"""Rank programs for the multi-process tests (gloo on 127.0.0.1).

Run as ``python dist_workers.py SCENARIO RANK PORT OUTDIR``; each rank writes
``OUTDIR/rank<RANK>.json`` with what it observed (the test asserts on it), or the
traceback of what went wrong.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
import zlib

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_state_workers import STATE_SCENARIOS  # noqa: E402
from tier_helpers import assert_clean, assert_kv, expected_kv, fill, make  # noqa: E402

import pagedkv.transfer.distributed as pd  # noqa: E402
from pagedkv import CacheConfig, PagedKVCache  # noqa: E402
from pagedkv.errors import PagedKVError, TransferError  # noqa: E402

TIMEOUT = 30.0
# quantized handoffs: per-token scales; int4 with its recent window (head_dim 8, a window
# of 6 tokens over blocks of 4), whose model-precision rows travel with the codes; int4
# block keys, whose per-channel parameters travel as an arena
QUANTIZED_HANDOFFS = [("int8", {}), ("fp8_e4m3", {}), ("int4", dict(head_dim=8, kv_window=6)),
                      ("int4", dict(head_dim=8, kv_window=0, kv_key_quant="block")),
                      # one sequence's window: the first block keeps its sink rows only by its pin
                      ("int4", dict(head_dim=8, kv_window=4, kv_window_sequences=1)),
                      # int2 (KIVI-2): float16 value params, 2-bit block keys, window and sinks
                      ("int2", dict(head_dim=8, kv_window=6))]


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


# ---- format pairs: every setting that changes a block's bytes, refused on both sides ----------
def _admit(cache, sid, toks):
    cfg = cache.config
    cache.add_sequence(sid, toks)
    slots = cache.reserve(sid, len(toks))
    heads = list(cfg.kv_head_indices)
    for layer in range(cfg.num_layers):
        k, v = expected_kv(toks, layer, cfg.num_kv_heads, cfg.head_dim)
        cache.write(layer, slots, k[:, heads].to(cfg.torch_dtype), v[:, heads].to(cfg.torch_dtype))
    cache.commit(sid, len(toks))


def formats(rank, out):
    from test_kv_fingerprint import FORMAT_PAIRS, config
    req = tokens(100, 17)
    for setting, a, b, _ in FORMAT_PAIRS:
        cache = PagedKVCache(config(**(a if rank == 0 else b)))
        if rank == 0:
            _admit(cache, "req", req)
            out[setting] = expect_error(lambda: pd.send_sequence(cache, "req", 1, timeout=TIMEOUT))
            out[setting + "/prefix"] = expect_error(lambda: pd.send_prefix(cache, req, 1, timeout=TIMEOUT))
            cache.free("req")
        else:
            out[setting] = expect_error(lambda: pd.recv_sequence(cache, 0, timeout=TIMEOUT))
            out[setting + "/prefix"] = expect_error(lambda: pd.recv_prefix(cache, 0, timeout=TIMEOUT))
            out[setting + "/hit"] = cache.match_prefix(req)
        assert_clean(cache)


# ---- hostile peers ------------------------------------------------------------------------------
# A hostile (or buggy, or version-skewed) peer speaks the wire protocol with one thing
# wrong; the honest side must raise TransferError and be left as it was.
def _send_raw(link, kind, payload: bytes, nbytes=None, check=None):
    from pagedkv.transfer import wire
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    n = len(payload) if nbytes is None else nbytes
    link.send_ints([wire.FRAME_MAGIC, kind, n, wire.checksum(t) if check is None and t is not None else (check or 0)],
                   "hostile frame")
    if t is not None:
        link.wait(link.send(t, "hostile payload"), "hostile payload")


def _sequence_header(cache, seq, num_tokens, computed):
    from pagedkv.transfer.protocol import header
    return header("sequence", cache, seq_id=seq, cache_salt=None, adapter_id=None, metadata=None, priority=None,
                  num_tokens=num_tokens, num_computed=computed)


@contextlib.contextmanager
def stale_memory(contents):
    """``torch.empty`` hands back memory that already holds ``contents[(dtype, numel)]``:
    what the allocator did when the two-rank hostile scenario failed (a buffer freed by an
    earlier conversation still held the honest bytes a lying frame announced)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        held = contents.get((t.dtype, t.numel()))
        if held is not None:
            t.view(-1).copy_(held)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def hostile_sender(cache, seq, case, kind="sequence"):
    """Send ``seq`` (or, for ``kind="prefix"``, its full blocks) to rank 1 with ``case``'s
    fault; returns the receiver's last reply (or the error this side saw)."""
    from pagedkv.transfer import wire
    from pagedkv.transfer.prefix import block_hashes
    from pagedkv.transfer.protocol import header
    link = wire.Link(1, None, TIMEOUT)
    bs = cache.config.block_size
    toks = cache.token_ids(seq)
    computed = cache.num_tokens(seq)
    if kind == "prefix":
        toks = toks[:computed // bs * bs]
        computed = len(toks)
        h = header(kind, cache, cache_salt=None, adapter_id=None, num_tokens=len(toks),
                   hashes=[str(x) for x in block_hashes(toks, bs)])
    else:
        h = _sequence_header(cache, seq, len(toks), computed)
    h.update(case.get("header", {}))
    for k in case.get("drop", ()):
        h.pop(k)
    link.send_hello()
    raw_header = case["raw_header"] if "raw_header" in case else json.dumps(h).encode()
    if "header_frame" in case:           # the frame announces the whole header; half of it follows
        _send_raw(link, wire.JSON, raw_header[:len(raw_header) // 2], nbytes=len(raw_header),
                  check=zlib.crc32(raw_header))
    else:
        _send_raw(link, wire.JSON, raw_header)
    sent = np.ascontiguousarray(case.get("tokens", toks), dtype=np.int32).tobytes()
    honest = np.ascontiguousarray(toks, dtype=np.int32).tobytes()
    if "token_frame" in case:            # the frame announces the honest size; fewer bytes follow
        _send_raw(link, wire.DATA, sent, nbytes=len(honest), check=zlib.crc32(honest))
    else:
        _send_raw(link, wire.DATA, sent)
    reply = link.recv_json("hostile: allocation")
    if not reply.get("ok"):
        return reply
    blocks = cache.block_table(seq)[reply["start_block"]:-(-computed // bs)].tolist()
    for layer in range(cache.store.arenas[0].shape[0]):
        for a in cache.store.arenas:
            part = wire._wire(a[layer][blocks]).contiguous()
            raw = bytearray(part.view(torch.uint8).numpy().tobytes())
            check = zlib.crc32(bytes(raw))
            if case.get("blocks") == "one":          # 1 block per layer, honestly framed
                _send_raw(link, wire.DATA, bytes(raw[:len(raw) // len(blocks)]))
            elif case.get("blocks") == "one_lying":  # framed as all of them
                _send_raw(link, wire.DATA, bytes(raw[:len(raw) // len(blocks)]), nbytes=len(raw), check=check)
            elif case.get("blocks") == "flip":       # a bit flipped in transit
                raw[len(raw) // 2] ^= 1
                _send_raw(link, wire.DATA, bytes(raw), check=check)
            elif case.get("blocks") == "more":       # more bytes than announced, honestly framed
                _send_raw(link, wire.DATA, bytes(raw) * 2)
            else:
                _send_raw(link, wire.DATA, bytes(raw))
    link.send_window(None, blocks)         # both kinds send window rows after the blocks
    return link.recv_json("hostile: commit")


def hostile_receiver(case):
    """Answer an honest sender with ``case``'s malformed allocation reply, then read the
    abort it must send (or the commit stage)."""
    from pagedkv.transfer import wire
    link = wire.Link(0, None, TIMEOUT)
    link.recv_hello()
    link.recv_json("hostile: header")
    _, n, _ = link.recv_frame("hostile: tokens", wire.DATA)
    link.drain(n, "hostile: tokens")
    _send_raw(link, wire.JSON, case["reply"] if isinstance(case["reply"], bytes) else json.dumps(case["reply"]).encode())
    try:
        link.recv_frame("hostile: after the reply", wire.DATA)
    except wire.PeerAborted as e:
        return str(e)
    return "no abort"


DEEP = b'{"magic": %d, "metadata": ' % 0x706B7678 + b"[" * 100000 + b"]" * 100000 + b"}"
#: (name, case) for hostile_sender against recv_sequence
HOSTILE_SEQUENCE = [
    ("num_computed_abc", {"header": {"num_computed": "abc"}}),
    ("num_computed_null", {"header": {"num_computed": None}}),
    ("num_computed_negative", {"header": {"num_computed": -1}}),
    ("num_computed_past_tokens", {"header": {"num_computed": 99}}),
    ("num_tokens_true", {"header": {"num_tokens": True}}),
    ("num_tokens_str", {"header": {"num_tokens": "13"}}),
    ("num_tokens_2_40", {"header": {"num_tokens": 2 ** 40}}),
    ("format_list", {"header": {"format": [1, 2]}}),
    ("format_str", {"header": {"format": "int8"}}),
    ("format_missing", {"drop": ["format"]}),
    ("priority_str", {"header": {"priority": "high"}}),
    ("priority_999", {"header": {"priority": 999}}),
    ("cache_salt_list", {"header": {"cache_salt": ["a"]}}),
    ("adapter_dict", {"header": {"adapter_id": {"a": 1}}}),
    ("seq_id_list", {"header": {"seq_id": [1]}}),
    ("seq_id_missing", {"drop": ["seq_id"]}),
    ("header_a_list", {"raw_header": b"[1, 2, 3]"}),
    ("header_not_json", {"raw_header": b"{not json"}),
    ("header_not_utf8", {"raw_header": b"\xff\xfe{}"}),
    ("header_nested_100000", {"raw_header": DEEP}),
    ("magic_wrong", {"header": {"magic": 1}}),
    ("version_99", {"header": {"version": 99}}),
    ("kind_prefix", {"header": {"kind": "prefix"}}),
    ("tokens_3_of_13", {"tokens": np.arange(100, 103)}),
    ("tokens_short_frame_lies", {"tokens": np.arange(100, 103), "token_frame": True}),
    ("tokens_more_than_announced", {"tokens": np.arange(100, 120)}),
    # the frame announces the honest size and checksum, fewer bytes follow, and the receive
    # buffer already holds the honest bytes (see stale_memory): only what arrived may count
    ("tokens_short_frame_lies_stale_memory", {"tokens": np.arange(100, 103), "token_frame": True}),
    ("header_short_frame_lies_stale_memory", {"header_frame": True}),
    ("blocks_1_of_4", {"blocks": "one"}),
    ("blocks_1_of_4_frame_lies", {"blocks": "one_lying"}),
    ("blocks_bit_flipped", {"blocks": "flip"}),
    ("blocks_more_than_announced", {"blocks": "more"}),
]
HOSTILE_PREFIX = [
    ("tokens_3_of_16", {"tokens": np.arange(100, 103)}),
    ("blocks_1_of_4", {"blocks": "one"}),
    ("blocks_bit_flipped", {"blocks": "flip"}),
    ("hashes_a_str", {"header": {"hashes": "123"}}),
    ("hashes_wrong_count", {"header": {"hashes": ["1"]}}),
    ("num_tokens_not_whole_blocks", {"header": {"num_tokens": 13}}),
]
#: (name, reply) for hostile_receiver against send_sequence
HOSTILE_REPLIES = [
    ("no_start_block", {"ok": True}),
    ("start_block_str", {"ok": True, "start_block": "3"}),
    ("start_block_true", {"ok": True, "start_block": True}),
    ("start_block_negative", {"ok": True, "start_block": -1}),
    ("start_block_99", {"ok": True, "start_block": 99}),
    ("ok_1", {"ok": 1, "start_block": 0}),
    ("reply_a_list", [True, 0]),
    ("reply_nested_100000", b"[" * 100000 + b"]" * 100000),
]


def _state(cache, req):
    return [cache.sequences(), sorted(cache.index.cached_blocks().tolist()), cache.pool.num_free_blocks,
            cache.match_prefix(req)]


def hostile(rank, out):
    req = tokens(100, 13)             # 3 full blocks + 1 token; 4 blocks hold its KV
    cache = make(num_blocks=32)
    fill(cache, "warm", tokens(900, 9))     # something cached on both sides
    cache.free("warm")
    if rank == 0:
        fill(cache, "req", req)
        out["sequence"] = {name: (stage(f"sequence/{name}"), hostile_sender(cache, "req", case))[1]
                           for name, case in HOSTILE_SEQUENCE}
        fill(cache, "pfx", tokens(300, 16))
        out["prefix"] = {name: (stage(f"prefix/{name}"), hostile_sender(cache, "pfx", case, "prefix"))[1]
                         for name, case in HOSTILE_PREFIX}
        cache.free("pfx")
        before = _state(cache, req)
        out["sender"] = {}
        for name, _ in HOSTILE_REPLIES:
            stage(f"reply/{name}")
            out["sender"][name] = expect_error(lambda: pd.send_sequence(cache, "req", 1, timeout=TIMEOUT))
            out["sender"][name + "/unchanged"] = _state(cache, req) == before
            assert_kv(cache, "req", req)
        stage("after")
        out["after"] = pd.send_sequence(cache, "req", 1, timeout=TIMEOUT)     # still in step: a real one works
        cache.free("req")
        assert_clean(cache)
        return
    out["sequence"], out["prefix"], out["unchanged"] = {}, {}, {}
    honest_header = torch.frombuffer(bytearray(json.dumps(_sequence_header(cache, "req", 13, 13)).encode()),
                                     dtype=torch.uint8)
    stale = {"tokens_short_frame_lies_stale_memory": {(torch.int32, 13): torch.from_numpy(req)},
             "header_short_frame_lies_stale_memory": {(torch.uint8, honest_header.numel()): honest_header}}
    for kind, table, fn in (("sequence", HOSTILE_SEQUENCE, pd.recv_sequence),
                            ("prefix", HOSTILE_PREFIX, pd.recv_prefix)):
        probe = req if kind == "sequence" else tokens(300, 16)
        for name, _ in table:
            stage(f"{kind}/{name}")
            before = _state(cache, probe)
            with stale_memory(stale.get(name, {})):
                out[kind][name] = expect_error(lambda: fn(cache, 0, timeout=TIMEOUT))
            out["unchanged"][kind + "/" + name] = _state(cache, probe) == before
            cache.check_invariants()
    out["replies"] = {name: (stage(f"reply/{name}"), hostile_receiver(dict(reply=reply)))[1]
                      for name, reply in HOSTILE_REPLIES}
    stage("after")
    got = pd.recv_sequence(cache, 0, timeout=TIMEOUT)
    assert_kv(cache, "req", req)
    out["after"] = got.num_tokens
    cache.free("req")
    assert_clean(cache)


# ---- hybrid models: sliding-window layer groups handed off ---------------------------------------
HYBRID = [dict(layer_windows=(6, 0, 6, 0)), dict(layer_windows=(6, 6, 6, 6, 6, 0), num_layers=6),
          dict(layer_windows=(6, 0, 6, 0), kv_dtype="int4", head_dim=8, kv_window=4)]


def _hybrid_cache(opts):
    o = dict(num_layers=4, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", num_blocks=96)
    o.update(opts)
    return PagedKVCache(CacheConfig(**o))


def _window_kv(cache, seq):
    return [[t.tolist() for t in cache.gather_window([seq], layer)[:2]] +
            [cache.gather_window([seq], layer)[3].tolist()] for layer in range(cache.config.num_layers)]


def hybrid(rank, out):
    """A sequence of a sliding-window model (each layout above) handed off: the receiver
    reads every layer exactly as the sender does, keeps decoding, and never serves the
    blank positions of a sliding group as a prefix. Then a tiny Gemma 2 and Mistral:
    prefill here, decode there, greedy tokens as in one process."""
    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.testing.sliding_models import tiny_gemma2, tiny_mistral

    req = tokens(100, 23)
    for i, opts in enumerate(HYBRID):
        cache = _hybrid_cache(opts)
        if rank == 0:
            fill(cache, "req", req)
            out[f"sent_{i}"] = pd.send_sequence(cache, "req", 1, timeout=TIMEOUT)
            out[f"kv_{i}"] = _window_kv(cache, "req")
            cache.free("req")
        else:
            got = pd.recv_sequence(cache, 0, timeout=TIMEOUT)
            out[f"kv_{i}"] = _window_kv(cache, "req")
            out[f"cached_{i}"] = got.cached_tokens
            cache.check_invariants()
            more = tokens(100, 27)
            slots = cache.reserve("req", 4)                  # decoding goes on
            for layer in range(cache.config.num_layers):
                k, v = expected_kv(more, layer, 2, cache.config.head_dim)
                cache.write(layer, slots, k[23:], v[23:])
            cache.commit("req", 4, more[23:])
            cache.free("req")
            hit = cache.add_sequence("again", req)          # what is registered here is real KV
            out[f"rehit_{i}"] = hit
            if hit:
                k, v = cache.gather("again", 1)              # a full-attention layer
                ek, _ = expected_kv(req, 1, 2, cache.config.head_dim)
                out[f"rehit_exact_{i}"] = bool(torch.equal(k[:hit], ek[:hit]) or cache.config.kv_dtype)
            cache.free("again")
        assert_clean(cache)

    for name, build in (("gemma2", tiny_gemma2), ("mistral", tiny_mistral)):
        model, _ = build(window=8)
        ids = torch.randint(3, 250, (1, 27), generator=torch.Generator().manual_seed(7))
        kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=128, block_size=4, dtype="float32"))

        @torch.no_grad()
        def decode(first, n):
            toks = [first]
            pc = PagedCache(kv)
            for _ in range(n):
                mask, pos = pc.select(["req"], 1)
                nxt = torch.tensor([[toks[-1]]])
                pc.set_input_ids(nxt)
                logits = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=pc, use_cache=True).logits
                toks.append(int(logits[0, -1].argmax()))
            return toks

        if rank == 0:
            kv.add_sequence("req", ids[0])
            with torch.no_grad():
                pc = PagedCache(kv)
                mask, pos = pc.select(["req"], ids.shape[1])
                pc.set_input_ids(ids)
                logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=pc, use_cache=True).logits
                first = int(logits[0, -1].argmax())
            pd.send_sequence(kv, "req", 1, metadata={"first_token": first}, timeout=TIMEOUT)
            out[f"{name}_local"] = decode(first, 12)
        else:
            got = pd.recv_sequence(kv, 0, timeout=TIMEOUT)
            out[f"{name}_remote"] = decode(got.metadata["first_token"], 12)
        kv.free("req")
        assert_clean(kv)


def hybrid_generate(rank, out):
    """test_hybrid_everywhere's four families: rank 0 prefills a prompt with PagedCache
    (gather path) and sends the sequence, then decodes it locally too; rank 1 receives
    and decodes with the "pagedkv" attention. Then send_prefix of the same prompt when
    the support table allows it with layer groups (rank 1 admits the prompt: its hit and
    greedy tokens), else rank 0 records the refusal."""
    from test_hybrid_everywhere import BS, BUILDERS, FAMILIES, PROMPT, WINDOW, attention, prompt

    from pagedkv.config import support
    from pagedkv.integrations.transformers import PagedCache

    row = next(c.name for c in support.CAPABILITIES if c.name.startswith("send_prefix"))
    prefix_ok = support.supported(row, support.GROUPS)
    for name in FAMILIES:
        model, tok = BUILDERS[name](window=WINDOW)
        ids = prompt(15)
        kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=256, block_size=BS, dtype="float32"))
        paged = rank == 1

        @torch.no_grad()
        def decode(first, n):
            toks = [first]
            pc = PagedCache(kv, paged_attention=paged)
            with attention(model, paged):
                for _ in range(n):
                    mask, pos = pc.select(["req"], 1)
                    nxt = torch.tensor([[toks[-1]]])
                    pc.set_input_ids(nxt)
                    logits = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=pc).logits
                    toks.append(int(logits[0, -1].argmax()))
            return toks

        if rank == 0:
            kv.add_sequence("req", ids[0])
            with torch.no_grad():
                pc = PagedCache(kv)
                mask, pos = pc.select(["req"], PROMPT)
                pc.set_input_ids(ids)
                first = int(model(ids, attention_mask=mask, position_ids=pos, past_key_values=pc).logits[0, -1].argmax())
            out[f"{name}_sent"] = pd.send_sequence(kv, "req", 1, metadata={"first_token": first}, timeout=TIMEOUT)
            out[f"{name}_local"] = decode(first, 11)
        else:
            got = pd.recv_sequence(kv, 0, timeout=TIMEOUT)
            out[f"{name}_remote"] = decode(got.metadata["first_token"], 11)
        kv.free("req")
        if rank == 0:
            try:
                pd.send_prefix(kv, ids[0], 1, timeout=TIMEOUT)
            except support.UnsupportedCombinationError as e:
                out[f"{name}_prefix_refused"] = f"{type(e).__name__}: {e}"
        elif prefix_ok:
            kv.reset_prefix_cache()
            pd.recv_prefix(kv, 0, timeout=TIMEOUT)
            with attention(model, True), PagedCache(kv, paged_attention=True) as cache:
                out[f"{name}_prefix_hit"] = int(cache.admit(ids)[0])
                gen = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False,
                                     attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
            out[f"{name}_prefix_tokens"] = gen[0, PROMPT:].tolist()
        assert_clean(kv)


# hybrid layouts, and quantized caches whose sink or window rows must travel with a prefix
PREFIX_CASES = HYBRID + [dict(kv_dtype="int4", head_dim=8, kv_window=0, kv_key_quant="block", kv_sink_tokens=4),
                         dict(kv_dtype="int4", head_dim=8, kv_window=4, kv_key_quant="block", kv_sink_tokens=5,
                              layer_windows=(6, 0, 6, 0)),
                         dict(kv_dtype="int8", kv_window=6)]


def _prefix_reads(cache, req):
    """What admissions of ``req`` and of a prompt sharing only its first two blocks
    read (every layer, by position): the full blocks come from the prefix cache."""
    got = {}
    for name, toks in (("again", req), ("short", np.append(req[:8], np.int32(7)))):
        got[name + "_hit"] = fill(cache, name, toks)
        got[name] = _window_kv(cache, name)
        cache.free(name)
    return got


def hybrid_prefix(rank, out):
    """send_prefix with sliding-window layer groups and with sink/window rows: the
    receiver's admissions read element for element what the sender's read in place.
    Then tiny Gemma 3 (5 sliding : 1 full) and Qwen2: prefill here, send the prompt's
    prefix, decode there from a prefix hit; greedy tokens equal DynamicCache's."""
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.testing.sliding_models import tiny_gemma3, tiny_qwen2

    req = tokens(100, 23)
    for i, opts in enumerate(PREFIX_CASES):
        cache = _hybrid_cache(opts)
        if rank == 0:
            fill(cache, "req", req)
            cache.free("req")
            out[f"sent_{i}"] = pd.send_prefix(cache, req, 1, timeout=TIMEOUT)
            out[f"again_sent_{i}"] = pd.send_prefix(cache, req, 1, timeout=TIMEOUT)   # nothing new to send
            out[f"reads_{i}"] = _prefix_reads(cache, req)
        else:
            out[f"received_{i}"] = pd.recv_prefix(cache, 0, timeout=TIMEOUT)
            out[f"again_received_{i}"] = pd.recv_prefix(cache, 0, timeout=TIMEOUT)
            cache.check_invariants()
            out[f"reads_{i}"] = _prefix_reads(cache, req)
            out[f"groups_{i}"] = 1 if cache.config.layer_groups is None else len(cache.config.layer_groups.groups)
        cache.check_invariants()
        assert_clean(cache)

    for name, build in (("gemma3", tiny_gemma3), ("qwen2", tiny_qwen2)):
        model, _ = build(window=8)
        ids = torch.randint(3, 250, (1, 27), generator=torch.Generator().manual_seed(11))
        gen = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
        kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=128, block_size=4, dtype="float32"))
        if rank == 0:
            with torch.no_grad(), PagedCache(kv) as pc:      # the prefill (and a local decode)
                pc.admit(ids)
                out[f"{name}_local"] = model.generate(ids, past_key_values=pc, **gen).tolist()
            out[f"{name}_sent"] = pd.send_prefix(kv, ids[0].numpy(), 1, timeout=TIMEOUT)
        else:
            pd.recv_prefix(kv, 0, timeout=TIMEOUT)
            with torch.no_grad(), PagedCache(kv) as pc:
                out[f"{name}_hit"] = np.asarray(pc.admit(ids)).tolist()
                out[f"{name}_remote"] = model.generate(ids, past_key_values=pc, **gen).tolist()
            with torch.no_grad():
                out[f"{name}_dynamic"] = model.generate(ids, past_key_values=DynamicCache(config=model.config),
                                                        **gen).tolist()
        assert_clean(kv)


# ---- MLA latent rows ----------------------------------------------------------------------------
MLA_FORMATS = [("bfloat16", None), ("bfloat16", "fp8_e4m3"), ("float32", "int4")]


def mla(rank, out):
    """Latent rows hand off by sequence and by prefix, in each format; a tensor-parallel
    peer (another rank of the same latent) is a valid receiver: the fingerprint names no
    rank, because every rank holds the same latent."""
    import test_mla_cache as tm
    req, sys_prompt = tokens(100, 21), tokens(500, 17)
    for i, (dtype, kv_dtype) in enumerate(MLA_FORMATS):
        cache = tm.mla(dtype, kv_dtype, num_blocks=32, tp_size=2, tp_rank=rank, hash_seed=3)
        if rank == 0:
            tm.fill(cache, "req", req)
            out[f"sent_{i}"] = pd.send_sequence(cache, "req", 1, timeout=TIMEOUT)
            cache.free("req")
            tm.fill(cache, "sys", sys_prompt)
            cache.free("sys")
            out[f"prefix_sent_{i}"] = pd.send_prefix(cache, sys_prompt, 1, timeout=TIMEOUT)
        else:
            got = pd.recv_sequence(cache, 0, timeout=TIMEOUT)
            out[f"received_{i}"] = [got.num_tokens, got.cached_tokens]
            tm.assert_rows(cache, "req", req)
            cache.free("req")
            out[f"prefix_received_{i}"] = pd.recv_prefix(cache, 0, timeout=TIMEOUT)
            out[f"prefix_hit_{i}"] = tm.fill(cache, "x", sys_prompt)
            tm.assert_rows(cache, "x", sys_prompt)
            cache.free("x")
        assert_clean(cache)
        cache.close()


SCENARIOS = {**STATE_SCENARIOS, "mla": mla, "hybrid_generate": hybrid_generate, "hybrid": hybrid, "hybrid_prefix": hybrid_prefix, "formats": formats, "hostile": hostile, "handoff": handoff, "killed": killed, "receiver_killed": receiver_killed, "timeout": timeout, "tp": tp, "smollm2": smollm2}


_TRACE = None


def stage(msg):
    """One line in ``OUTDIR/rank<R>.trace`` (flushed), so a failing pair shows how far
    each rank got and in what order."""
    if _TRACE is not None:
        _TRACE.write(f"{time.monotonic():.3f} {msg}\n")
        _TRACE.flush()


def _trace_wire():
    """With PAGEDKV_TRACE_WIRE=1: every isend/irecv (tag, bytes, stage) and its wait."""
    from pagedkv.transfer import wire
    send, recv, wait = wire.Link.send, wire.Link.recv, wire.Link._wait
    jitter = float(os.environ.get("PAGEDKV_JITTER", "0"))     # investigation: random delays (s)
    rng = np.random.default_rng()

    def pause():
        if jitter and rng.random() < 0.3:
            time.sleep(rng.random() * jitter)

    def traced_send(self, t, what):
        pause()
        stage(f"  isend tag={wire._TAG + self.step + 1:#x} n={t.numel() * t.element_size()} {what}")
        return send(self, t, what)

    def traced_recv(self, t, what):
        pause()
        stage(f"  irecv tag={wire._TAG + self.step + 1:#x} n={t.numel() * t.element_size()} {what}")
        return recv(self, t, what)

    def traced_wait(self, work, what):
        pause()
        try:
            wait(self, work, what)
        except BaseException as e:
            stage(f"  wait FAILED {what}: {e}")
            raise
    wire.Link.send, wire.Link.recv, wire.Link._wait = traced_send, traced_recv, traced_wait


def main():
    global _TRACE
    scenario, rank, port, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out = {"rank": rank}
    _TRACE = open(os.path.join(outdir, f"rank{rank}.trace"), "w")
    import faulthandler
    faulthandler.enable(_TRACE)          # a native abort (gloo) leaves its Python stack here
    if os.environ.get("PAGEDKV_TRACE_WIRE"):
        _trace_wire()
    stage(f"start {scenario} rank {rank} port {port} pid {os.getpid()}")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        stage("joined")
        SCENARIOS[scenario](rank, out)
        out["ok"] = True
        stage("done")
    except BaseException:
        out["ok"] = False
        out["traceback"] = traceback.format_exc()
        stage("FAILED\n" + out["traceback"])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)    # no barrier at exit: a peer may be gone on purpose


if __name__ == "__main__":
    main()
