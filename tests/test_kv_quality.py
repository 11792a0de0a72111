"""Quantized KV quality on the real model, on text the benchmark does not use (tokens
from 12,000 on; ``benchmarks/kv_quality.py`` reads the first 8,192 and its greedy
prompts end before 11,200)."""
import importlib.util
import os

import pytest

from model_fixtures import smollm2  # noqa: F401

_spec = importlib.util.spec_from_file_location(
    "kv_quality", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kv_quality.py"))
kv_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_quality)
Variant = kv_quality.Variant

HELD_OUT = 12_000
CALIBRATION = 8_192 + 3_200    # the benchmark's calibration text (after its greedy prompts)


@pytest.mark.slow
@pytest.mark.model
def test_int8_and_fp8_kv_lose_under_two_percent_perplexity(smollm2):
    model, tok = smollm2
    ids = kv_quality.text_ids(tok, 2048, start=HELD_OUT)
    todo = [Variant(n, dict(kv_dtype=n)) for n in ("int8", "fp8_e4m3")]
    q = kv_quality.evaluate(model, ids, todo, 1024, 512, 256)
    base = q["float32"]["perplexity"]
    for v in todo:
        assert (q[v.name]["perplexity"] - base) / base < 0.02, (v.name, q[v.name], base)
        assert q[v.name]["top1"] > 0.9
        assert v.sizes(model)["bytes_per_element"] <= 0.6 * 2  # at most 60% of fp16, scales included


@pytest.mark.slow
@pytest.mark.model
def test_int4_rotated_with_window_stays_close_to_fp32_and_beats_unrotated(smollm2):
    # 512 tokens fed in chunks of 128: three of four chunks attend to KV read back from the
    # cache; a window of 32 leaves most of it in 4-bit codes
    model, tok = smollm2
    ids = kv_quality.text_ids(tok, 512, start=HELD_OUT)
    rotated = Variant("rotated", dict(kv_dtype="int4", kv_window=32))
    unrotated = Variant("unrotated", dict(kv_dtype="int4", kv_window=32, kv_rotation=False))
    q = kv_quality.evaluate(model, ids, [rotated, unrotated], 512, 512, 128)
    base = q["float32"]["perplexity"]
    rel = (q["rotated"]["perplexity"] - base) / base
    # stated bound (measured here: +5.5% perplexity, KL 0.047 nats, top-1 84%; without the
    # rotation KL 0.110): a 32-token window over 512 tokens is the hard case, most of the
    # context being 4-bit; the issue's protocol (window 128, long text) is the benchmark's
    assert abs(rel) < 0.08, q
    assert q["rotated"]["kl"] < 0.07 and q["rotated"]["top1"] >= 0.8, q
    # the rotation is what buys it: the same codes without it lose measurably more
    assert q["rotated"]["kl"] < 0.7 * q["unrotated"]["kl"], q
    assert rotated.sizes(model)["bits_per_element"] <= 5.0


@pytest.mark.slow
@pytest.mark.model
def test_issue_goals_hold_on_held_out_text(smollm2):
    # The issue-11 goals, checked on 2,048 tokens the benchmark never reads (1,024-token
    # windows, stride 512, chunks of 256: three of four chunks read KV back from the arena).
    model, tok = smollm2
    ids = kv_quality.text_ids(tok, 2048, start=HELD_OUT)
    todo = [Variant("int8", dict(kv_dtype="int8")),
            Variant("fp8_rot", dict(kv_dtype="fp8_e4m3", kv_rotation=True)),
            Variant("int4_w0", dict(kv_dtype="int4", kv_window=0)),
            Variant("int3_w0", dict(kv_dtype="int3", kv_window=0)),
            Variant("int4_block_w0", dict(kv_dtype="int4", kv_window=0, kv_key_quant="block")),
            Variant("int4_block_w128", dict(kv_dtype="int4", kv_window=128, kv_key_quant="block")),
            Variant("int4_block_w128_nosink", dict(kv_dtype="int4", kv_window=128, kv_key_quant="block",
                                                    kv_sink_tokens=0)),
            # plus the layer a calibration pass (on text outside this slice) ranks most sensitive
            Variant("int4_block_w128_cal1", kv_quality.calibrated(
                dict(kv_dtype="int4", kv_window=128, kv_key_quant="block",
                     kv_full_precision_layers=kv_quality.CALIBRATED_1), model,
                kv_quality.text_ids(tok, 512, start=CALIBRATION)))]
    q = kv_quality.evaluate(model, ids, todo, 1024, 512, 256)
    base = q["float32"]["perplexity"]
    rel = {v.name: 100 * (q[v.name]["perplexity"] - base) / base for v in todo}
    assert rel["int8"] <= 0.07 and q["int8"]["kl"] < 2e-4, (rel, q)
    assert rel["fp8_rot"] <= 0.3, (rel, q)
    assert rel["int4_w0"] <= 1.0 and todo[2].sizes(model)["bits_per_element"] <= 5.0, (rel, q)
    # 3-bit is kept only within 3%; its bfloat16 parameters make it 4 bits per element
    assert rel["int3_w0"] <= 3.0 and todo[3].sizes(model)["bits_per_element"] <= 4.0, (rel, q)
    # more bits lose less, by KL (the perplexity delta of a near-lossless format is noise)
    assert q["int8"]["kl"] < q["fp8_rot"]["kl"] < q["int4_w0"]["kl"] < q["int3_w0"]["kl"], q
    # keys per channel over each full block lose much less than per-token int4, for one
    # more bit per element (the bfloat16 parameters of blocks of 16)
    assert q["int4_block_w0"]["kl"] < 0.7 * q["int4_w0"]["kl"] and rel["int4_block_w0"] < rel["int4_w0"], (rel, q)
    assert todo[4].sizes(model)["bits_per_element"] <= 6.0
    # the first tokens kept exact (default 4) take a large share of what is left, by KL
    # and top-1 (the perplexity delta at this level is noise of either sign: -0.03% without
    # the sink, +0.13% with it, here; +0.35% and +0.11% on the benchmark's slice)
    assert q["int4_block_w128"]["kl"] < 0.8 * q["int4_block_w128_nosink"]["kl"], q
    assert q["int4_block_w128"]["top1"] > q["int4_block_w128_nosink"]["top1"], q
    # the issue's 0.1% goal for 4-bit with a window of 128, with one calibrated layer in
    # model precision
    assert rel["int4_block_w128_cal1"] <= 0.1 and q["int4_block_w128_cal1"]["kl"] < q["int4_block_w128"]["kl"], (
        rel, q)
    assert len(todo[7].overrides["kv_full_precision_layers"]) == 1
