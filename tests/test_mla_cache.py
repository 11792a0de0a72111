"""MLA latent KV through the whole cache: the config (from Hugging Face configs, the
planner's bytes, refusals), the data path (write, gather, attention), prefix caching,
forks, rollback, swap, relocation and the prefix tiers, in every latent format."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.planner import plan
from pagedkv.config.support import UnsupportedCombinationError
from pagedkv.errors import InvalidArgumentError
from pagedkv.format.fingerprint import fingerprint
from pagedkv.groups.spec import MLASpec
from pagedkv.ops import gather_latent, mla_attention
from pagedkv.store.latent_store import LatentStore

R, P = 128, 32
FORMATS = [("bfloat16", None), ("float16", None), ("float32", None), ("bfloat16", "fp8_e4m3"),
           ("float32", "fp8_e4m3"), ("bfloat16", "int8"), ("float16", "int4"), ("float32", "int4")]
DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, hidden_size=7168, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def fid(case) -> str:
    return f"{case[0]}-{case[1] or 'model'}"


def mla(dtype="bfloat16", kv_dtype=None, **over) -> PagedKVCache:
    opts = dict(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P, block_size=4,
                num_blocks=16, dtype=dtype, kv_dtype=kv_dtype)
    opts.update(over)
    return PagedKVCache(CacheConfig(**opts))


def rows(tokens, layer: int, dtype):
    """``(kv_c, k_pe)`` of ``tokens`` in ``layer``: a function of the whole prefix."""
    codes = np.cumsum((np.asarray(tokens, dtype=np.int64) * 7919) % 1009) % 997
    base = torch.from_numpy(codes.astype(np.float32))[:, None] / 997
    c = torch.sin(base * 3 + torch.arange(R) / R + layer) * 2
    pe = torch.cos(base * 5 + torch.arange(P) / P - layer)
    return c.to(dtype), pe.to(dtype)


def fill(cache, sid, tokens, **admit) -> int:
    tokens = np.asarray(tokens, dtype=np.int32)
    hit = cache.add_sequence(sid, tokens, **admit)
    slots = cache.reserve(sid, len(tokens) - hit)
    for layer in range(cache.config.num_layers):
        c, pe = rows(tokens, layer, cache.config.torch_dtype)
        cache.write(layer, slots, c[hit:], pe[hit:])
    cache.commit(sid, len(tokens) - hit)
    return hit


def expected(cache, tokens):
    """What a gather of ``tokens``' rows returns: each written row through its format."""
    fmt = cache.store.format
    out = []
    for layer in range(cache.config.num_layers):
        c, pe = rows(tokens, layer, cache.config.torch_dtype)
        out.append(fmt.decode(fmt.encode(c, pe)))
    return out


def assert_rows(cache, sid, tokens):
    for layer, (c, pe) in enumerate(expected(cache, tokens)):
        got_c, got_pe = cache.gather(sid, layer)
        assert torch.equal(got_c, c) and torch.equal(got_pe, pe), layer


# ---- config ------------------------------------------------------------------------------------


def test_deepseek_v3_kimi_k2_and_v2_configs_read_as_latent_rows():
    from transformers import DeepseekV2Config, DeepseekV3Config

    for src in (DEEPSEEK_V3, dict(DEEPSEEK_V3, model_type="kimi_k2", num_attention_heads=64),
                DeepseekV3Config(num_hidden_layers=3, kv_lora_rank=256, qk_rope_head_dim=32),
                DeepseekV2Config(num_hidden_layers=3, kv_lora_rank=256, qk_rope_head_dim=32)):
        cfg = CacheConfig.from_hf_config(src, num_blocks=8, dtype="bfloat16")
        r = src["kv_lora_rank"] if isinstance(src, dict) else src.kv_lora_rank
        p = src["qk_rope_head_dim"] if isinstance(src, dict) else src.qk_rope_head_dim
        assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_heads, cfg.head_dim) == (r, p, 1, r + p)
        (spec,) = cfg.kv_specs
        assert isinstance(spec, MLASpec) and spec.rows_per_token == 1 and tuple(spec.layers) == tuple(range(cfg.num_layers))
        assert cfg.bytes_per_token == cfg.num_layers * (r + p) * 2


def test_glm4_moe_lite_reads_as_latent_rows():
    from transformers import Glm4MoeLiteConfig

    src = Glm4MoeLiteConfig(num_hidden_layers=2)
    cfg = CacheConfig.from_hf_config(src, num_blocks=8)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (src.kv_lora_rank, src.qk_rope_head_dim)


@pytest.mark.parametrize("model_type, field", [("deepseek_v32", "index_topk"), ("glm_moe_dsa", "index_topk")])
def test_a_sparse_attention_indexer_is_refused_at_config_time(model_type, field):
    src = dict(DEEPSEEK_V3, model_type=model_type, index_topk=2048, index_n_heads=64, index_head_dim=128)
    with pytest.raises(UnsupportedCombinationError,
                       match=rf"{field}: expected an MLA model without a sparse-attention indexer .*got 2048 "
                             rf"\(model_type '{model_type}'\)"):
        CacheConfig.from_hf_config(src, num_blocks=8)


def test_deepseek_v32_from_transformers_is_refused():
    from transformers import DeepseekV32Config

    with pytest.raises(UnsupportedCombinationError, match=r"index_topk: expected an MLA model without"):
        CacheConfig.from_hf_config(DeepseekV32Config(num_hidden_layers=2), num_blocks=8)


@pytest.mark.parametrize("kv_dtype, per_layer", [(None, 1152), ("fp8", 656), ("int8", 648), ("int4", 448)])
def test_the_planner_counts_the_formulas_per_token_per_layer(kv_dtype, per_layer):
    res = plan(DEEPSEEK_V3, "8GiB", max_seq_len=4096, block_size=64, dtype="bfloat16", kv_dtype=kv_dtype)
    assert res.layer_bytes_per_token == per_layer
    assert res.bytes_per_token == 61 * per_layer
    assert res.bytes_per_block == 64 * 61 * per_layer
    assert res.attention == "mla(kv_lora_rank=512, rope_dim=64)"
    assert res.num_blocks == 8 * 1024**3 // res.bytes_per_block
    assert res.exact_bytes_per_sequence == 4096 * 61 * per_layer
    assert "mla(kv_lora_rank=512, rope_dim=64), " + f"{per_layer:,} B per token per layer" in res.format()


def test_plan_command_line_reads_a_deepseek_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    out = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--model-config", str(path), "--budget", "1GiB",
                          "--dtype", "bf16", "--kv-dtype", "fp8", "--block-size", "64", "--json"],
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    assert res["layer_bytes_per_token"] == 656 and res["bytes_per_token"] == 61 * 656


@pytest.mark.parametrize("over, match", [
    (dict(kv_window=8, kv_dtype="int4"), r"kv_window / kv_sink_tokens .*got MLA latent KV"),
    (dict(kv_rotation=True, kv_dtype="int8"), r"kv_rotation / kv_key_quant='block' / fp8_e5m2 / int3 / int2: .*MLA latent"),
    (dict(kv_dtype="fp8_e5m2"), r"kv_rotation / kv_key_quant='block' / fp8_e5m2 / int3 / int2: .*MLA latent"),
    (dict(kv_dtype="int2"), r"kv_rotation / kv_key_quant='block' / fp8_e5m2 / int3 / int2: .*MLA latent"),
    (dict(kv_full_precision_layers=(0,), kv_dtype="int8"), r"kv_full_precision_layers .*got MLA latent KV"),
    (dict(layer_windows=(4, 0)), r"mixing attention types with MLA layers: .*got MLA latent KV"),
])
def test_what_latent_rows_do_not_have_is_refused_by_the_support_table(over, match):
    opts = dict(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P, num_blocks=8)
    opts.update(over)
    with pytest.raises(UnsupportedCombinationError, match=match):
        CacheConfig(**opts)


@pytest.mark.parametrize("over, match", [
    (dict(num_kv_heads=2), r"num_kv_heads: expected 1 for MLA"),
    (dict(head_dim=R), r"head_dim: expected kv_lora_rank \+ qk_rope_head_dim = 160 for MLA, got 128"),
    (dict(qk_rope_head_dim=None), r"kv_lora_rank: expected kv_lora_rank and qk_rope_head_dim together"),
    (dict(layout="HND"), r"layout: expected 'NHD' for MLA"),
    (dict(kv_dtype="fp8", kv_lora_rank=96, head_dim=128), r"kv_lora_rank: expected a multiple of 128"),
])
def test_inconsistent_mla_fields_are_typed_errors(over, match):
    opts = dict(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P, num_blocks=8)
    opts.update(over)
    with pytest.raises(InvalidArgumentError, match=match):
        CacheConfig(**opts)


def test_tensor_parallel_ranks_hold_one_replicated_latent():
    a, b = (CacheConfig(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P,
                        num_blocks=8, tp_size=2, tp_rank=r, hash_seed=1) for r in (0, 1))
    assert a.kv_head_indices == b.kv_head_indices == (0,)
    assert fingerprint(a) == fingerprint(b)       # a tier or a peer of one rank serves the other
    assert a.kv_specs[0].replicated and not CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=4,
                                                         tp_size=2, hash_seed=1).kv_specs[0].replicated


# ---- the data path ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_rows_written_are_read_back_through_the_format_and_a_prefix_hit_reads_them(case):
    with mla(*case) as cache:
        assert isinstance(cache.store, LatentStore)
        assert cache.store.nbytes == cache.config.total_bytes
        a = np.arange(10, 23)
        assert fill(cache, "a", a) == 0
        assert_rows(cache, "a", a)
        k, pe = cache.gather("a", 1, num_tokens=5)
        assert torch.equal(k, expected(cache, a)[1][0][:5])
        b = np.concatenate([a[:8], [99, 98]])
        assert fill(cache, "b", b) == 8                # two full blocks shared
        assert_rows(cache, "b", b)
        assert cache.block_table("b")[:2].tolist() == cache.block_table("a")[:2].tolist()
        cache.free(["a", "b"])


def test_fork_copies_a_shared_partial_block_before_writing_it():
    with mla("bfloat16", "int4") as cache:
        a = np.arange(6)
        fill(cache, "a", a)
        cache.fork("a", "f")
        slots = cache.reserve("f", 1)
        c, pe = rows(np.append(a, 7), 0, torch.bfloat16)
        for layer in range(2):
            cache.write(layer, slots, c[6:], pe[6:])
        cache.commit("f", 1)
        assert cache.block_table("f")[1] != cache.block_table("a")[1]
        assert_rows(cache, "a", a)                     # the source's rows are untouched
        got = cache.gather("f", 0)
        want = expected(cache, np.append(a, 7))[0]
        assert torch.equal(got[0][:6], want[0][:6]) and torch.equal(got[0][6], cache.store.format.decode(
            cache.store.format.encode(c[6:], pe[6:]))[0][0])
        cache.free(["a", "f"])


def test_rollback_of_speculative_tokens_then_new_rows():
    with mla("float32", "fp8_e4m3") as cache:
        a = np.arange(9)
        fill(cache, "a", a)
        slots = cache.reserve("a", 3)
        junk = torch.full((3, R), 7.0), torch.full((3, P), 7.0)
        for layer in range(2):
            cache.write(layer, slots, *junk)
        cache.commit("a", 3)
        cache.truncate("a", 3)                          # the draft was rejected
        assert cache.num_tokens("a") == 9
        b = np.append(a, [40, 41])
        slots = cache.reserve("a", 2)
        for layer in range(2):
            c, pe = rows(b, layer, torch.float32)
            cache.write(layer, slots, c[9:], pe[9:])
        cache.commit("a", 2)
        assert_rows(cache, "a", b)
        cache.free("a")


def test_swap_relocate_and_compact_move_whole_rows():
    with mla("bfloat16", "int8", host_num_blocks=8) as cache:
        a = np.arange(11)
        fill(cache, "a", a)
        cache.swap_out("a")
        assert cache.is_swapped("a")
        fill(cache, "x", np.arange(100, 113))
        cache.free("x")
        cache.swap_in("a")
        assert_rows(cache, "a", a)
        old = int(cache.block_table("a")[2])
        free = next(b for b in range(16) if cache.pool.is_free(b) and b != old)
        cache.relocate("a", [[old, free]])
        assert_rows(cache, "a", a)
        cache.compact()
        assert_rows(cache, "a", a)
        cache.free("a")


@pytest.mark.parametrize("case", [("bfloat16", None), ("bfloat16", "fp8_e4m3"), ("float32", "int4")], ids=fid)
def test_an_evicted_prefix_comes_back_from_host_and_disk_and_after_a_restart(tmp_path, case):
    opts = dict(num_blocks=6, prefix_host_blocks=4, prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=32)
    a = np.arange(50, 63)                               # 3 full blocks + 1 token
    with mla(*case, **opts) as cache:
        fill(cache, "a", a)
        want = [cache.gather("a", layer) for layer in range(2)]
        cache.free("a")
        fill(cache, "x", np.arange(200, 221))           # evicts a from the device
        cache.free("x")
        assert fill(cache, "a", a) == 12
        assert cache.stats().host_hit_tokens + cache.stats().disk_hit_tokens == 12
        for layer in range(2):
            got = cache.gather("a", layer)
            assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])
        cache.free("a")
        fill(cache, "y", np.arange(300, 321))
        cache.free("y")
    with mla(*case, **opts) as again:                   # warm restart on the same directory
        assert fill(again, "a", a) == 12
        assert again.stats().disk_hit_tokens == 12
        for layer in range(2):
            got = again.gather("a", layer)
            assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])
        again.free("a")
    other = dict(opts, kv_dtype="int8") if case[1] != "int8" else dict(opts, kv_dtype="int4")
    with pytest.raises(Exception, match=r"kv_dtype"):    # another latent format: the directory is refused
        mla(case[0], **{k: v for k, v in other.items()})



def test_tensor_parallel_ranks_store_the_replicated_latent_once_in_a_shared_tier(tmp_path):
    # Every rank holds the same latent rows, so rank 1 is served from rank 0's copy and
    # writing its own adds no block: a shared tier keeps one copy, not one per rank.
    opts = dict(num_blocks=6, prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=32, tp_size=2,
                hash_seed=1)
    a = np.arange(50, 63)                               # 3 full blocks + 1 token

    def disk(cache):
        return next(t for t in cache.stats().tiers if t.medium == "disk")

    with mla("bfloat16", "int8", tp_rank=0, **opts) as r0:
        fill(r0, "a", a)
        want = [r0.gather("a", layer) for layer in range(2)]
        r0.free("a")
        fill(r0, "x", np.arange(200, 221))              # evicts a from rank 0's device to the disk
        r0.free("x")
        stored = disk(r0).used_blocks
        assert stored >= 3
    with mla("bfloat16", "int8", tp_rank=1, **opts) as r1:
        assert fill(r1, "a", a) == 12                   # rank 0's blocks serve rank 1
        assert r1.stats().disk_hit_tokens == 12
        for layer in range(2):
            got = r1.gather("a", layer)
            assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])
        r1.free("a")
        fill(r1, "x", np.arange(200, 221))              # rank 1 evicts the same chain
        r1.free("x")
        assert disk(r1).used_blocks == stored           # nothing stored twice

@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_mla_attention_through_the_cache_reads_the_pages_in_place(case):
    with mla(*case) as cache:
        a = np.arange(30, 45)
        fill(cache, "a", a)
        indptr, indices, _ = cache.page_table_csr(["a"])
        lens = cache.seq_lens(["a"]).astype(np.int32)
        dt = cache.config.torch_dtype
        g = torch.Generator().manual_seed(0)
        qn = (torch.randn(2, 3, R, generator=g) / 8).to(dt)
        qp = torch.randn(2, 3, P, generator=g).to(dt)
        qi = np.array([0, 2], dtype=np.int32)
        got = cache.mla_attention(1, qn, qp, indptr, indices, lens, qi, sm_scale=0.1)
        view = cache.store.view(1)
        want = mla_attention(view, qn, qp, torch.from_numpy(indptr), torch.from_numpy(indices),
                             torch.from_numpy(lens), torch.from_numpy(qi), sm_scale=0.1, backend="cpu")
        assert torch.equal(got, want)
        kv, _ = gather_latent(view, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(lens))
        assert torch.equal(kv, cache.gather("a", 1)[0])
        with pytest.raises(UnsupportedCombinationError, match=r"paged attention \(attention\): .*mla_attention"):
            cache.attention(1, qn, indptr, indices, lens, qi)
        cache.free("a")


def test_mla_attention_on_a_kv_cache_is_refused():
    with PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4)) as cache:
        with pytest.raises(InvalidArgumentError, match=r"cache: expected an MLA cache \(kv_lora_rank\)"):
            cache.mla_attention(0, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), np.array([0, 0]), np.array([]),
                                np.array([0]), np.array([0, 1]), sm_scale=1.0)


def test_latent_rows_hand_off_between_processes_in_every_format(tmp_path):
    """send_sequence / send_prefix between two ranks of a tensor-parallel pair (gloo):
    the receiver reads exactly the rows the sender wrote."""
    from dist_workers import MLA_FORMATS
    from test_distributed import assert_ok, run_ranks

    (r0, r1), _ = run_ranks("mla", tmp_path, timeout=300)
    assert_ok(r0)
    assert_ok(r1)
    for i in range(len(MLA_FORMATS)):
        assert r0[f"sent_{i}"] == 6                          # 21 tokens of 4-token blocks
        assert r1[f"received_{i}"] == [21, 0]
        assert r0[f"prefix_sent_{i}"] == r1[f"prefix_received_{i}"] == 4
        assert r1[f"prefix_hit_{i}"] == 16


def test_plan_command_line_takes_an_mla_shape():
    out = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--num-layers", "61", "--num-kv-heads", "1",
                          "--head-dim", "576", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--budget", "1GiB",
                          "--dtype", "bf16", "--kv-dtype", "int4", "--json"], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    assert res["layer_bytes_per_token"] == 448 and res["attention"] == "mla(kv_lora_rank=512, rope_dim=64)"


def test_every_row_mla_cannot_take_is_refused_in_one_wording():
    from pagedkv.config.support import CAPABILITIES, markdown_table, require

    cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P, num_blocks=8)
    refused = [c for c in CAPABILITIES if not c.mla]
    assert len(refused) == 7
    for cap in CAPABILITIES:
        if cap.mla:
            require(cap.name, cfg)
            continue
        if cap.refused is not None:     # an option's row: the config refuses the option itself
            assert cap.name.startswith("attention_sinks")
            with pytest.raises(UnsupportedCombinationError, match="attention_sinks: expected 0 without sliding"):
                CacheConfig(num_layers=2, num_kv_heads=1, head_dim=R + P, kv_lora_rank=R, qk_rope_head_dim=P,
                            num_blocks=8, attention_sinks=4)
            continue
        with pytest.raises(UnsupportedCombinationError) as err:
            require(cap.name, cfg)
        assert str(err.value) == (f"{cap.name}: expected a cache with full attention in every layer ({cap.mla_why}), "
                                  "got MLA latent KV; see pagedkv.config.support.CAPABILITIES")
    assert "| capability | full attention | sliding-window layer groups | MLA latent KV |" in markdown_table()


def test_groups_of_one_pool_share_one_geometry_and_one_arena_kind():
    from pagedkv.groups.spec import FullAttentionSpec, SlidingWindowSpec, check_pool

    f = FullAttentionSpec(0, (0,), block_size=4, num_kv_heads=2, head_dim=8)
    check_pool((f, SlidingWindowSpec(1, (1,), block_size=4, num_kv_heads=2, head_dim=8, window_tokens=6)))
    with pytest.raises(InvalidArgumentError, match=r"layer groups: expected one block geometry in a shared block "
                                                   r"pool .*got group 1: sliding\(window=6\), 8 tokens"):
        check_pool((f, SlidingWindowSpec(1, (1,), block_size=8, num_kv_heads=2, head_dim=8, window_tokens=6)))
    with pytest.raises(InvalidArgumentError, match=r"layer groups: expected one arena kind per cache .*got group 1: "
                                                   r"mla\(kv_lora_rank=512, rope_dim=64\), arena 'latent'"):
        check_pool((f, MLASpec(1, (1,), block_size=4)))
