"""pagedkv.compat: submodules load on first use, and importing the package needs no torch."""
import subprocess
import sys

import pytest

import pagedkv.compat as compat


def test_submodules_load_on_first_use():
    assert compat.mini_vllm.KVCacheManager.__module__ == "pagedkv.compat.mini_vllm"
    assert compat.cortex.KVCache and compat.block_manager.KVCacheBlockManager
    assert compat.continuous_batching.ContinuousBatchKVCacheManager
    with pytest.raises(AttributeError, match="module 'pagedkv.compat' has no attribute 'seed000'"):
        compat.seed000


def test_package_import_does_not_import_torch():
    code = "import sys, pagedkv.compat; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
