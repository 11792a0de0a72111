"""The per-layer calibration pass (pagedkv.tools.calibration) on a random-weight 2-layer model."""
import pytest
import torch
from model_fixtures import tiny  # noqa: F401

from pagedkv import CacheConfig
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.tools.calibration import choose_full_precision_layers, layer_sensitivity


def _ids(model, n=96, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


def test_sensitivity_is_per_layer_and_grows_as_precision_drops(tiny):
    model, _ = tiny
    ids = _ids(model)
    int4 = layer_sensitivity(model, ids, kv_dtype="int4", kv_window=0, chunk=32)
    int8 = layer_sensitivity(model, ids, kv_dtype="int8", chunk=32)
    assert len(int4) == len(int8) == model.config.num_hidden_layers
    for a, b in zip(int8, int4):
        assert 0.0 <= a < b  # KL >= 0; 4-bit codes lose more than 8-bit ones in every layer
    # deterministic: the same text and options measure the same values
    assert layer_sensitivity(model, ids, kv_dtype="int4", kv_window=0, chunk=32) == int4


def test_keeping_the_chosen_layer_in_model_precision_loses_less_than_quantizing_all(tiny):
    from pagedkv.tools.calibration import _log_probs

    model, _ = tiny
    ids = _ids(model, seed=5)
    sens = layer_sensitivity(model, ids, kv_dtype="int4", kv_window=0, chunk=32)
    chosen = choose_full_precision_layers(sens, 1)
    assert chosen == (max(range(len(sens)), key=sens.__getitem__),)
    make = lambda **kw: CacheConfig.from_hf_config(model.config, num_blocks=12, dtype=torch.float32, **kw)  # noqa: E731
    base = _log_probs(model, ids, make(), 32)

    def kl(cfg):
        q = _log_probs(model, ids, cfg, 32)
        return float((base.exp() * (base - q)).sum(-1).mean())

    all_q = kl(make(kv_dtype="int4", kv_window=0))
    kept = kl(make(kv_dtype="int4", kv_window=0, kv_full_precision_layers=chosen))
    assert kept < all_q


def test_choose_ranks_by_sensitivity_with_ties_to_the_lower_layer():
    assert choose_full_precision_layers([0.1, 0.5, 0.2, 0.5], 2) == (1, 3)
    assert choose_full_precision_layers([0.3, 0.3, 0.3], 1) == (0,)
    assert choose_full_precision_layers([0.1, 0.9, 0.2], 0) == ()
    assert choose_full_precision_layers((0.4, 0.1, 0.2), 2) == (0, 2)


@pytest.mark.parametrize("sens, count, match", [
    ([0.1, 0.2], 2, r"count: expected an int in \[0, 2\) \(one layer must stay quantized\), got 2"),
    ([0.1, 0.2], -1, r"count: expected an int >= 0, got -1"),
    ([], 0, r"sensitivity: expected a non-empty sequence of floats without NaN"),
    ([0.1, float("nan")], 1, r"sensitivity: expected a non-empty sequence of floats without NaN"),
    (3, 1, r"sensitivity: expected a sequence of floats \(one per layer\), got int"),
    (["a", 0.1], 1, r"sensitivity: expected a sequence of floats"),
])
def test_choose_refuses_bad_input(sens, count, match):
    with pytest.raises(InvalidArgumentError, match=match):
        choose_full_precision_layers(sens, count)


def test_sensitivity_refuses_bad_input(tiny):
    model, _ = tiny
    ids = _ids(model, n=8)
    with pytest.raises(InvalidArgumentError, match=r"kv_dtype: expected a quantized kv dtype .*got None"):
        layer_sensitivity(model, ids)
    with pytest.raises(InvalidArgumentError, match=r"kv_dtype: expected a quantized kv dtype .*got 'float16'"):
        layer_sensitivity(model, ids, kv_dtype="float16")
    with pytest.raises(InvalidArgumentError, match=r"kv_full_precision_layers: expected not given"):
        layer_sensitivity(model, ids, kv_dtype="int8", kv_full_precision_layers=(0,))
    with pytest.raises(InvalidArgumentError, match=r"input_ids: expected an int64 \(long\) torch.Tensor, got torch.int32"):
        layer_sensitivity(model, ids.int(), kv_dtype="int8")
    with pytest.raises(ShapeError, match=r"input_ids: expected shape \[1, n\] with n >= 2, got \(2, 8\)"):
        layer_sensitivity(model, ids.repeat(2, 1), kv_dtype="int8")
    with pytest.raises(ShapeError, match=r"input_ids: expected shape \[1, n\] with n >= 2, got \(1, 1\)"):
        layer_sensitivity(model, ids[:, :1], kv_dtype="int8")
    with pytest.raises(InvalidArgumentError, match=r"chunk: expected an int >= 1, got 0"):
        layer_sensitivity(model, ids, kv_dtype="int8", chunk=0)
