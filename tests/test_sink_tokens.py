"""Sink tokens (``kv_sink_tokens``): each sequence's first tokens read back in model
precision from blocks pinned in the window arena, every other row exactly as a cache
without sinks reads it."""
import math

import numpy as np
import pytest
import torch
from test_lowbit_store import BS, D, H, L, config, kv_data

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.format.layer_format import LayerFormat
from pagedkv.format.quant import quantize_key_channels
from pagedkv.store.kvstore import KVStore

LOWBIT = [dict(kv_dtype="int4"), dict(kv_dtype="int3"), dict(kv_dtype="int4", kv_key_quant="block"),
          dict(kv_dtype="int2")]
LOWBIT_IDS = ["int4", "int3", "int4-block-keys", "int2"]


def pair(sink, **kw):
    """A cache with ``sink`` sink tokens and its twin without (same bookkeeping, same codes)."""
    kw.setdefault("num_blocks", 64)
    return PagedKVCache(config(kv_sink_tokens=sink, **kw)), PagedKVCache(config(kv_sink_tokens=0, **kw))


def write(caches, seq, k, v, start):
    """Reserve, write and commit ``k``/``v`` as the next tokens of ``seq`` in every cache."""
    n = k.shape[0]
    for c in caches:
        slots = c.reserve(seq, n)
        for layer in range(L):
            c.write(layer, slots, k, v)
        c.commit(seq, n)


def check_read(kv, twin, seq, exact_k, exact_v, sink):
    """Rows ``< sink`` equal the written values; every other row equals the twin's read.

    With block keys the pin keeps the first blocks' exact copies, so those blocks are
    sealed whether or not the twin could seal them: their other keys are checked
    against the per-channel definition instead."""
    n = exact_k.shape[0]
    s = min(sink, n)
    pinned = 0
    if kv.config.block_keys:
        pinned = min(n // BS, kv.config.precise_sink_blocks) * BS     # the pinned blocks that are full
    for layer in range(L):
        k, v = kv.gather(seq, layer)
        tk, tv = twin.gather(seq, layer)
        assert torch.equal(k[:s], exact_k[:s]) and torch.equal(v[:s], exact_v[:s]), f"layer {layer}: sink rows"
        assert torch.equal(v[s:], tv[s:]), f"layer {layer}: values after the sink"
        lo = max(s, pinned)
        assert torch.equal(k[lo:], tk[lo:]), f"layer {layer}: keys after the sink"
        if pinned > s:
            # the per-channel definition at the format's key width (int4: kv_key_bits, 5 by
            # default; int2: 2)
            bits = LayerFormat.of_config(kv.config).key_code_bits
            c, sc, z = quantize_key_channels(exact_k[:pinned].reshape(-1, BS, H, D), bits)
            want = ((c.float() * sc.unsqueeze(1).float()) + z.unsqueeze(1).float()).to(exact_k.dtype)
            want = want.reshape(pinned, H, D)
            assert torch.equal(k[s:pinned], want[s:]), f"layer {layer}: sealed keys of the pinned blocks"


# -- config ---------------------------------------------------------------------------


def test_defaults_sizes_and_typed_errors():
    assert config(kv_dtype="int4", kv_sink_tokens=None).kv_sink_tokens == 4
    assert config(kv_dtype="int3", kv_sink_tokens=None).kv_sink_tokens == 4
    for q in ("int8", "fp8_e4m3"):
        assert config(kv_dtype=q).kv_sink_tokens == 0
    assert config().kv_sink_tokens == 0
    # ceil(sink / block_size) pinned blocks per kv_window_sequences, counted in the bytes
    c = config(kv_dtype="int4", kv_window=8, kv_sink_tokens=5, kv_window_sequences=3)
    assert c.precise_sink_blocks == c.sink_blocks == 2 and c.window_blocks == 3 * (8 // BS + 1 + 2)
    assert c.total_bytes == 24 * c.bytes_per_block + c.window_bytes
    assert KVStore(c).nbytes == c.total_bytes
    # a sink alone (no recent window, per-token keys) still gets its arena
    c = config(kv_dtype="int4", kv_window=0, kv_sink_tokens=4, kv_window_sequences=2)
    assert c.window_blocks == 2 and c.window_bytes > 0
    assert config(kv_dtype="int4", kv_window=0, kv_sink_tokens=0).window_blocks == 0
    with pytest.raises(InvalidArgumentError, match=r"^kv_sink_tokens: expected"):
        config(kv_dtype="int4", kv_sink_tokens=-1)
    with pytest.raises(ArgumentTypeError, match=r"^kv_sink_tokens: expected an int >= 0, got 2.5$"):
        config(kv_dtype="int4", kv_sink_tokens=2.5)
    with pytest.raises(InvalidArgumentError, match=r"^kv_sink_tokens: expected its default for an unquantized"):
        config(kv_sink_tokens=4)


# -- reads ----------------------------------------------------------------------------


@pytest.mark.parametrize("lowbit", LOWBIT, ids=LOWBIT_IDS)
@pytest.mark.parametrize("sink", [1, 4, 6])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("step", [None, 3, 1])
def test_sink_rows_are_exact_and_the_rest_reads_as_without_sinks(lowbit, sink, window, step):
    # 40 tokens = 10 blocks: far more than the window arena's slots per sequence, so only
    # the pin keeps the first block's rows
    kv, twin = pair(sink, kv_window=window, kv_window_sequences=1, **lowbit)
    k, v = kv_data(40, seed=sink + window)
    for c in (kv, twin):
        c.add_sequence("a")
    n = 40 if step is None else step
    for a in range(0, 40, n):
        write((kv, twin), "a", k[a:a + n], v[a:a + n], a)
    check_read(kv, twin, "a", k, v, sink)
    ok, _ = kv.gather("a", 0)
    assert not torch.equal(ok[sink:], k[sink:]), "rows after the sink read back quantized"
    for c in (kv, twin):
        c.free(["a"])


def test_a_sequence_shorter_than_the_sink_reads_every_row_exact():
    kv, twin = pair(6, kv_dtype="int4", kv_window=0)
    k, v = kv_data(3, seed=1)
    for c in (kv, twin):
        c.add_sequence("a")
    write((kv, twin), "a", k, v, 0)
    check_read(kv, twin, "a", k, v, 6)
    for c in (kv, twin):
        c.free(["a"])


def test_gather_pages_with_pending_rows_keeps_the_sink_exact():
    # the transformers Cache reads before it writes its pass (pending): the sink rows are
    # read exact whatever the pass
    kv = PagedKVCache(config(kv_dtype="int4", kv_window=0, kv_sink_tokens=2, num_blocks=32))
    k, v = kv_data(24, seed=3)
    kv.add_sequence("a")
    write((kv,), "a", k[:20], v[:20], 0)
    kv.reserve("a", 4)
    indptr, indices, _ = kv.page_table_csr(["a"])
    t = lambda x: torch.from_numpy(np.asarray(x))
    gk, gv = kv.gather_pages(1, t(indptr), t(indices), t(kv.seq_lens(["a"]).astype(np.int32)), pending=[4])
    assert torch.equal(gk[:2], k[:2]) and torch.equal(gv[:2], v[:2])
    assert not torch.equal(gk[2:20], k[2:20])
    kv.free(["a"])


# -- pins -----------------------------------------------------------------------------


def test_pins_beyond_capacity_release_the_least_recently_used():
    # kv_window_sequences=2 pins two sequences' sinks; a read keeps a pin in use
    kv, twin = pair(2, kv_dtype="int4", kv_window=0, kv_window_sequences=2)
    data = {s: kv_data(12, seed=i) for i, s in enumerate("abc")}
    for s in "ab":
        for c in (kv, twin):
            c.add_sequence(s)
        write((kv, twin), s, *data[s], 0)
    kv.gather("a", 0)                       # a used after b: b is the least recently used
    for c in (kv, twin):
        c.add_sequence("c")
    write((kv, twin), "c", *data["c"], 0)
    for s in "ac":
        check_read(kv, twin, s, *data[s], 2)
    bk, _ = kv.gather("b", 0)
    tk, _ = twin.gather("b", 0)
    assert torch.equal(bk, tk), "b lost its pin: its sink reads back quantized, never wrong"
    assert not torch.equal(bk[:2], data["b"][0][:2])
    for c in (kv, twin):
        c.free(list("abc"))


def test_a_freed_pinned_block_taken_by_another_sequence_never_shows_old_rows():
    # one block of 4 free at a time: b's blocks are a's old ones, first block included
    kv, twin = pair(3, kv_dtype="int4", kv_window=4, kv_window_sequences=1, num_blocks=8)
    ka, va = kv_data(16, seed=1)
    kb, vb = kv_data(30, seed=2)
    for c in (kv, twin):
        c.add_sequence("a")
    write((kv, twin), "a", ka, va, 0)
    first_a = kv.block_table("a")[0]
    for c in (kv, twin):
        c.free(["a"])
        c.reset_prefix_cache()
        c.add_sequence("b")
    for a in range(0, 30, 5):
        write((kv, twin), "b", kb[a:a + 5], vb[a:a + 5], a)
    assert first_a in set(kv.block_table("b").tolist())
    check_read(kv, twin, "b", kb, vb, 3)
    for c in (kv, twin):
        c.free(["b"])


def test_rollback_below_the_sink_rewrites_it_exactly():
    kv, twin = pair(4, kv_dtype="int4", kv_key_quant="block", kv_window=0)
    k, v = kv_data(20, seed=4)
    k2, v2 = kv_data(20, seed=5)
    for c in (kv, twin):
        c.add_sequence("a")
    write((kv, twin), "a", k, v, 0)
    for c in (kv, twin):
        c.truncate(["a"], 18)       # keeps 2
    write((kv, twin), "a", k2[2:], v2[2:], 2)
    check_read(kv, twin, "a", torch.cat([k[:2], k2[2:]]), torch.cat([v[:2], v2[2:]]), 4)
    for c in (kv, twin):
        c.free(["a"])


def test_fork_copy_on_write_keeps_both_sinks_exact():
    # a 3-token parent: its first block is partial and shared, so the child's write copies it
    kv, twin = pair(3, kv_dtype="int4", kv_window=0)
    k, v = kv_data(14, seed=6)
    kc, vc = kv_data(14, seed=7)
    for c in (kv, twin):
        c.add_sequence("p")
    write((kv, twin), "p", k[:3], v[:3], 0)
    for c in (kv, twin):
        c.fork("p", "c")
    write((kv, twin), "c", kc[3:], vc[3:], 3)
    write((kv, twin), "p", k[3:], v[3:], 3)
    assert kv.block_table("p")[0] != kv.block_table("c")[0]
    check_read(kv, twin, "p", k, v, 3)
    check_read(kv, twin, "c", torch.cat([k[:3], kc[3:]]), torch.cat([v[:3], vc[3:]]), 3)
    for c in (kv, twin):
        c.free(["p", "c"])


def test_a_prefix_hit_reads_the_shared_sink_exact():
    kv, twin = pair(4, kv_dtype="int4", kv_window=0, kv_window_sequences=1)
    k, v = kv_data(12, seed=8)
    tokens = np.arange(100, 112, dtype=np.int32)
    for c in (kv, twin):
        c.add_sequence("a", tokens)
    write((kv, twin), "a", k, v, 0)
    for c in (kv, twin):
        c.free(["a"])      # its full blocks stay cached
        assert c.add_sequence("b", tokens) == 8
    write((kv, twin), "b", k[8:], v[8:], 8)
    check_read(kv, twin, "b", k, v, 4)
    for c in (kv, twin):
        c.free(["b"])


def test_swap_out_and_in_keeps_the_sink_exact():
    kv, twin = pair(4, kv_dtype="int4", kv_window=0, host_num_blocks=16)
    k, v = kv_data(22, seed=9)
    for c in (kv, twin):
        c.add_sequence("a")
    write((kv, twin), "a", k, v, 0)
    for c in (kv, twin):
        c.swap_out("a")
        c.swap_in("a")
    check_read(kv, twin, "a", k, v, 4)
    for c in (kv, twin):
        c.free(["a"])


def test_a_bookkeeping_only_cache_ignores_the_sink():
    kv = PagedKVCache(config(kv_dtype="int4"), allocate_store=False)
    kv.add_sequence("a")
    assert kv.reserve("a", 5).shape == (5,)
    kv.free(["a"])


def test_random_workload_keeps_sinks_exact_and_everything_else_as_without():
    # adds, chunked writes, forks, rollbacks and frees in lockstep on both caches
    rng = np.random.default_rng(11)
    # the window arena is sized beyond the live sequences, so neither cache loses a
    # window row to contention (which would make their reads differ legitimately)
    kv, twin = pair(3, kv_dtype="int4", kv_window=4, kv_window_sequences=16, num_blocks=96)
    truth = {}
    for step in range(120):
        live = sorted(truth)
        op = rng.integers(0, 5) if live else 0
        if op == 0 and len(live) < 4:
            s = f"s{step}"
            for c in (kv, twin):
                c.add_sequence(s)
            truth[s] = (torch.empty(0, H, D), torch.empty(0, H, D))
        elif op == 1 and live and len(live) < 4:
            src = live[rng.integers(len(live))]
            dst = f"f{step}"
            for c in (kv, twin):
                c.fork(src, dst)
            truth[dst] = truth[src]
        elif op == 2 and live:
            s = live[rng.integers(len(live))]
            n = int(truth[s][0].shape[0])
            keep = int(rng.integers(0, n + 1))
            for c in (kv, twin):
                c.truncate([s], n - keep)
            truth[s] = (truth[s][0][:keep], truth[s][1][:keep])
        elif op == 3 and live and rng.random() < 0.3:
            s = live[rng.integers(len(live))]
            for c in (kv, twin):
                c.free([s])
            del truth[s]
        elif live:
            s = live[rng.integers(len(live))]
            n = int(rng.integers(1, 7))
            if truth[s][0].shape[0] + n > 40:
                continue
            k, v = kv_data(n, seed=1000 + step)
            write((kv, twin), s, k, v, truth[s][0].shape[0])
            truth[s] = (torch.cat([truth[s][0], k]), torch.cat([truth[s][1], v]))
        for s in truth:
            if truth[s][0].shape[0]:
                check_read(kv, twin, s, *truth[s], 3)
    for c in (kv, twin):
        c.free(sorted(truth))


def test_plan_and_the_cli_count_the_pinned_blocks(capsys):
    import json

    from pagedkv.cli import main
    from pagedkv.config.planner import plan

    hf = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    with_sink = plan(hf, "1GiB", 4096, dtype="float16", kv_dtype="int4")
    without = plan(hf, "1GiB", 4096, dtype="float16", kv_dtype="int4", kv_sink_tokens=0)
    c = CacheConfig.from_hf_config(hf, memory_budget="1GiB", dtype="float16", kv_dtype="int4")
    # one more pinned block per kv_window_sequences, in model precision, fewer blocks left
    one = 28 * (2 * 16 * 8 * 128 * 2 + 16)      # a block of every layer, K and V, plus validity
    assert c.kv_sink_tokens == 4 and c.window_bytes - (one * 16) == CacheConfig.from_hf_config(
        hf, memory_budget="1GiB", dtype="float16", kv_dtype="int4", kv_sink_tokens=0).window_bytes
    assert with_sink.num_blocks < without.num_blocks
    rc = main(["plan", "--num-layers", "28", "--num-kv-heads", "8", "--head-dim", "128", "--budget", "1GiB",
               "--kv-dtype", "int4", "--kv-sink-tokens", "0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_blocks"] == CacheConfig(num_layers=28, num_kv_heads=8, head_dim=128, memory_budget="1GiB",
                                            kv_dtype="int4", kv_sink_tokens=0).resolved_num_blocks
    rc = main(["plan", "--num-layers", "28", "--num-kv-heads", "8", "--head-dim", "128", "--budget", "1GiB",
               "--kv-dtype", "int4", "--kv-sink-tokens", "-2"])
    assert rc == 2 and "kv_sink_tokens: expected" in capsys.readouterr().err


def test_sliding_window_layer_groups_keep_the_sink_of_their_full_attention_layers():
    # layers 0 and 2 full attention, layer 1 a sliding window of 8: two layer groups whose
    # first blocks are both pinned; the sliding layer releases its first blocks and never
    # reads them, the full layers read their sink exact
    kv, twin = pair(2, kv_dtype="int4", kv_window=0, layer_windows=(0, 8, 0), num_blocks=96,
                    kv_window_sequences=1)
    k, v = kv_data(10 * BS, seed=30)
    for c in (kv, twin):
        c.add_sequence("a")
    for a in range(0, 10 * BS, 3):
        write((kv, twin), "a", k[a:a + 3], v[a:a + 3], a)
    for layer in (0, 2):
        gk, gv = kv.gather("a", layer)
        tk, tv = twin.gather("a", layer)
        assert torch.equal(gk[:2], k[:2]) and torch.equal(gv[:2], v[:2])
        assert torch.equal(gk[2:], tk[2:]) and torch.equal(gv[2:], tv[2:])
    got = kv.gather_window(["a"], 1)
    want = twin.gather_window(["a"], 1)
    assert all(torch.equal(x, y) for x, y in zip(got, want))    # nothing of the sink left there
    for c in (kv, twin):
        c.free(["a"])
