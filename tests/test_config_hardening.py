"""Hostile input against the config layer and the allocators (issue 25, item 3).

Model configs (dict, config.json, GGUF header), CacheConfig options and arena sizes:
each bad input is a typed pagedkv error whose class and whole message are pinned, and
nothing is allocated or opened before it is refused.
"""
import json
import os
import re
import struct
import threading

import pytest
import torch
from model_fixtures import tiny  # noqa: F401

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config import memory as memory_check
from pagedkv.config.options import parse_bytes, show
from pagedkv.errors import ArgumentTypeError, DeviceError, InvalidArgumentError, OutOfMemoryError, PagedKVError
from pagedkv.tools.calibration import choose_full_precision_layers, layer_sensitivity

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16)
HF = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)


def whole(message):
    return f"^{re.escape(message)}$"


# ---- from_hf_config: fields ----------------------------------------------------------
@pytest.mark.parametrize("field, value, err, message", [
    ("num_attention_heads", 0, InvalidArgumentError, "num_attention_heads: expected an int >= 1, got 0"),
    ("num_attention_heads", "4", ArgumentTypeError, "num_attention_heads: expected an int >= 1, got '4'"),
    ("hidden_size", "big", ArgumentTypeError, "hidden_size: expected an int >= 1, got 'big'"),
    ("hidden_size", float("nan"), ArgumentTypeError, "hidden_size: expected an int >= 1, got nan"),
    ("hidden_size", float("inf"), ArgumentTypeError, "hidden_size: expected an int >= 1, got inf"),
    ("hidden_size", [64], ArgumentTypeError, "hidden_size: expected an int >= 1, got [64]"),
    ("hidden_size", 64.0, ArgumentTypeError, "hidden_size: expected an int >= 1, got 64.0"),
    ("hidden_size", True, ArgumentTypeError, "hidden_size: expected an int >= 1, got True"),
    ("hidden_size", -64, InvalidArgumentError, "hidden_size: expected an int >= 1, got -64"),
    ("hidden_size", 2**70, InvalidArgumentError, "hidden_size: expected an int in [1, 2**63), got an int of 71 bits"),
    ("num_hidden_layers", 2.0, ArgumentTypeError, "num_hidden_layers: expected an int >= 1, got 2.0"),
    ("num_key_value_heads", {}, ArgumentTypeError, "num_key_value_heads: expected an int >= 1, got {}"),
    ("model_type", ["gemma2"], ArgumentTypeError, "model_type: expected a str, got ['gemma2']"),
    ("model_type", {"a": 1}, ArgumentTypeError, "model_type: expected a str, got {'a': 1}"),
])
def test_hf_config_fields_are_checked_as_read(field, value, err, message):
    cfg = dict(HF, sliding_window=8, **{field: value})
    with pytest.raises(err, match=whole(message)):
        CacheConfig.from_hf_config(cfg, num_blocks=8)


def test_a_text_config_string_is_never_opened(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(HF))      # a valid config: opening it would succeed
    for key in ("text_config", "llm_config", "language_config"):
        with pytest.raises(ArgumentTypeError, match=whole(f"{key}: expected a nested config (a JSON object), "
                                                          f"got {show(str(target))}")):
            CacheConfig.from_hf_config({key: str(target)}, num_blocks=8)
    nested = CacheConfig.from_hf_config({"text_config": dict(HF)}, num_blocks=8)
    assert (nested.num_layers, nested.head_dim) == (2, 16)


def _run_bounded(fn, seconds=20):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_fifo_config_path_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):           # the file itself, or its directory
        with pytest.raises(InvalidArgumentError, match=whole(f"config: expected a regular file (config.json or "
                                                             f"GGUF), got {str(fifo)!r} (a FIFO)")):
            _run_bounded(lambda p=path: CacheConfig.from_hf_config(p, num_blocks=8))


def test_a_device_config_path_is_refused():
    with pytest.raises(InvalidArgumentError, match=whole("config: expected a regular file (config.json or GGUF), "
                                                         "got '/dev/zero' (a device)")):
        _run_bounded(lambda: CacheConfig.from_hf_config("/dev/zero", num_blocks=8))


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_json_nested_100000_deep_is_refused(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=whole(f"config: expected a JSON object nested as a model config "
                                                         f"is, got {str(path)!r} (nested too deep to decode)")):
        CacheConfig.from_hf_config(path, num_blocks=8)


def test_a_path_with_a_nul_byte_is_refused():
    with pytest.raises(InvalidArgumentError, match=whole("config: expected a path (a str without NUL bytes), "
                                                         "got 'a\\x00b'")):
        CacheConfig.from_hf_config("a\0b", num_blocks=8)


# ---- GGUF headers ----------------------------------------------------------------------
def _gguf(path, pairs):
    """A GGUF v3 file with metadata ``pairs`` of (key, type code, value) and no tensors."""
    def string(s):
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw
    body = b""
    for key, vtype, value in pairs:
        body += string(key) + struct.pack("<I", vtype)
        if vtype == 8:
            body += string(value)
        elif vtype == 9:
            etype, items = value
            body += struct.pack("<IQ", etype, len(items)) + b"".join(struct.pack("<f", v) for v in items)
        else:
            body += struct.pack("<" + {4: "I", 6: "f", 7: "?", 12: "d"}[vtype], value)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + body)
    return path


def _llama(**override):
    fields = {"block_count": (4, 2), "attention.head_count": (4, 4), "attention.head_count_kv": (4, 2),
              "embedding_length": (4, 64)}
    fields.update(override)
    return [("general.architecture", 8, "llama")] + [(f"llama.{k}", t, v) for k, (t, v) in fields.items()]


def test_a_good_gguf_header_reads(tmp_path):
    cfg = CacheConfig.from_hf_config(_gguf(tmp_path / "m.gguf", _llama()), num_blocks=8)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 16)


@pytest.mark.parametrize("override, err, message", [
    (dict(embedding_length=(6, float("nan"))), ArgumentTypeError, "llama.embedding_length: expected an integer, got nan"),
    (dict(embedding_length=(6, float("inf"))), ArgumentTypeError, "llama.embedding_length: expected an integer, got inf"),
    (dict(embedding_length=(12, 64.0)), ArgumentTypeError, "llama.embedding_length: expected an integer, got 64.0"),
    (dict(embedding_length=(8, "big")), ArgumentTypeError, "llama.embedding_length: expected an integer, got 'big'"),
    (dict(block_count=(7, True)), ArgumentTypeError, "llama.block_count: expected an integer, got True"),
    (dict(embedding_length=(9, (6, [1.5, 1.5]))), ArgumentTypeError,
     "llama.embedding_length: expected an integer, got 1.5"),
])
def test_gguf_fields_of_the_wrong_type_are_refused_by_key(tmp_path, override, err, message):
    path = _gguf(tmp_path / "m.gguf", _llama(**override))
    with pytest.raises(err, match=whole(f"{message} in {str(path)!r}")):
        CacheConfig.from_hf_config(path, num_blocks=8)


def test_gguf_zero_heads_is_a_range_error(tmp_path):
    path = _gguf(tmp_path / "m.gguf", _llama(**{"attention.head_count": (4, 0)}))
    with pytest.raises(InvalidArgumentError, match=whole("num_attention_heads: expected an int >= 1, got 0")):
        CacheConfig.from_hf_config(path, num_blocks=8)


# ---- CacheConfig options ---------------------------------------------------------------
INT_OPTIONS = ["num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "priority_classes",
               "host_num_blocks", "prefix_host_blocks", "kv_window_sequences", "tp_size", "tp_rank",
               "attention_sinks", "hash_seed", "shuffle_free_blocks", "num_attention_heads", "kv_rotation_seed"]
MINIMUM = dict(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, num_blocks=1, priority_classes=1,
               kv_window_sequences=1, tp_size=1, num_attention_heads=1)


# None is a valid value (the default) of the optional ones, and num_blocks=None means "use memory_budget"
NONE_IS_VALID = ("hash_seed", "shuffle_free_blocks", "num_attention_heads", "num_blocks")


@pytest.mark.parametrize("name, bad", [(n, b) for n in INT_OPTIONS for b in ("8", 8.0, None, True)
                                       if not (b is None and n in NONE_IS_VALID)])
def test_a_wrong_type_for_an_int_option_is_an_argument_type_error(name, bad):
    kw = {**SHAPE, "num_blocks": 8, name: bad}
    with pytest.raises(ArgumentTypeError, match=whole(f"{name}: expected an int >= {MINIMUM.get(name, 0)}, "
                                                      f"got {bad!r}")):
        CacheConfig(**kw)


@pytest.mark.parametrize("name", ["kv_window", "kv_sink_tokens", "kv_group_size"])
@pytest.mark.parametrize("kv_dtype", [None, "int4"])
def test_a_wrong_type_for_a_lowbit_int_is_an_argument_type_error_whatever_kv_dtype(name, kv_dtype):
    low = 1 if name == "kv_group_size" else 0
    with pytest.raises(ArgumentTypeError, match=whole(f"{name}: expected an int >= {low}, got '8'")):
        CacheConfig(**SHAPE, num_blocks=8, kv_dtype=kv_dtype, **{name: "8"})


@pytest.mark.parametrize("kw, err, message", [
    (dict(kv_dtype="int4", kv_rotation="yes"), ArgumentTypeError, "kv_rotation: expected True or False, got 'yes'"),
    (dict(kv_rotation="yes"), ArgumentTypeError, "kv_rotation: expected True or False, got 'yes'"),
    (dict(kv_dtype="int4", kv_full_precision_layers="0"), ArgumentTypeError,
     "kv_full_precision_layers: expected a tuple of layer indices, got '0'"),
    (dict(kv_dtype="int4", kv_full_precision_layers=(0.0,)), ArgumentTypeError,
     "kv_full_precision_layers: expected layer indices in [-2, 2), got 0.0"),
    (dict(low_watermark="0.1"), ArgumentTypeError, "low_watermark: expected a fraction in [0, 1], got '0.1'"),
    (dict(num_blocks=2**63), InvalidArgumentError, "num_blocks: expected an int in [1, 2**63), got 9223372036854775808"),
    pytest.param(dict(num_blocks=10**5000), InvalidArgumentError,
                 "num_blocks: expected an int in [1, 2**63), got an int of 16610 bits", id="5000-digit-num_blocks"),
    (dict(prefix_disk_dir="a\0b", prefix_disk_blocks=4), InvalidArgumentError,
     "prefix_disk_dir: expected a directory path (a str without NUL bytes), got 'a\\x00b'"),
])
def test_option_errors(kw, err, message):
    with pytest.raises(err, match=whole(message)):
        CacheConfig(**dict(dict(SHAPE, num_blocks=8), **kw))


@pytest.mark.parametrize("budget, message", [
    ("9" * 5000, "memory_budget: expected a byte count below 2**63, got '" + "9" * 32 + "'... (5000 characters)"),
    ("9" * 5000 + ".5", "memory_budget: expected a byte count below 2**63, got '" + "9" * 32 + "'... (5002 characters)"),
    ("8EiB", "memory_budget: expected a byte count like '4GiB', '512MB' or '1073741824', got '8EiB'"),
    ("9000000000TiB", "memory_budget: expected a byte count below 2**63, got '9000000000TiB'"),
    pytest.param(10**5000, "memory_budget: expected a byte count below 2**63, got an int of 16610 bits",
                 id="5000-digit-int"),
    (2**63, "memory_budget: expected a byte count below 2**63, got 9223372036854775808"),
])
def test_huge_memory_budgets_are_refused_without_converting_them(budget, message):
    with pytest.raises(InvalidArgumentError, match=whole(message)):
        parse_bytes(budget)


def test_fractional_budgets_are_exact():
    assert parse_bytes("1." + "9" * 5000 + "G") == 2 * 1024**3 - 1   # truncated to 24 digits, rounded down
    assert parse_bytes("1.5G") == 3 * 1024**3 // 2 and parse_bytes(".5K") == 512


def test_layer_windows_as_a_dict_are_read_by_layer():
    assert CacheConfig(**SHAPE, num_blocks=8, layer_windows={0: 4, 1: 0}).layer_windows == (4, 0)
    assert CacheConfig(**SHAPE, num_blocks=8, layer_windows={1: 4, 0: 0}).layer_windows == (0, 4)


@pytest.mark.parametrize("windows, err, message", [
    ({0: 4, 2: 0}, InvalidArgumentError,
     "layer_windows: expected 2 windows (one per layer: a dict keyed by every layer 0..1), got a dict keyed by [0, 2]"),
    ({0: 4}, InvalidArgumentError,
     "layer_windows: expected 2 windows (one per layer: a dict keyed by every layer 0..1), got a dict keyed by [0]"),
    ({"0": 4, "1": 0}, InvalidArgumentError,
     "layer_windows: expected 2 windows (one per layer: a dict keyed by every layer 0..1), got a dict keyed by ['0', '1']"),
    ({4, 0}, ArgumentTypeError, "layer_windows: expected 2 windows (one per layer), got {0, 4}"),
    ("40", ArgumentTypeError, "layer_windows: expected 2 windows (one per layer), got '40'"),
])
def test_layer_windows_in_unordered_or_partial_forms_are_refused(windows, err, message):
    with pytest.raises(err, match=whole(message)):
        CacheConfig(**SHAPE, num_blocks=8, layer_windows=windows)


@pytest.mark.parametrize("kv_dtype", [None, "fp8", "int4"])
def test_cuda_without_a_usable_gpu_is_a_device_error(monkeypatch, kv_dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=whole("device: expected a CUDA device torch can use, got 'cuda' "
                                                "(torch.cuda.is_available() is False: no GPU, or a CPU-only torch)")):
        PagedKVCache(CacheConfig(**SHAPE, num_blocks=8, device="cuda", kv_dtype=kv_dtype))


# ---- sizes before allocating ---------------------------------------------------------
AVAILABLE = 10**9


@pytest.fixture
def host_memory(monkeypatch):
    """Fix the host's free memory and record every torch.zeros, so that a test can
    prove the refusal came before any allocation."""
    monkeypatch.setattr(memory_check, "_host_available", lambda: AVAILABLE)
    calls = []
    real = torch.zeros

    def zeros(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(torch, "zeros", zeros)
    return calls


@pytest.mark.parametrize("kw, option, value", [
    (dict(num_blocks=2**40), "num_blocks", 2**40),
    (dict(num_blocks=2**31 - 1), "num_blocks", 2**31 - 1),
    (dict(memory_budget="1TiB"), "memory_budget", 2**40),
    (dict(num_blocks=8, kv_dtype="int4", kv_window=10**12), "kv_window", 10**12),
    (dict(num_blocks=8, kv_dtype="int4", kv_window_sequences=2**40), "kv_window_sequences", 2**40),
    (dict(num_blocks=8, prefix_host_blocks=2**40), "prefix_host_blocks", 2**40),
    (dict(num_blocks=8, host_num_blocks=2**40), "host_num_blocks", 2**40),
])
def test_arenas_larger_than_free_memory_are_refused_before_allocating(host_memory, kw, option, value):
    with pytest.raises(OutOfMemoryError) as info:
        PagedKVCache(CacheConfig(**SHAPE, **kw))
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, PagedKVError)
    assert e.option == option and e.available_bytes == AVAILABLE and e.needed_bytes > AVAILABLE
    assert str(e) == (f"{option}: expected arenas that fit the {AVAILABLE} bytes available on cpu, "
                      f"got {value} ({e.needed_bytes} bytes needed)")
    if option != "prefix_host_blocks":   # the tier comes after the device arenas, which fit
        assert host_memory == []


def test_needed_bytes_are_the_arenas_bytes_and_the_limit_is_inclusive(host_memory, monkeypatch):
    cfg = CacheConfig(**SHAPE, num_blocks=64)
    need = cfg.total_bytes              # unquantized: the data arena alone
    monkeypatch.setattr(memory_check, "_host_available", lambda: need - 1)
    with pytest.raises(OutOfMemoryError, match=whole(f"num_blocks: expected arenas that fit the {need - 1} bytes "
                                                     f"available on cpu, got 64 ({need} bytes needed)")):
        PagedKVCache(cfg)
    assert host_memory == []
    monkeypatch.setattr(memory_check, "_host_available", lambda: need)
    kv = PagedKVCache(cfg)
    assert kv.store.nbytes == need


def test_sizes_past_2_63_bytes_are_refused_whatever_the_device_holds(monkeypatch):
    monkeypatch.setattr(memory_check, "_host_available", lambda: 2**80)
    with pytest.raises(OutOfMemoryError, match=whole("head_dim: expected arenas that fit fewer than 2**63 bytes, "
                                                     f"got {2**40} ({2**80} bytes needed)")):
        memory_check.arena_bytes("head_dim", 2**40, (2**40,), 2**40)
    with pytest.raises(OutOfMemoryError, match=r"^head_dim: .*got 8 \(9223372036854775808 bytes needed\)$"):
        memory_check.arena_bytes("head_dim", 8, (2**31, 2**30), 4)   # 2**63: past int64 by one
    assert memory_check.arena_bytes("head_dim", 8, (2**31, 2**30), 2) == 2**62
    with pytest.raises(OutOfMemoryError, match=r"^num_blocks: expected arenas that fit fewer than 2\*\*63 bytes"):
        PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=2**40, num_blocks=2**31 - 1))


def test_a_bookkeeping_only_cache_checks_the_host_pool(monkeypatch):
    monkeypatch.setattr(memory_check, "_host_available", lambda: 1000)
    with pytest.raises(OutOfMemoryError, match=r"^host_num_blocks: expected a host pool whose bookkeeping fits the "
                                               r"1000 bytes available on cpu, got 100 \(3000 bytes needed\)$"):
        PagedKVCache(CacheConfig(**SHAPE, num_blocks=8, host_num_blocks=100), allocate_store=False)


# ---- calibration -----------------------------------------------------------------------
def _ids(model, n=8):
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model", [None, "model", 3])
def test_calibration_without_a_model_is_a_type_error(tiny, model):
    ids = _ids(tiny[0])
    with pytest.raises(ArgumentTypeError, match=whole("model: expected a transformers causal LM (with .config and "
                                                      f".parameters()), got {type(model).__name__}")):
        layer_sensitivity(model, ids, kv_dtype="int8")


@pytest.mark.parametrize("bad, pos", [(-1, 3), ("vocab", 5)])
def test_calibration_refuses_out_of_vocabulary_ids(tiny, bad, pos):
    model, _ = tiny
    ids = _ids(model)
    vocab = model.get_input_embeddings().num_embeddings
    value = vocab if bad == "vocab" else bad
    ids[0, pos] = value
    with pytest.raises(InvalidArgumentError, match=whole(f"input_ids: expected token ids in [0, {vocab}) (the "
                                                         f"model's vocabulary), got {value} at position {pos}")):
        layer_sensitivity(model, ids, kv_dtype="int8")


@pytest.mark.parametrize("name, value", [("num_blocks", 4), ("dtype", "float16"), ("memory_budget", "1MiB"),
                                         ("kv_window_sequences", 2)])
def test_calibration_refuses_options_it_sets_itself(tiny, name, value):
    model, _ = tiny
    with pytest.raises(InvalidArgumentError, match=whole(f"{name}: expected not given (the calibration pass sets "
                                                         f"it), got {value!r}")):
        layer_sensitivity(model, _ids(model), kv_dtype="int8", **{name: value})


def test_calibration_count_of_the_wrong_type(tiny):
    model, _ = tiny
    with pytest.raises(ArgumentTypeError, match=whole("chunk: expected an int >= 1, got 2.0")):
        layer_sensitivity(model, _ids(model), kv_dtype="int8", chunk=2.0)


@pytest.mark.parametrize("count", [True, 1.0, "1"])
def test_choose_count_of_the_wrong_type(count):
    with pytest.raises(ArgumentTypeError, match=whole(f"count: expected an int >= 0, got {count!r}")):
        choose_full_precision_layers([0.1, 0.2], count)
