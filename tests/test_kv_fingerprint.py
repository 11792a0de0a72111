"""The KV format fingerprint: every CacheConfig field is classified, and two caches whose
settings change what a block's bytes mean never exchange blocks through the disk tier
(this file) or a transfer (``test_transfer_hardening.py``)."""
import dataclasses
import hashlib
import os
import re

import numpy as np
import pytest
import torch
from tier_helpers import SHAPE, expected_kv

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import InternalError, InvalidArgumentError, TierFileError
from pagedkv.format.fingerprint import NOT_STORED, STORED, differences, fingerprint, kv_format, unclassified

# (setting, written with, opened with, {fingerprint entry: (written value, opened value)});
# "arenas" differs too where the shapes differ (not listed). One row per setting that
# changes what a block's bytes mean; the rows run over the disk tier here and over
# send_sequence / send_prefix in test_transfer_hardening.py.
INT8 = dict(kv_dtype="int8")
INT4 = dict(kv_dtype="int4", head_dim=8, kv_window=0, kv_sink_tokens=0)
TP = dict(num_kv_heads=4, hash_seed=7)
FORMAT_PAIRS = [
    ("num_layers", {}, dict(num_layers=3), {"num_layers": (2, 3)}),
    ("num_kv_heads", {}, dict(num_kv_heads=1), {"num_kv_heads": (2, 1), "kv_head_indices": ([0, 1], [0])}),
    ("head_dim", {}, dict(head_dim=8), {"head_dim": (4, 8)}),
    ("block_size", {}, dict(block_size=8), {"block_size": (4, 8)}),
    ("dtype", {}, dict(dtype="bfloat16"), {"dtype": ("float32", "bfloat16"), "cache_dtype": ("float32", "bfloat16")}),
    ("kv_dtype", {}, INT8, {"kv_dtype": (None, "int8"), "cache_dtype": ("float32", "int8")}),
    ("layout", {}, dict(layout="HND"), {"layout": ("NHD", "HND")}),
    ("kv_group_size", dict(INT4, kv_group_size=8), dict(INT4, kv_group_size=4), {"kv_group_size": (8, 4)}),
    ("kv_rotation", dict(INT8, kv_rotation=True), dict(INT8, kv_rotation=False),
     {"kv_rotation": (True, False), "kv_rotation_seed": (0, None)}),
    ("kv_rotation_seed", dict(INT8, kv_rotation=True), dict(INT8, kv_rotation=True, kv_rotation_seed=1),
     {"kv_rotation_seed": (0, 1)}),
    ("kv_key_quant", INT4, dict(INT4, kv_key_quant="block"), {"kv_key_quant": ("token", "block")}),
    ("kv_full_precision_layers", dict(INT8, num_layers=3, kv_full_precision_layers=(0,)),
     dict(INT8, num_layers=3, kv_full_precision_layers=(2,)), {"kv_full_precision_layers": ([0], [2])}),
    ("tp_rank", dict(TP, tp_size=2, tp_rank=0), dict(TP, tp_size=2, tp_rank=1),
     {"kv_head_indices": ([0, 1], [2, 3])}),
    ("tp_size", dict(TP, tp_size=2), dict(TP, tp_size=4), {"kv_head_indices": ([0, 1], [0])}),
    ("prefix_disk_tag", dict(prefix_disk_tag="llama"), dict(prefix_disk_tag="qwen"), {"tag": ("llama", "qwen")}),
]
PAIR_IDS = [p[0] for p in FORMAT_PAIRS]
TOKENS = np.arange(100, 117, dtype=np.int32)        # 17 tokens: 4 full blocks of 4


def config(**over) -> CacheConfig:
    opts = dict(SHAPE, num_blocks=16)
    opts.update(over)
    return CacheConfig(**opts)


def write_prefix(cache: PagedKVCache, tokens) -> None:
    """Admit, write (in the cache's model dtype and heads), commit, free: a cached prefix."""
    cfg = cache.config
    hit = cache.add_sequence("w", tokens)
    slots = cache.reserve("w", len(tokens) - hit)
    heads = list(cfg.kv_head_indices)
    for layer in range(cfg.num_layers):
        k, v = expected_kv(tokens, layer, cfg.num_kv_heads, cfg.head_dim)
        cache.write(layer, slots, k[hit:, heads].to(cfg.torch_dtype), v[hit:, heads].to(cfg.torch_dtype))
    cache.commit("w", len(tokens) - hit)
    cache.free("w")


def snapshot(path) -> dict:
    """Every file under ``path``: name -> (size, sha256)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def disk(tmp_path, **over) -> dict:
    return dict(over, prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=8, prefix_tier_write="through")


def assert_names_every_difference(message: str, diffs: dict, written_is_theirs: bool) -> None:
    for key, (written, opened) in diffs.items():
        theirs, mine = (written, opened) if written_is_theirs else (opened, written)
        assert f"{key}={mine!r}" in message.split("got")[0], (key, message)
        assert f"{key}={theirs!r}" in message.split("got")[1], (key, message)


# ---- the classification -----------------------------------------------------------------------
def test_every_cache_config_field_is_classified_once():
    names = {f.name for f in dataclasses.fields(CacheConfig)}
    assert unclassified(CacheConfig) == ([], [])
    assert set(STORED) | set(NOT_STORED) == names
    assert not set(STORED) & set(NOT_STORED)


def test_a_field_added_without_a_classification_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Grown(CacheConfig):
        kv_new_encoding: int = 0

    assert unclassified(Grown) == (["kv_new_encoding"], [])
    grown = Grown(**dict(SHAPE, num_blocks=4))
    with pytest.raises(InternalError, match=r"CacheConfig field\(s\) \['kv_new_encoding'\] not classified "
                                            r"in pagedkv\.format\.fingerprint \(STORED or NOT_STORED\)"):
        fingerprint(grown)


def test_a_classified_name_that_no_longer_exists_is_caught(monkeypatch):
    monkeypatch.setitem(NOT_STORED, "kv_gone", "removed")
    assert unclassified(CacheConfig) == ([], ["kv_gone"])
    with pytest.raises(InternalError, match=r"classified in pagedkv\.format\.fingerprint but not CacheConfig fields: \['kv_gone'\]"):
        fingerprint(config())


@pytest.mark.parametrize("setting, a, b, diffs", FORMAT_PAIRS, ids=PAIR_IDS)
def test_each_stored_setting_changes_the_fingerprint(setting, a, b, diffs):
    assert setting in STORED
    got = {k: (t, m) for k, t, m in differences(fingerprint(config(**b)), fingerprint(config(**a)))}
    assert got == diffs


def test_layer_groups_change_the_fingerprint_and_a_tier_refuses_the_other_layout(tmp_path):
    plain = fingerprint(config(num_layers=3))
    sliding = fingerprint(config(num_layers=3, layer_windows=(0, 8, 8)))
    sinks = fingerprint(config(num_layers=3, layer_windows=(0, 8, 8), attention_sinks=4))
    keys = lambda x, y: sorted(k for k, _, _ in differences(x, y))  # noqa: E731
    assert keys(plain, sliding) == ["layer_groups", "layer_windows"]
    assert keys(sliding, sinks) == ["attention_sinks", "layer_groups"]
    with PagedKVCache(config(num_layers=3, layer_windows=(0, 8, 8), **disk(tmp_path))) as grouped:
        write_prefix(grouped, TOKENS)
    before = snapshot(tmp_path / "tier")
    with pytest.raises(TierFileError, match=r"layer_windows=None.*got .*layer_windows=\[0, 8, 8\]"):
        PagedKVCache(config(num_layers=3, **disk(tmp_path)))
    assert snapshot(tmp_path / "tier") == before


def test_settings_that_do_not_change_the_bytes_leave_the_fingerprint_alone():
    base = fingerprint(config(**INT4))
    other = fingerprint(config(**dict(INT4, num_blocks=9, eviction="priority", kv_window=8, kv_sink_tokens=4,
                                      kv_window_sequences=3, hash_seed=5, host_num_blocks=2,
                                      num_attention_heads=4, enable_kv_events=True, prefix_host_blocks=3)))
    assert other == base
    # the seed means nothing without rotation: no false refusal
    assert fingerprint(config(**INT8)) == fingerprint(config(**dict(INT8, kv_rotation_seed=9)))
    # tp_size on its own: rank 0 of 2 and of 4 on a 2-head model both hold head 0
    assert fingerprint(config(num_kv_heads=2, hash_seed=1, tp_size=2)) == \
        fingerprint(config(num_kv_heads=2, hash_seed=1, tp_size=4))


def test_a_fingerprint_survives_json():
    import json
    f = kv_format(PagedKVCache(config(**dict(INT8, num_layers=3, kv_full_precision_layers=(1,)))).store)
    assert differences(f, json.loads(json.dumps(f))) == []
    assert f["kv_rotation"] is False
    assert differences(f, dict(f, kv_rotation=0)) == [("kv_rotation", 0, False)]     # 0 is not False


# ---- over the disk tier -----------------------------------------------------------------------
@pytest.mark.parametrize("setting, a, b, diffs", FORMAT_PAIRS, ids=PAIR_IDS)
def test_a_disk_tier_written_with_other_settings_is_refused_and_left_untouched(tmp_path, setting, a, b, diffs):
    with PagedKVCache(config(**disk(tmp_path, **a))) as writer:
        write_prefix(writer, TOKENS)
    before = snapshot(tmp_path / "tier")
    assert "blocks.bin" in before
    with pytest.raises(TierFileError, match=r"meta\.json: expected a tier written for this model shape and "
                                            r"settings \(") as err:
        PagedKVCache(config(**disk(tmp_path, **b)))
    assert_names_every_difference(str(err.value), diffs, written_is_theirs=True)
    assert snapshot(tmp_path / "tier") == before
    with PagedKVCache(config(**disk(tmp_path, **a))) as again:   # its own settings still open it
        assert again.match_prefix(TOKENS) == 16


def test_repro_int8_rotation_written_then_opened_without_rotation(tmp_path):
    """The issue's repro: it hit 16 tokens and served keys off by up to 4.2."""
    with PagedKVCache(config(**disk(tmp_path, kv_dtype="int8", kv_rotation=True))) as writer:
        write_prefix(writer, TOKENS)
    before = snapshot(tmp_path / "tier")
    for other in (dict(kv_rotation=False), dict(kv_rotation=True, kv_rotation_seed=3)):
        with pytest.raises(TierFileError, match=r"kv_rotation"):
            PagedKVCache(config(**disk(tmp_path, kv_dtype="int8", **other)))
    assert snapshot(tmp_path / "tier") == before


def test_a_header_whose_kv_format_is_not_a_dict_is_refused(tmp_path):
    import json
    with PagedKVCache(config(**disk(tmp_path))) as writer:
        write_prefix(writer, TOKENS)
    meta_path = tmp_path / "tier" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for bad in ([1, 2], "int8", 7, None):
        meta_path.write_text(json.dumps(dict(meta, kv_format=bad)))
        before = snapshot(tmp_path / "tier")
        # the header's field types are checked before any comparison (tiers/disk.py)
        with pytest.raises(TierFileError, match=r"meta\.json: expected kv_format as a JSON object, got "
                           + re.escape(f"{type(bad).__name__} {bad!r}") + "$"):
            PagedKVCache(config(**disk(tmp_path)))
        assert snapshot(tmp_path / "tier") == before
