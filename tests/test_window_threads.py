"""Threads on one int4 cache with a window arena and sinks: every gathered row is the
KV its thread wrote (exact, from the window) or that KV quantized (from the arena).

The window arena's slot map is shared by every sequence, so a write of one thread's
block can take the slot another thread is reading: that must never show the reader
another block's rows. Each thread runs its own sequences; their prompts share a prefix,
so they hit each other's cached blocks (and those blocks' pinned sink rows). KV is a
function of (token, position), so a hit reads the same KV its reader would have written.
"""
import random
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfBlocksError
from pagedkv.format.quant import dequantize, quantize, quantize_key_channels
from pagedkv.format.rotation import rotate, rotation_signs, unrotate

THREADS, L, H, D, BS = 4, 2, 2, 32, 4
VOCAB, MAX_LEN = 40, 40
PREFIX = [(5 * i) % VOCAB for i in range(4 * BS)]        # shared by every prompt
SECONDS = 5.0


def config(**kw):
    base = dict(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=96, dtype="float32",
                kv_dtype="int4", kv_window=2 * BS, kv_sink_tokens=BS, kv_window_sequences=2)
    base.update(kw)
    return CacheConfig(**base)


def tables(cfg):
    """K and V of every (token, position) ``[VOCAB, MAX_LEN, H, D]``, exact and as the
    arena stores them (rotated, quantized per token, dequantized, unrotated)."""
    g = torch.Generator().manual_seed(25)
    exact = [torch.randn(VOCAB, MAX_LEN, H, D, generator=g) for _ in range(2)]
    signs = rotation_signs(D, cfg.kv_rotation_seed) if cfg.kv_rotation else None

    def stored(x):
        y = x if signs is None else rotate(x, signs)
        y = dequantize(*quantize(y, cfg.kv_dtype, group_size=cfg.kv_group_size), torch.float32)
        return y if signs is None else unrotate(y, signs)

    return exact, [stored(x) for x in exact]


def sealed(keys, bits):
    """``keys`` with every full block's keys quantized per channel (``kv_key_quant="block"``),
    ``bits`` wide (the cache's ``kv_key_bits``)."""
    full = keys.shape[0] // BS * BS
    c, sc, z = quantize_key_channels(keys[:full].reshape(-1, BS, H, D), bits)
    out = keys.clone()
    want = (c.float() * sc.unsqueeze(1).float()) + z.unsqueeze(1).float()
    out[:full] = want.to(keys.dtype).reshape(full, H, D)
    return out


def worker(cache, tid, exact, stored, deadline, counts):
    rng = random.Random(tid)
    mine = {}                       # seq id -> token ids written (prompt + decoded)
    made = 0

    def check(sid):
        toks = mine[sid]
        layer = rng.randrange(L)
        got = cache.gather(sid, layer)
        t = torch.tensor(toks, dtype=torch.long)
        p = torch.arange(len(toks))
        for kv, (g, e, s) in enumerate(zip(got, exact, stored)):
            want_e = e[t, p]
            wants = [want_e, s[t, p]]
            if kv == 0 and cache.config.block_keys and len(toks) >= BS:
                wants.append(sealed(want_e, cache.config.kv_key_bits))
            row_ok = torch.zeros(len(toks), dtype=torch.bool)
            for w in wants:
                row_ok |= (g - w).abs().amax(dim=(1, 2)) <= 1e-5
            if not bool(row_ok.all()):
                bad = int((~row_ok).nonzero()[0])
                err = float((g[bad] - want_e[bad]).abs().max())
                raise AssertionError(f"thread {tid}: {sid!r} layer {layer} row {bad} of {len(toks)}: "
                                     f"another block's KV (error {err:.3f})")
        counts[tid] += 1

    def extend(sid, ids):
        start = len(mine[sid])
        slots = cache.reserve(sid, len(ids))
        t = torch.tensor(ids, dtype=torch.long)
        p = torch.arange(start, start + len(ids))
        for layer in range(L):
            cache.write(layer, slots, exact[0][t, p], exact[1][t, p])
        cache.commit(sid, len(ids), np.asarray(ids, dtype=np.int32))
        mine[sid] = mine[sid] + ids

    while time.monotonic() < deadline:
        op = rng.random()
        try:
            if op < 0.3 or not mine:
                sid = f"t{tid}-{made}"
                made += 1
                prompt = PREFIX[:rng.randrange(1, len(PREFIX) + 1)] + [rng.randrange(VOCAB)
                                                                       for _ in range(rng.randrange(1, 6))]
                hit = cache.add_sequence(sid, prompt)
                mine[sid] = prompt[:hit]
                check(sid)
                try:
                    extend(sid, prompt[hit:])
                except OutOfBlocksError:    # the prompt's ids are known: only those may follow
                    cache.free(sid)
                    del mine[sid]
                    raise
                check(sid)
            elif op < 0.75:
                sid = rng.choice(list(mine))
                if len(mine[sid]) + 2 < MAX_LEN:
                    extend(sid, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3))])
                check(sid)
            else:
                sid = rng.choice(list(mine))
                check(sid)
                (cache.free if rng.random() < 0.5 else cache.free_deferred)(sid)
                del mine[sid]
        except OutOfBlocksError:
            if mine and rng.random() < 0.5:
                sid = rng.choice(list(mine))
                cache.free(sid)
                del mine[sid]
    for sid in mine:
        cache.free(sid)


@pytest.mark.parametrize("kw", [{}, dict(kv_key_quant="block")], ids=["int4", "int4-block-keys"])
def test_threads_read_only_their_own_kv(kw):
    cfg = config(**kw)
    cache = PagedKVCache(cfg)
    exact, stored = tables(cfg)
    errors, counts = [], [0] * THREADS
    deadline = time.monotonic() + SECONDS
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def run(tid):
        try:
            worker(cache, tid, exact, stored, deadline, counts)
        except BaseException:
            errors.append(traceback.format_exc())

    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]
    assert min(counts) > 50, counts
    cache.check_invariants()
