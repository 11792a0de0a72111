"""Tiers beyond one host: the remote (Redis) tier against recompute and the disk tier,
its bytes and throughput against a raw client, and the disk tier at scale.

One JSON line per figure:

- ``ttft``: time to first token of a shared prompt (1,900 tokens on SmolLM2-135M;
  ``--smoke``: 64 tokens on a tiny random Llama) in a fresh cache, when its prefix is
  served from the remote tier (another cache wrote it through to a local
  ``redis-server``), from the disk tier (a warm restart on the directory another cache
  wrote; the file in the page cache), or recomputed (no tier). Median of
  ``--repeats``; the first generated token must be the same in all three.
- ``bytes_per_token``: a remote value's bytes per cached token, SmolLM2's shape, for
  bf16 and int4 (int4 without sink/window rows, as every block outside a sequence's
  sinks and recent window is sent; with them, the value carries them in bf16).
- ``redis_sets`` / ``redis_gets``: blocks per second and MB/s the remote tier stores
  (admit, copy out, header and CRC, pipelined SETs by its writer) and fetches (pipelined
  GETs, header and CRC checked, landed), against a raw ``redis`` client pipelining the
  same bytes in the same batches (``vs_raw``: the tier's rate over the raw one; the
  goal is >= 0.8).
- ``disk_turn``: the disk tier shared by two processes taking turns (two tier objects
  here: ``flock`` is per open file), at 1k, 10k, 100k and 1M blocks (``--smoke``: 1k):
  a lookup after the other wrote one block, a 4-block hit (lookup, CRC, copy), a
  write-through commit of one block, and, for comparison, what a full reopen of the
  directory costs (the behaviour before the journal).

Needs ``redis-server`` on PATH for the remote figures (they are reported as skipped
otherwise). Usage: ``python benchmarks/shared_tiers.py [--smoke] [--repeats N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.remote import RemoteTierConfig
from pagedkv.format.fingerprint import kv_format
from pagedkv.tiers.disk import DiskPrefixTier
from pagedkv.tiers.payload import Blocks
from pagedkv.tiers.remote import RemotePrefixTier
from pagedkv.tiers.verify import ChainQuery

SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


# ---- a local redis-server --------------------------------------------------------------------------
class Redis:
    def __init__(self, workdir: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir, "--protected-mode", "no",
                                      "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=30)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


# ---- time to first token ---------------------------------------------------------------------------
def ttft(redis: Redis | None, smoke: bool, repeats: int, workdir: str) -> None:
    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.testing.models import load_smollm2, tiny_llama

    if smoke:
        model, _ = tiny_llama(seed=0)
        n, name = 64, "tiny-llama"
    else:
        model, _ = load_smollm2()
        n, name = 1900, "SmolLM2-135M"
    vocab = model.config.vocab_size
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, (1, n))).long()
    blocks = -(-n // 16) + 8

    def run(**tiers):
        cfg = CacheConfig.from_hf_config(model.config, num_blocks=blocks, block_size=16, dtype=torch.float32, **tiers)
        with PagedKVCache(cfg) as kv:
            with PagedCache(kv) as cache, torch.no_grad():
                t0 = time.perf_counter()
                hit = cache.admit(ids)
                out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False,
                                     attention_mask=torch.ones_like(ids))
                dt = time.perf_counter() - t0
            if kv._tiers.remote is not None:
                kv._tiers.remote.flush(120)
        return dt, int(out[0, -1]), int(hit[0])

    modes: dict[str, dict] = {"recompute": {}}
    disk = os.path.join(workdir, "ttft-disk")
    modes["disk"] = dict(prefix_disk_dir=disk, prefix_disk_blocks=blocks * 2)
    if redis is not None:
        redis.client.flushall()
        modes["remote"] = dict(prefix_remote=RemoteTierConfig(url=redis.url, timeout_s=30.0))
    results = {}
    for mode, tiers in modes.items():
        if tiers:
            run(prefix_tier_write="through", **tiers)        # another cache computed and wrote the prompt
        times, tokens, hits = [], set(), set()
        for _ in range(repeats):
            dt, tok, hit = run(**tiers)
            times.append(dt)
            tokens.add(tok)
            hits.add(hit)
        results[mode] = (statistics.median(times), tokens, hits)
    first = {t for _, toks, _ in results.values() for t in toks}
    if len(first) != 1:
        raise SystemExit(f"shared_tiers: the first token differs between modes: {results}")
    base = results["recompute"][0]
    for mode, (t, _, hits) in results.items():
        emit(figure="ttft", model=name, prompt_tokens=n, served_from=mode, hit_tokens=max(hits),
             ms=round(t * 1e3, 2), vs_recompute=round(t / base, 3))
    if redis is None:
        emit(figure="ttft", served_from="remote", skipped="redis-server is not installed")


# ---- bytes per token -----------------------------------------------------------------------------
def bytes_per_token() -> None:
    for name, extra in (("bf16", {}), ("int4", dict(kv_dtype="int4"))):
        cfg = CacheConfig(**SMOL, num_blocks=2, dtype="bfloat16", **extra)
        with PagedKVCache(cfg) as cache:
            store = cache.store
            tier = RemotePrefixTier("redis://127.0.0.1:1/0", store.arenas, 16, kv_format(store, ""), rows=store.window)
            w = tier.wire
            rows = tier.layout.section("rows")
            plain = w.header_bytes + (rows.offset if rows is not None else w.record_bytes)
            emit(figure="bytes_per_token", kv=name, block_size=16, value_bytes=plain,
                 bytes_per_token=round(plain / 16, 1), with_window_rows_bytes_per_token=round(w.value_bytes / 16, 1),
                 kv_bytes_per_token=cfg.bytes_per_block // 16)
            tier.close()


# ---- throughput against a raw client ------------------------------------------------------------------
def throughput(redis: Redis | None, smoke: bool, repeats: int) -> None:
    if redis is None:
        emit(figure="redis_sets", skipped="redis-server is not installed")
        return
    n = 16 if smoke else 128
    cfg = CacheConfig(**(dict(SMOL, num_layers=2) if smoke else SMOL), num_blocks=n + 1, dtype="bfloat16")
    with PagedKVCache(cfg) as cache:
        store = cache.store
        for a in store.arenas:
            a.view(torch.uint8).copy_(torch.randint(0, 256, a.view(torch.uint8).shape, dtype=torch.uint8))
        src = Blocks(store.arenas, None, None)
        fmt = kv_format(store, "")
        tokens = np.arange(n * 16, dtype=np.int32)
        batch = 32
        rcfg = RemoteTierConfig(url=redis.url, timeout_s=30.0, batch_blocks=batch,
                                check_existing=os.environ.get("PAGEDKV_BENCH_CHECK_EXISTING") == "1")
        sets, raw_sets, gets, raw_gets = [], [], [], []
        value_bytes = 0
        tier = RemotePrefixTier(rcfg, store.arenas, 16, fmt)         # long-lived, as in a cache: rows reused
        reader = RemotePrefixTier(rcfg, store.arenas, 16, fmt)
        try:
            for r in range(repeats + 1):                               # the first round warms both up
                redis.client.flushall()
                q = ChainQuery(tokens + r * 1_000_000, b"bench", 16)
                t0 = time.perf_counter()
                if tier.batched_put(q, 0, src, list(range(n))) != n or not tier.flush(300):
                    raise SystemExit("shared_tiers: the remote tier did not store every block")
                t_set = time.perf_counter() - t0
                keys = [tier.wire.key(q.digest(i)) for i in range(n)]
                values = redis.client.mget(keys)
                value_bytes = len(values[0])
                reader.landing.clear()
                t0 = time.perf_counter()
                got = reader.lookup(q, 0, n)
                t_get = time.perf_counter() - t0
                if len(got) != n:
                    raise SystemExit(f"shared_tiers: the tier fetched {len(got)} of {n} blocks")
                redis.client.flushall()
                t0 = time.perf_counter()
                for i in range(0, n, batch):
                    pipe = redis.client.pipeline(transaction=False)
                    for k, v in zip(keys[i:i + batch], values[i:i + batch]):
                        pipe.set(k, v, px=86_400_000)
                    pipe.execute()
                t_raw_set = time.perf_counter() - t0
                t0 = time.perf_counter()
                for i in range(0, n, batch):
                    pipe = redis.client.pipeline(transaction=False)
                    for k in keys[i:i + batch]:
                        pipe.get(k)
                    pipe.execute()
                t_raw_get = time.perf_counter() - t0
                if r:
                    sets.append(t_set)
                    gets.append(t_get)
                    raw_sets.append(t_raw_set)
                    raw_gets.append(t_raw_get)
        finally:
            tier.close()
            reader.close()
    mb = n * value_bytes / 1e6
    for figure, mine, raw in (("redis_sets", sets, raw_sets), ("redis_gets", gets, raw_gets)):
        t, tr = statistics.median(mine), statistics.median(raw)
        emit(figure=figure, blocks=n, value_bytes=value_bytes, batch_blocks=batch, blocks_per_s=round(n / t),
             mb_per_s=round(mb / t, 1), raw_blocks_per_s=round(n / tr), raw_mb_per_s=round(mb / tr, 1),
             vs_raw=round(tr / t, 3))


# ---- the disk tier at scale -----------------------------------------------------------------------------
DISK_SHAPE = dict(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")   # 512-byte records


def disk_scale(sizes: list[int], repeats: int, workdir: str) -> None:
    cfg = CacheConfig(**DISK_SHAPE, num_blocks=8)
    with PagedKVCache(cfg) as cache:
        store = cache.store
        fmt = kv_format(store, "")
        src = Blocks(store.arenas, None, None)
        for n in sizes:
            path = os.path.join(workdir, f"disk-{n}")
            opts = dict(eviction="lru", weak_hash=False, verify_blocks=False)
            a = DiskPrefixTier(path, store.arenas, n + 4 * repeats + 64, 16, fmt, **opts)
            t0 = time.perf_counter()
            chain = 64
            for c in range(0, n, chain):                        # n blocks in chains of 64
                m = min(chain, n - c)
                q = ChainQuery(np.arange(c * 16, (c + m) * 16, dtype=np.int32), b"ns", 16)
                a.batched_put(q, 0, src, [0] * m)
            fill = time.perf_counter() - t0
            a.unlock()
            t0 = time.perf_counter()
            b = DiskPrefixTier(path, store.arenas, n + 4 * repeats + 64, 16, fmt, **opts)
            first_open = time.perf_counter() - t0
            b.unlock()
            probe = ChainQuery(np.arange(0, 4 * 16, dtype=np.int32), b"ns", 16)
            commit, lookup, hit, view = [], [], [], []
            for r in range(repeats):
                q1 = ChainQuery(np.arange(10**8 + r * 16, 10**8 + (r + 1) * 16, dtype=np.int32), b"ns", 16)
                t0 = time.perf_counter()                        # a write-through commit of one block
                a.relock(5)
                a.batched_put(q1, 0, src, [1])
                a.unlock()
                commit.append(time.perf_counter() - t0)
                t0 = time.perf_counter()                        # a lookup after the other process wrote
                b.relock(5)
                found = b.lookup(probe, 0, 4)
                b.unlock()
                lookup.append(time.perf_counter() - t0)
                a.relock(5)
                a.batched_put(ChainQuery(q1.tokens + 10**7, b"ns", 16), 0, src, [1])
                a.unlock()
                t0 = time.perf_counter()                        # a 4-block hit after the other wrote
                b.relock(5)
                found = b.lookup(probe, 0, 4)
                ok = all(b.verify(s) for s in found)
                b.load(found, src, [2, 3, 4, 5])
                b.unlock()
                hit.append(time.perf_counter() - t0)
                if len(found) != 4 or not ok:
                    raise SystemExit(f"shared_tiers: the disk tier served {len(found)} blocks")
                t0 = time.perf_counter()                        # a miss nobody changed anything for: no turn
                if b.unchanged():
                    b.lookup(ChainQuery(np.arange(5, 69, dtype=np.int32), b"ns", 16), 0, 4)
                view.append(time.perf_counter() - t0)
            b.relock(5)
            b.close()
            a.relock(5)
            a.close()
            t0 = time.perf_counter()                            # before the journal: every turn reopened
            c = DiskPrefixTier(path, store.arenas, n + 4 * repeats + 64, 16, fmt, **opts)
            c.lookup(probe, 0, 4)
            c.close()
            reopen = time.perf_counter() - t0
            med = {k: round(statistics.median(v) * 1e3, 4) for k, v in
                   (("lookup_ms", lookup), ("hit_4_blocks_ms", hit), ("commit_ms", commit), ("miss_no_change_ms", view))}
            emit(figure="disk_turn", blocks=n, record_bytes=a.record_bytes, **med,
                 full_reopen_and_lookup_ms=round(reopen * 1e3, 2), first_open_ms=round(first_open * 1e3, 1),
                 fill_s=round(fill, 2),
                 files_bytes=sum(os.path.getsize(os.path.join(path, f)) for f in ("blocks.bin", "index.bin")))
            shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sizes", type=str, default=None, help="disk tier sizes, comma separated")
    ap.add_argument("--skip", type=str, default="", help="figures to skip: ttft,bytes,redis,disk")
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.smoke else 7)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else \
        ([1000] if args.smoke else [1000, 10_000, 100_000, 1_000_000])
    skip = set(filter(None, args.skip.split(",")))
    # one thread: on a loaded machine torch's OpenMP barriers turn a 368 KB copy from 0.03 ms into 30 ms
    torch.set_num_threads(int(os.environ.get("PAGEDKV_BENCH_THREADS", "1")))
    with tempfile.TemporaryDirectory() as workdir:
        try:
            redis: Redis | None = Redis(workdir)
        except FileNotFoundError:
            redis = None
        try:
            if "bytes" not in skip:
                bytes_per_token()
            if "redis" not in skip:
                throughput(redis, args.smoke, repeats)
            if "ttft" not in skip:
                ttft(redis, args.smoke, repeats, workdir)
            if "disk" not in skip:
                disk_scale(sizes, max(3, repeats * 3), workdir)
        finally:
            if redis is not None:
                redis.stop()


if __name__ == "__main__":
    main()
