"""The window arena is allocated up front; the planner, the stats and a warning say when
it costs more than quantizing the blocks saves (issue 26: int4's default window for 16
sequences is a 112.6 MiB float32 arena, more than a small int8 cache in all)."""
import warnings

import pytest

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.planner import plan_config

SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def test_a_window_bigger_than_the_saving_is_reported_and_warned():
    cfg = CacheConfig(**SMOL, num_blocks=64, kv_dtype="int4", kv_window_sequences=16)
    assert cfg.window_bytes > cfg.quantization_saving_bytes > 0
    assert "costs more than int4 saves on 64 blocks" in cfg.window_note
    plan = plan_config(cfg)
    assert plan.window_bytes == cfg.window_bytes and plan.note == cfg.window_note
    assert "warning         the window arena" in plan.format()
    with pytest.warns(RuntimeWarning, match=r"pagedkv: the window arena \(.* for kv_window=128, kv_sink_tokens=4, "
                                             r"kv_window_sequences=16\) costs more than int4 saves"):
        kv = PagedKVCache(cfg)
    assert kv.stats().window_bytes == cfg.window_bytes
    assert "window arena" in kv.stats().describe()


def test_a_window_that_pays_for_itself_is_reported_but_not_warned():
    cfg = CacheConfig(**SMOL, num_blocks=4096, kv_dtype="int4", kv_window_sequences=16)
    assert 0 < cfg.window_bytes < cfg.quantization_saving_bytes
    assert cfg.window_note is None and plan_config(cfg).note is None
    assert "window arena" in plan_config(cfg).format()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PagedKVCache(CacheConfig(**dict(SMOL, num_layers=2), num_blocks=4096, kv_dtype="int4",
                                 kv_window_sequences=2))
    plain = CacheConfig(**SMOL, num_blocks=64)
    assert plain.window_bytes == 0 and plain.quantization_saving_bytes == 0 and plain.window_note is None
