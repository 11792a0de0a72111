"""CacheConfig: validation, derived sizes, dtype names, from_hf_config."""
import dataclasses
import json
import subprocess
import sys

import pytest

from pagedkv.config.options import CacheConfig, format_bytes, parse_bytes
from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError

SHAPE = dict(num_layers=4, num_kv_heads=2, head_dim=64)


def cfg(**kw):
    base = dict(SHAPE, num_blocks=10)
    base.update(kw)
    return CacheConfig(**base)


def test_defaults_and_derived_sizes_fp16_nhd():
    c = cfg()
    assert (c.block_size, c.dtype, c.kv_dtype, c.device, c.layout) == (16, "float16", None, "cpu", "NHD")
    assert c.bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert c.bytes_per_block == c.bytes_per_token * 16
    assert c.resolved_num_blocks == 10 and c.num_slots == 160
    assert c.total_bytes == 10 * c.bytes_per_block
    assert c.kv_cache_shape == (10, 2, 16, 2, 64)
    assert c.arena_shape == (4, 10, 2, 16, 2, 64)
    assert c.scale_arena_shape is None and not c.quantized
    assert c.cache_dtype == "float16"


def test_hnd_shapes():
    c = cfg(layout="HND", kv_dtype="int8")
    assert c.kv_cache_shape == (10, 2, 2, 16, 64)
    assert c.scale_arena_shape == (4, 10, 2, 2, 16)


@pytest.mark.parametrize(
    "kv_dtype,elem,scale_arrays",
    [("fp8", 1, 1), ("fp8_e5m2", 1, 1), ("int8", 1, 2)],
)
def test_quantized_bytes_include_scales(kv_dtype, elem, scale_arrays):
    c = cfg(kv_dtype=kv_dtype)
    # per (K/V, layer, head): head_dim elements + float32 scale (+ float32 zero for int8)
    assert c.bytes_per_token == 2 * 4 * 2 * (64 * elem + 4 * scale_arrays)
    assert c.quantized and c.scale_arena_shape == c.arena_shape[:-1]


def test_dtype_aliases_normalize():
    torch = pytest.importorskip("torch")
    assert cfg(dtype="bf16").dtype == "bfloat16"
    assert cfg(dtype=torch.float32).dtype == "float32"
    assert cfg(dtype="fp32").bytes_per_token == 2 * 4 * 2 * 64 * 4
    # kv_dtype equal to the model dtype means "not quantized"
    assert cfg(dtype="bf16", kv_dtype=torch.bfloat16).kv_dtype is None
    assert cfg(kv_dtype="FP8").kv_dtype == "fp8_e4m3"
    assert cfg(kv_dtype=torch.float8_e5m2).kv_dtype == "fp8_e5m2"
    c = cfg(kv_dtype="int8")
    assert c.torch_dtype is torch.float16 and c.torch_cache_dtype is torch.int8
    assert cfg(kv_dtype="fp8").torch_cache_dtype is torch.float8_e4m3fn


def test_memory_budget_resolves_whole_blocks():
    c = CacheConfig(**SHAPE, memory_budget="1MiB")
    assert c.memory_budget == 1024**2
    assert c.resolved_num_blocks == 1024**2 // c.bytes_per_block
    assert c.total_bytes <= 1024**2 < c.total_bytes + c.bytes_per_block
    assert c.num_blocks is None


@pytest.mark.parametrize(
    "text,n",
    [("4GiB", 4 * 1024**3), ("512MB", 512 * 1000**2), ("1.5G", int(1.5 * 1024**3)), ("2 kib", 2048),
     ("100", 100), (4096, 4096), ("1TB", 10**12)],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["4 parsecs", "", "-1GiB", "0", 0, -5, "GiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(InvalidArgumentError, match=r"^memory_budget: expected"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [True, 1.5, None])
def test_parse_bytes_rejects_wrong_types(bad):
    with pytest.raises(ArgumentTypeError, match=r"^memory_budget: expected a byte count \(int or a string"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(4 * 1024**3) == "4.00 GiB"


def test_blocks_for_tokens():
    c = cfg()
    assert [c.blocks_for_tokens(n) for n in (0, 1, 16, 17, 100)] == [0, 1, 1, 2, 7]
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected an int >= 0, got -1"):
        c.blocks_for_tokens(-1)


@pytest.mark.parametrize(
    "kw,err,pattern",
    [
        (dict(num_layers=0), InvalidArgumentError, r"num_layers: expected an int >= 1, got 0"),
        (dict(head_dim=True), ArgumentTypeError, r"head_dim: expected an int >= 1, got True"),
        (dict(num_kv_heads="8"), ArgumentTypeError, r"num_kv_heads: expected an int >= 1, got '8'"),
        (dict(block_size=0), InvalidArgumentError, r"block_size: expected an int >= 1, got 0"),
        (dict(num_attention_heads=3), InvalidArgumentError,
         r"num_attention_heads: expected a multiple of num_kv_heads \(2\), got 3"),
        (dict(dtype="int4"), DTypeError, r"dtype: expected float32/fp32, float16/fp16 or bfloat16/bf16, got 'int4'"),
        (dict(kv_dtype="fp4"), DTypeError, r"kv_dtype: expected None, the model dtype \(float16\)"),
        (dict(kv_dtype="float32"), DTypeError, r"kv_dtype: expected None, the model dtype"),
        (dict(device="tpu"), InvalidArgumentError, r"device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (dict(layout="NDH"), InvalidArgumentError, r"layout: expected 'NHD' or 'HND', got 'NDH'"),
        (dict(eviction="fifo"), InvalidArgumentError, r"eviction: expected one of lru, priority, adaptive, frequency"),
        (dict(priority_classes=0), InvalidArgumentError, r"priority_classes: expected an int >= 1"),
        (dict(low_watermark=1.5), InvalidArgumentError, r"low_watermark: expected a fraction in \[0, 1\]"),
        (dict(low_watermark=0.5, high_watermark=0.2), InvalidArgumentError,
         r"low_watermark: expected <= high_watermark \(0.2\), got 0.5"),
        (dict(hash_seed=-1), InvalidArgumentError, r"hash_seed: expected an int >= 0"),
        (dict(hash_seed=2**64), InvalidArgumentError, r"hash_seed: expected an int in \[0, 2\*\*64\)"),
        (dict(host_num_blocks=-2), InvalidArgumentError, r"host_num_blocks: expected an int >= 0"),
        (dict(shuffle_free_blocks="x"), ArgumentTypeError, r"shuffle_free_blocks: expected an int >= 0"),
        (dict(enable_prefix_caching=1), ArgumentTypeError, r"enable_prefix_caching: expected True or False"),
        (dict(enable_kv_events=None), ArgumentTypeError, r"enable_kv_events: expected True or False"),
        (dict(num_blocks=0), InvalidArgumentError, r"num_blocks: expected an int >= 1, got 0"),
        (dict(memory_budget="1GiB"), InvalidArgumentError,
         r"num_blocks: expected exactly one of num_blocks or memory_budget, got both"),
        (dict(num_blocks=None), InvalidArgumentError,
         r"num_blocks: expected exactly one of num_blocks or memory_budget, got neither"),
        (dict(num_blocks=None, memory_budget=1000), InvalidArgumentError,
         r"memory_budget: expected at least one block \(32768 bytes\), got 1000 bytes"),
    ],
)
def test_validation_errors(kw, err, pattern):
    with pytest.raises(err, match=pattern):
        cfg(**kw)


def test_frozen_and_replace_revalidates():
    c = cfg(kv_dtype="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_blocks = 3
    d = dataclasses.replace(c, dtype="bf16")
    assert (d.dtype, d.kv_dtype) == ("bfloat16", "int8")
    e = dataclasses.replace(c, num_blocks=None, memory_budget="2MiB")
    assert e.resolved_num_blocks == 2 * 1024**2 // e.bytes_per_block
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        dataclasses.replace(c, num_layers=-1)


def test_config_import_does_not_need_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "from pagedkv.config.options import CacheConfig\n"
        "c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=4, dtype='bf16', kv_dtype='fp8')\n"
        "print(c.bytes_per_token)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(2 * 2 * 2 * (8 + 4))


# -- from_hf_config -------------------------------------------------------------------

QWEN3_06B = {  # the shape fields of Qwen/Qwen3-0.6B's config.json
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


def test_from_dict_gqa_with_explicit_head_dim():
    c = CacheConfig.from_hf_config(QWEN3_06B, num_blocks=8)
    # head_dim wins over hidden_size // heads (1024 // 16 = 64)
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.num_attention_heads) == (28, 8, 128, 16)
    assert c.dtype == "float16"  # the cache dtype is the caller's choice, not read from the file


def test_mha_fallback_and_derived_head_dim():
    d = {"num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768, "num_key_value_heads": None}
    c = CacheConfig.from_hf_config(d, num_blocks=4)
    assert (c.num_kv_heads, c.head_dim) == (12, 64)
    d2 = dict(d, head_dim=None)
    del d2["num_key_value_heads"]
    assert CacheConfig.from_hf_config(d2, num_blocks=4).num_kv_heads == 12


def test_gqa_uses_fewer_bytes_than_mha():
    mha = CacheConfig.from_hf_config(dict(QWEN3_06B, num_key_value_heads=None), num_blocks=1)
    gqa = CacheConfig.from_hf_config(QWEN3_06B, num_blocks=1)
    assert mha.bytes_per_token == 2 * gqa.bytes_per_token  # 16 vs 8 kv heads


def test_from_path_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    a = CacheConfig.from_hf_config(tmp_path / "config.json", num_blocks=2)
    b = CacheConfig.from_hf_config(str(tmp_path), num_blocks=2, kv_dtype="fp8")
    assert a.arena_shape == b.arena_shape == (28, 2, 2, 16, 8, 128)
    assert b.kv_dtype == "fp8_e4m3"


def test_nested_text_config_of_multimodal_models():
    d = {"model_type": "llava", "vision_config": {"num_hidden_layers": 24, "num_attention_heads": 16},
         "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                         "hidden_size": 4096}}
    c = CacheConfig.from_hf_config(d, num_blocks=2)
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (32, 8, 128)


def test_transformers_config_objects():
    transformers = pytest.importorskip("transformers")
    q = transformers.Qwen3Config(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, hidden_size=1024)
    c = CacheConfig.from_hf_config(q, num_blocks=2)
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (28, 8, 128)
    gpt2 = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=64)  # attribute_map aliases
    c2 = CacheConfig.from_hf_config(gpt2, num_blocks=2)
    assert (c2.num_layers, c2.num_kv_heads, c2.head_dim) == (3, 4, 16)
    llava = transformers.LlavaConfig(
        text_config={"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "hidden_size": 64}
    )
    c3 = CacheConfig.from_hf_config(llava, num_blocks=2)
    assert (c3.num_layers, c3.num_kv_heads, c3.head_dim) == (3, 2, 16)


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"config: expected a 'num_hidden_layers' field, got keys \[hidden_size"):
        CacheConfig.from_hf_config({"hidden_size": 64, "num_attention_heads": 4}, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"config: expected a 'head_dim' or 'hidden_size' field"):
        CacheConfig.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4}, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"config: expected a readable config.json, got '.*missing.json'"):
        CacheConfig.from_hf_config(tmp_path / "missing.json", num_blocks=1)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgumentError, match=r"config: expected a JSON object, got list"):
        CacheConfig.from_hf_config(tmp_path / "bad.json", num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"config: expected a transformers config, a dict or a path"):
        CacheConfig.from_hf_config(42, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"overrides: expected CacheConfig field names, got 'blocks'"):
        CacheConfig.from_hf_config(QWEN3_06B, blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"num_blocks: expected exactly one"):
        CacheConfig.from_hf_config(QWEN3_06B)


# ---- tensor parallelism ------------------------------------------------------------------
def test_tp_keeps_a_share_of_the_kv_heads_per_rank():
    cfgs = [CacheConfig(num_layers=2, num_kv_heads=8, head_dim=4, num_blocks=4, tp_size=4, tp_rank=r, hash_seed=1)
            for r in range(4)]
    assert [c.kv_head_indices for c in cfgs] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {c.kv_heads_per_rank for c in cfgs} == {2}
    assert cfgs[0].kv_cache_shape == (4, 2, 16, 2, 4)
    full = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=4, num_blocks=4)
    assert cfgs[0].bytes_per_block * 4 == full.bytes_per_block


def test_tp_replicates_kv_heads_when_there_are_fewer_than_ranks():
    cfgs = [CacheConfig(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=4, tp_size=8, tp_rank=r, hash_seed=1)
            for r in range(8)]
    assert [c.kv_head_indices for c in cfgs] == [(0,), (0,), (0,), (0,), (1,), (1,), (1,), (1,)]
    assert {c.kv_heads_per_rank for c in cfgs} == {1}


def test_from_hf_config_takes_tp_size():
    cfg = CacheConfig.from_hf_config({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                      "hidden_size": 576}, num_blocks=8, tp_size=3, tp_rank=2, hash_seed=0)
    assert (cfg.num_kv_heads, cfg.kv_heads_per_rank, cfg.kv_head_indices) == (3, 1, (2,))
    assert cfg.kv_cache_shape == (8, 2, 16, 1, 64)


def test_tp_options_are_validated():
    base = dict(num_layers=1, num_kv_heads=6, head_dim=4, num_blocks=4, hash_seed=1)
    with pytest.raises(InvalidArgumentError, match=r"tp_size: expected a divisor or a multiple of num_kv_heads \(6\), got 4"):
        CacheConfig(**base, tp_size=4)
    with pytest.raises(InvalidArgumentError, match=r"tp_rank: expected an int in \[0, 2\), got 2"):
        CacheConfig(**base, tp_size=2, tp_rank=2)
    with pytest.raises(InvalidArgumentError, match="tp_size: expected an int >= 1, got 0"):
        CacheConfig(**base, tp_size=0)
    with pytest.raises(InvalidArgumentError, match=r"hash_seed: expected an int shared by all ranks when "
                                                   r"tp_size > 1 \(tp_size=2\), got None"):
        CacheConfig(**dict(base, hash_seed=None), tp_size=2)
