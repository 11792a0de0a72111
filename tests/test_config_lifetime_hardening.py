"""Config and lifetime repros of issue 32: a huge layer count is a typed
OutOfMemoryError before anything per layer is built, huge numbers in a config.json are
typed, a wrong type in ``layer_windows`` is a TypeError, calibration refuses strings as
scores, a cache dropped without ``close()`` gives its tier's descriptors back, and int4
picks a default group size that divides ``head_dim``."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError

HUGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # a regression fails here, not on the machine
from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfMemoryError
cfg = CacheConfig(num_layers=int(sys.argv[1]), num_kv_heads=2, head_dim=8, num_blocks=16, dtype="float32",
                  kv_dtype=None if sys.argv[2] == "none" else sys.argv[2])
try:
    PagedKVCache(cfg)
except OutOfMemoryError as e:
    print("typed:", e)
"""


@pytest.mark.parametrize("layers", [10**9, 2**31])
@pytest.mark.parametrize("kv_dtype", ["none", "int4"])
def test_a_huge_layer_count_is_a_typed_out_of_memory_error(layers, kv_dtype):
    p = subprocess.run([sys.executable, "-c", HUGE, str(layers), kv_dtype], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    assert p.stdout.startswith("typed: num_layers: expected arenas that fit") and f"got {layers} (" in p.stdout


def test_a_config_json_with_a_6000_digit_number_is_typed(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": ' + "9" * 6000 + ', "num_attention_heads": 4, '
                    '"num_key_value_heads": 2, "hidden_size": 32}')
    with pytest.raises(InvalidArgumentError, match=r"config: expected a JSON object with numbers a model config "
                                                   r"has, got .*config\.json' \(Exceeds the limit"):
        CacheConfig.from_hf_config(str(path), num_blocks=8)


@pytest.mark.parametrize("windows", [[None, 0], ["4", 0], [4.0, 0], [True, 0], {0: None, 1: 0}], ids=repr)
def test_a_layer_window_of_the_wrong_type_is_a_type_error(windows):
    with pytest.raises(ArgumentTypeError, match=r"layer_windows: expected ints >= 0 \(0 = full attention\), "
                                                r"got .* at layer 0"):
        CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=16, layer_windows=windows)
    with pytest.raises(InvalidArgumentError, match=r"layer_windows: expected ints >= 0"):
        CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=16, layer_windows=[-1, 0])


@pytest.mark.parametrize("scores", [["1", "2"], [1.0, "2"], [True, 0.5], [None, 1.0], [b"1", 1.0]], ids=repr)
def test_calibration_refuses_scores_that_are_no_numbers(scores):
    from pagedkv.store.calibration import choose_full_precision_layers

    with pytest.raises(InvalidArgumentError, match=r"sensitivity: expected a sequence of floats \(one per layer\), "
                                                   r"got a sequence holding"):
        choose_full_precision_layers(scores, 1)
    assert choose_full_precision_layers(np.array([0.1, 0.9]), 1) == (1,)
    assert choose_full_precision_layers(torch.tensor([0.9, 0.1]), 1) == (0,)


DROPPED = """
import gc, os, sys, torch
from pagedkv import CacheConfig, PagedKVCache
def open_fds():
    return len(os.listdir("/proc/self/fd"))
def config(path):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, dtype="float32",
                       prefix_disk_dir=path, prefix_disk_blocks=8, prefix_host_blocks=4, prefix_tier_write="through")
gc.collect()
before = open_fds()
for i in range(4):
    cache = PagedKVCache(config(os.path.join(sys.argv[1], f"t{i}")))
    cache.add_sequence(0, list(range(9)))
    slots = cache.reserve(0, 9)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(9, 2, 8), torch.randn(9, 2, 8))
    cache.commit(0, 9)
    cache.free(0)
    del cache              # no close(): the garbage collector must give everything back
    gc.collect()
    print(open_fds() - before)
with PagedKVCache(config(os.path.join(sys.argv[1], "t0"))) as c:   # nothing of the dropped cache holds its lock
    print(c.match_prefix(list(range(9))))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_cache_dropped_without_close_gives_its_tier_descriptors_back(tmp_path):
    # in a child: this process's leak check keeps every cache a test makes alive
    p = subprocess.run([sys.executable, "-c", DROPPED, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    assert p.stdout.split() == ["0", "0", "0", "0", "8"]


@pytest.mark.parametrize("head_dim,group", [(72, 24), (80, 40), (96, 48), (112, 56), (128, 64), (256, 64),
                                            (64, 64), (40, 40), (36, 36), (8, 8)])
def test_int4_picks_a_default_group_that_divides_head_dim(head_dim, group):
    from pagedkv.store.dtypes import default_int4_group
    from pagedkv.store.quant import dequantize, int4_group, quantize

    assert default_int4_group(head_dim) == int4_group(head_dim, None) == group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=4,
                                         num_blocks=8, dtype="float32", kv_dtype="int4", kv_window=0,
                                         kv_sink_tokens=0))
    assert cache.config.kv_group_size == group
    g = torch.Generator().manual_seed(head_dim)
    k, v = torch.randn(6, 2, head_dim, generator=g), torch.randn(6, 2, head_dim, generator=g)
    cache.add_sequence(0, list(range(6)))
    slots = cache.reserve(0, 6)
    cache.write(0, slots, k, v)
    cache.commit(0, 6)
    gk, gv = cache.gather(0, 0)
    err = float((gk - k).abs().max())
    assert 0 < err < 0.5                                    # int4, groups of `group`, rotated
    if not cache.config.kv_rotation:
        q, s, z = quantize(k, "int4", group_size=group)
        assert torch.equal(gk, dequantize(q, s, z, torch.float32))
    ptr, idx, _ = cache.page_table_csr([0])
    tables = (torch.from_numpy(ptr), torch.from_numpy(idx), torch.tensor([6], dtype=torch.int32),
              torch.tensor([0, 1], dtype=torch.int32))
    q = torch.randn(1, 4, head_dim, generator=g)
    got = cache.attention(0, q, *tables, backend="cpu")
    want = cache.attention(0, q, *tables, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache.free(0)
