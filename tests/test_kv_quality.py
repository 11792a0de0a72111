"""Quantized KV quality on the real model (SmolLM2-135M float32), on the corpus's test
slice (:data:`pagedkv.testing.corpus.TEST_SLICE`, tokens 12,000 - 14,047): text that no
calibration reads and that the benchmark's held-out slices do not overlap (the corpus
module lists who reads what). The protocol is the benchmark's (1,024-token windows,
stride 512, chunks of 256, against float32 ``DynamicCache``), through the gather path.
"""
import pytest

from model_fixtures import smollm2  # noqa: F401
from pagedkv.tools.calibration import calibrate, kv_divergence
from pagedkv.testing import corpus
from pagedkv.testing.quality import Variant, evaluate

BLOCK5 = dict(kv_dtype="int4", kv_key_quant="block", kv_window=0)       # 5-bit block keys, sink 4
BLOCK4 = dict(BLOCK5, kv_key_bits=4)


def _slice(tok, n=None):
    start, tokens = corpus.TEST_SLICE
    return corpus.text_ids(tok, n or tokens, start=start)


def _pct(q, name, base="gather"):
    return q[(name, base)].summary()


@pytest.mark.slow
@pytest.mark.model
def test_int8_and_fp8_kv_lose_under_two_percent_perplexity(smollm2):
    model, tok = smollm2
    todo = [Variant(n, dict(kv_dtype=n)) for n in ("int8", "fp8_e4m3")]
    q = evaluate(model, _slice(tok), todo, paths=("gather",))
    for v in todo:
        s = _pct(q, v.name)
        assert s["perplexity_increase_pct"] < 2.0 and s["top1_agreement"] > 0.9, (v.name, s)
        assert v.sizes(model)["bits_per_element"] <= 0.6 * 16  # at most 60% of fp16, scales included


@pytest.mark.slow
@pytest.mark.model
def test_int4_rotated_with_window_stays_close_to_fp32_and_beats_unrotated(smollm2):
    # 512 tokens fed in chunks of 128: three of four chunks attend to KV read back from the
    # cache; a window of 32 leaves most of it in 4-bit codes
    model, tok = smollm2
    rotated = Variant("rotated", dict(kv_dtype="int4", kv_window=32))
    unrotated = Variant("unrotated", dict(kv_dtype="int4", kv_window=32, kv_rotation=False))
    q = evaluate(model, _slice(tok, 512), [rotated, unrotated], window=512, stride=512, chunk=128, paths=("gather",))
    r, u = _pct(q, "rotated"), _pct(q, "unrotated")
    # stated bound: a 32-token window over 512 tokens is the hard case, most of the
    # context being 4-bit; the issue's protocol (long text) is the benchmark's
    assert abs(r["perplexity_increase_pct"]) < 8 and r["kl_nats"] < 0.07 and r["top1_agreement"] >= 0.8, r
    # the rotation is what buys it: the same codes without it lose measurably more
    assert r["kl_nats"] < 0.7 * u["kl_nats"], (r, u)
    assert rotated.sizes(model)["bits_per_element"] <= 5.0


@pytest.mark.slow
@pytest.mark.model
def test_issue_goals_hold_on_the_test_slice(smollm2):
    model, tok = smollm2
    todo = [Variant("int8", dict(kv_dtype="int8")),
            Variant("fp8_rot", dict(kv_dtype="fp8_e4m3", kv_rotation=True)),
            Variant("int4_w0", dict(kv_dtype="int4", kv_window=0)),
            Variant("int3_w0", dict(kv_dtype="int3", kv_window=0)),
            Variant("block4", dict(BLOCK4)),
            Variant("block5", dict(BLOCK5)),
            Variant("block5_nosink", dict(BLOCK5, kv_sink_tokens=0))]
    q = evaluate(model, _slice(tok), todo, paths=("gather",))
    s = {v.name: _pct(q, v.name) for v in todo}
    rel = {n: x["perplexity_increase_pct"] for n, x in s.items()}
    kl = {n: x["kl_nats"] for n, x in s.items()}
    bits = {v.name: v.sizes(model) for v in todo}
    assert rel["int8"] <= 0.07 and kl["int8"] < 2e-4, s
    assert rel["fp8_rot"] <= 0.3, s
    assert rel["int4_w0"] <= 1.0 and bits["int4_w0"]["bits_per_element"] <= 5.0, s
    # 3-bit is kept only within 3%; its bfloat16 parameters make it 4 bits per element
    assert rel["int3_w0"] <= 3.0 and bits["int3_w0"]["bits_per_element"] <= 4.0, s
    # more bits lose less, by KL (the perplexity delta of a near-lossless format is noise)
    assert kl["int8"] < kl["fp8_rot"] < kl["int4_w0"] < kl["int3_w0"], s
    # keys per channel over each full block lose much less than per-token int4, for one
    # more bit per element (the bfloat16 parameters of blocks of 16) ...
    assert kl["block4"] < 0.7 * kl["int4_w0"] and bits["block4"]["bits_per_element"] <= 6.0, s
    # ... and their fifth bit, kept where the sealed rows' per-token parameters were,
    # takes a large share of what is left, for no byte more
    assert kl["block5"] < 0.7 * kl["block4"], s
    assert bits["block5"] == bits["block4"], bits
    # the issue's 0.1% goal at <= 7 bits per element, every byte counted (the float32
    # sink and staging rows, in a 1,024-token sequence; 6.25 bits at 4,096 tokens), within
    # two standard errors of this 2,048-token slice: measured +0.16% here, -0.02% +- 0.05
    # on the first 3,072 tokens of each of the issue's slices (docs/low-bit.md)
    se5 = s["block5"]["perplexity_increase_se_pct"]
    assert rel["block5"] <= 0.1 + 2 * se5, ("block5", rel["block5"], se5)
    assert bits["block5"]["bits_per_element_at"]["1024"] <= 7.001 and \
        bits["block5"]["bits_per_element_at"]["8192"] < 6.2, bits
    # the first tokens kept exact (default 4) take a large share, by KL and top-1
    assert kl["block5"] < 0.8 * kl["block5_nosink"] and \
        s["block5"]["top1_agreement"] > s["block5_nosink"]["top1_agreement"], s


@pytest.mark.slow
@pytest.mark.model
def test_the_calibration_is_deterministic_and_its_choice_holds_on_text_it_did_not_see(smollm2):
    model, tok = smollm2
    texts = corpus.calibration_texts(tok, pieces=2)     # 2 x 512 tokens, apart from the test slice
    # every other layer: half the passes (this is CI's longest test), and the ones a full
    # calibration ranks first (20, 18, 10, 24: docs/low-bit.md) are among them
    cal = calibrate(model, texts, 1, candidates=range(0, model.config.num_hidden_layers, 2), **BLOCK5)
    tried = sorted((v, layer) for layer, v in enumerate(cal.steps[0]) if v is not None)
    best, runner_up = tried[0][1], tried[1][1]
    assert cal.layers == (best,) and cal.kl == tried[0][0] < cal.kl_quantized
    # deterministic: the same texts give the same figures, whatever the candidates
    again = calibrate(model, texts, 1, candidates=[runner_up, best], **BLOCK5)
    assert again.layers == cal.layers
    assert again.steps[0][best] == cal.steps[0][best] and again.steps[0][runner_up] == cal.steps[0][runner_up]
    assert again.kl_quantized == cal.kl_quantized
    # on the test slice, which it did not see: keeping the chosen layer saves a good share
    # of the loss, and no less than keeping the runner-up does (within the noise of
    # 2,048 tokens: 5%)
    unseen = [_slice(tok)]
    none = kv_divergence(model, unseen, **BLOCK5)
    chosen = kv_divergence(model, unseen, kv_full_precision_layers=cal.layers, **BLOCK5)
    other = kv_divergence(model, unseen, kv_full_precision_layers=(runner_up,), **BLOCK5)
    assert chosen < 0.9 * none, (chosen, none, cal)
    assert chosen <= 1.05 * other, (chosen, other, cal)
