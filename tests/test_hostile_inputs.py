"""The hostile-input catalog (fuzz/hostile_inputs.py) run as a test: every bad input to
the public API gets a typed pagedkv error and leaves the cache unchanged, or is valid in
its position and listed (with the reason) as acceptable. Crashes, untyped errors, state
changed by a failing call and broken invariants all fail this test."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError

SCRIPT = Path(__file__).resolve().parents[1] / "fuzz" / "hostile_inputs.py"


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3", "int4", "int3", "int4 block"], ids=str)
def test_every_hostile_input_gets_a_typed_error_and_leaves_state_unchanged(kv_dtype):
    # quantized caches too: their writes and gathers run other loops, and their scale,
    # zero-point, block-key and window arenas are part of the state a failing call must not change
    name, _, key_quant = (kv_dtype or "").partition(" ")
    extra = (["--kv-dtype", name] if name else []) + (["--kv-key-quant", key_quant] if key_quant else [])
    p = subprocess.run([sys.executable, str(SCRIPT)] + extra, capture_output=True, text=True, timeout=600)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert summary["failures"] == 0
    assert summary["inputs"] >= 600 and summary["verdicts"]["typed"] >= 600


def test_cache_pool_is_read_only_for_callers():
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=8))
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.reserve(0, 5)
    held = cache.block_table(0)
    before = (cache.pool.ref_cnt.tolist(), cache.pool.num_free_blocks)
    assert len(held) == 2 and before[1] == 6
    with pytest.raises(InvalidArgumentError, match=r"cache.pool: expected read-only use .*got a call to pool.free"):
        cache.pool.free(held)
    with pytest.raises(InvalidArgumentError, match=r"got a call to pool.allocate"):
        cache.pool.allocate(1)
    assert (cache.pool.ref_cnt.tolist(), cache.pool.num_free_blocks) == before
    cache.free(0)
