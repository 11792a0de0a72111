"""Quantized KV quality on the real model (seed 004: < 2% degradation, ~50% memory)."""
import pytest
import torch

from model_fixtures import smollm2  # noqa: F401

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "kv_quality", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kv_quality.py"))
kv_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_quality)


@pytest.mark.slow
@pytest.mark.model
def test_int8_and_fp8_kv_lose_under_two_percent_perplexity(smollm2):
    model, tok = smollm2
    ids = kv_quality.text_ids(tok, 2048)
    base, base_tokens, base_bytes = kv_quality.evaluate(model, ids, None, 1024, 512, 256)
    for kv_dtype in ("int8", "fp8_e4m3"):
        ppl, tokens, nbytes = kv_quality.evaluate(model, ids, kv_dtype, 1024, 512, 256)
        assert (ppl - base) / base < 0.02, (kv_dtype, ppl, base)
        assert (tokens == base_tokens).float().mean() > 0.9
        assert nbytes <= 0.6 * base_bytes / 2          # at most 60% of an fp16 cache (scales included)
