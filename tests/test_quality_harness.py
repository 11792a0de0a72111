"""The quality harness (pagedkv.testing.quality) and the corpus map, on the tiny model:
the figures the benchmark publishes are computed as documented."""
import math

import pytest
import torch

from model_fixtures import tiny  # noqa: F401
from pagedkv.errors import InvalidArgumentError
from pagedkv.testing import corpus
from pagedkv.testing.quality import PATHS, Stats, Variant, evaluate, greedy


def _ids(model, n, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_lossless_cache_matches_the_baseline_through_both_paths_and_a_lossy_one_does_not(tiny):
    model, _ = tiny
    ids = _ids(model, 96)
    todo = [Variant("fp32"), Variant("int4", dict(kv_dtype="int4", kv_window=0, kv_rotation=False))]
    q = evaluate(model, ids, todo, window=64, stride=32, chunk=16)
    assert set(q) == {(v.name, p) for v in todo for p in PATHS}
    for p in PATHS:
        exact, lossy = q[("fp32", p)].summary(), q[("int4", p)].summary()
        # windows of 64, stride 32: every position but the first is scored exactly once
        assert exact["positions"] == lossy["positions"] == 95
        # float rounding only (paged attention sums in another order than SDPA)
        assert exact["kl_nats"] < 1e-7 and exact["top1_agreement"] == 1.0
        assert abs(exact["perplexity_increase_pct"]) < 1e-3
        assert lossy["kl_nats"] > 1e-6 and lossy["kl_nats"] > 20 * exact["kl_nats"]
    # the attention implementation is put back
    assert model.config._attn_implementation != "pagedkv"


def test_paths_are_checked(tiny):
    model, _ = tiny
    with pytest.raises(InvalidArgumentError, match=r"^paths: expected names among \('gather', 'paged'\), got 'sdpa'$"):
        evaluate(model, _ids(model, 8), [Variant("fp32")], paths=("sdpa",))


def test_summary_is_the_paired_mean_and_its_standard_error():
    d = torch.tensor([0.01, -0.02, 0.03, 0.0], dtype=torch.float64)
    k = torch.tensor([1e-3, 2e-3, 0.0, 1e-3], dtype=torch.float64)
    st = Stats([d[:2], d[2:]], [k[:2], k[2:]], [torch.tensor([True, False]), torch.tensor([True, True])])
    s = st.summary()
    assert s["positions"] == 4 and s["top1_agreement"] == 0.75
    assert s["perplexity_increase_pct"] == round(100 * math.expm1(0.005), 4)
    assert s["perplexity_increase_se_pct"] == round(100 * float(d.std()) / 2, 4)
    assert s["kl_nats"] == 1e-3 and s["kl_se"] == float(f"{float(k.std()) / 2:.2g}")
    pooled = (st + st).summary()
    assert pooled["positions"] == 8 and pooled["perplexity_increase_pct"] == s["perplexity_increase_pct"]


def test_greedy_baseline_and_lossless_cache_agree(tiny):
    model, _ = tiny
    prompts = [_ids(model, 20, seed=1)]
    base = greedy(model, prompts, None, 6)
    assert base.shape == (1, 6)
    for p in PATHS:
        assert torch.equal(greedy(model, prompts, Variant("fp32"), 6, p), base)


def test_held_out_slices_overlap_nothing_that_tests_or_calibration_read():
    read = [corpus.TEST_SLICE, corpus.DEV_SLICE, (0, 11_192), (11_392, 512), (20_000, 1_900), (30_000, 44_800),
            (90_000, 64)] + [(s, corpus.CALIBRATION_TOKENS) for s in corpus.CALIBRATION]
    spans = sorted(corpus.HELD_OUT.values())
    for (a, n), (b, m) in zip(spans, spans[1:]):
        assert a + n <= b
    for start, n in corpus.HELD_OUT.values():
        for s, k in read:
            assert start + n <= s or s + k <= start, ((start, n), (s, k))
