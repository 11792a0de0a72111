"""The per-layer calibration pass (pagedkv.tools.calibration) on a random-weight 2-layer model."""
import pytest
import torch
from model_fixtures import tiny  # noqa: F401

from pagedkv import CacheConfig
from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError
from pagedkv.tools.calibration import calibrate, choose_full_precision_layers, kv_divergence, layer_sensitivity


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


# ---- calibrate(): end-to-end KL ----------------------------------------------------------
@pytest.fixture(scope="module")
def planted():
    """A 4-layer random Llama whose layer 2 has an outlier value channel: ``v_proj`` scales
    it 50x and ``o_proj`` reads it back 1/50x, so the model computes the same thing, but
    a 4-bit code of that layer's values loses far more than anywhere else."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.testing.models import ByteTokenizer

    tok = ByteTokenizer()
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg).eval()
    attn = model.model.layers[2].self_attn
    with torch.no_grad():
        for kv_head in range(2):
            attn.v_proj.weight[16 * kv_head + 5] *= 50.0
        for q_head in range(4):      # GQA: query head h reads KV head h // 2
            attn.o_proj.weight[:, 16 * q_head + 5] /= 50.0
    return model


def _texts(model, pieces=3, n=48):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, model.config.vocab_size, (1, n), generator=g) for _ in range(pieces)]


LOWBIT = dict(kv_dtype="int4", kv_window=0, chunk=16)


def test_calibrate_keeps_the_layer_whose_precision_buys_the_most_end_to_end(planted):
    texts = _texts(planted)
    cal = calibrate(planted, texts, 1, **LOWBIT)
    assert cal.layers == cal.order == (2,)
    assert cal.texts == 3 and cal.tokens == 3 * 48 and cal.wins == (3,)
    assert dict(cal.options) == dict(kv_dtype="int4", kv_window=0)
    assert cal.overrides() == dict(kv_dtype="int4", kv_window=0, kv_full_precision_layers=(2,))
    # every figure is the end-to-end KL of the configuration it names, measured on its own
    assert cal.kl_quantized == pytest.approx(kv_divergence(planted, texts, **LOWBIT), rel=1e-6)
    for layer in (0, 2):
        assert cal.steps[0][layer] == pytest.approx(
            kv_divergence(planted, texts, kv_full_precision_layers=(layer,), **LOWBIT), rel=1e-6)
    assert cal.kl == cal.steps[0][2] == min(cal.steps[0]) < cal.kl_quantized
    assert cal.margins[0] > 0
    # deterministic: the same model, texts and options choose the same, with the same figures
    assert calibrate(planted, texts, 1, **LOWBIT) == cal


def test_calibrate_chooses_greedily_and_within_the_candidates(planted):
    texts = _texts(planted, pieces=2)
    cal = calibrate(planted, texts, 2, **LOWBIT)
    assert cal.order[0] == 2 and len(cal.layers) == 2 and cal.layers == tuple(sorted(cal.order))
    assert cal.steps[1][2] is None          # chosen at step 0: not tried again
    other = cal.order[1]
    assert cal.steps[1][other] == min(v for v in cal.steps[1] if v is not None) == cal.kl
    assert cal.kl <= cal.steps[0][2]
    # candidates restrict the choice (negative indices count from the end)
    restricted = calibrate(planted, texts, 1, candidates=[0, -1], **LOWBIT)
    assert restricted.layers[0] in (0, 3)
    assert restricted.steps[0][1] is None and restricted.steps[0][2] is None
    # a shortlist: the steps after the first try only the first step's best candidates
    short = calibrate(planted, texts, 2, shortlist=2, **LOWBIT)
    first = sorted(range(4), key=lambda i: (short.steps[0][i], i))[:2]
    assert short.order[0] == 2 and set(short.layers) == set(first)
    assert [i for i, v in enumerate(short.steps[1]) if v is not None] == [i for i in first if i != 2]
    assert short.steps[0] == cal.steps[0]
    none = calibrate(planted, texts, 0, **LOWBIT)
    assert none.layers == () and none.steps == () and none.kl == none.kl_quantized == cal.kl_quantized


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(texts="abc"), ArgumentTypeError, r"texts: expected a \[1, n\] int64 tensor or a non-empty sequence "
                                           r"of them, got str$"),
    (dict(texts=[]), ArgumentTypeError, r"texts: expected .*, got list$"),
    (dict(texts=[[1, 2, 3]]), ArgumentTypeError, r"texts\[0\]: expected an int64 \(long\) torch.Tensor, got list$"),
    (dict(texts=[torch.zeros(1, 8, dtype=torch.int32)]), DTypeError, r"texts\[0\]: .*got torch.int32$"),
    (dict(texts=[torch.zeros(1, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)]), ShapeError,
     r"texts\[1\]: expected shape \[1, n\] with n >= 2, got \(2, 8\)$"),
    (dict(texts=[torch.full((1, 8), 10**6, dtype=torch.long)]), InvalidArgumentError,
     r"texts\[0\]: expected token ids in \[0, \d+\) \(the model's vocabulary\), got 1000000 at position 0$"),
    (dict(candidates=["1", 2]), ArgumentTypeError,
     r"candidates: expected a sequence of distinct layer indices in \[-4, 4\), got '1'$"),
    (dict(candidates=[1.0]), ArgumentTypeError, r"candidates: .*got 1.0$"),
    (dict(candidates=[True]), ArgumentTypeError, r"candidates: .*got True$"),
    (dict(candidates=3), ArgumentTypeError, r"candidates: .*got int$"),
    (dict(candidates=[4]), InvalidArgumentError, r"candidates: .*got 4$"),
    (dict(candidates=[1, -3]), InvalidArgumentError, r"candidates: .*got -3$"),
    (dict(count=2, candidates=[1]), InvalidArgumentError,
     r"count: expected an int in \[0, 2\) \(at most the 1 candidates; one layer must stay quantized\), got 2$"),
    (dict(count=4), InvalidArgumentError, r"count: expected an int in \[0, 4\) .*got 4$"),
    (dict(count=1.0), ArgumentTypeError, r"count: expected an int >= 0, got 1.0$"),
    (dict(count=-1), InvalidArgumentError, r"count: expected an int >= 0, got -1$"),
    (dict(chunk=0), InvalidArgumentError, r"chunk: expected an int >= 1, got 0$"),
    (dict(count=2, shortlist=1), InvalidArgumentError, r"shortlist: expected None or an int >= count \(2\), got 1$"),
    (dict(shortlist=2.0), ArgumentTypeError, r"shortlist: expected an int >= 1, got 2.0$"),
    (dict(kv_full_precision_layers=(1,)), InvalidArgumentError, r"kv_full_precision_layers: expected not given"),
    (dict(kv_dtype=None), InvalidArgumentError, r"kv_dtype: expected a quantized kv dtype .*got None$"),
    (dict(kv_window_sequences=2), InvalidArgumentError, r"kv_window_sequences: expected not given"),
    (dict(kv_window=-1), InvalidArgumentError, r"kv_window: expected an int >= 0, got -1$"),
])
def test_calibrate_refuses_bad_input_before_any_pass(planted, kwargs, err, match):
    args = dict(texts=_texts(planted, pieces=1, n=8), count=1, kv_dtype="int4", kv_window=0)
    args.update(kwargs)
    if args["kv_dtype"] is None:
        del args["kv_dtype"]
    with pytest.raises(err, match=match):
        calibrate(planted, args.pop("texts"), args.pop("count"), **args)


def test_calibrate_refuses_what_is_not_a_model():
    with pytest.raises(ArgumentTypeError, match=r"model: expected a transformers causal LM"):
        calibrate(object(), torch.zeros(1, 4, dtype=torch.long), kv_dtype="int4")


@pytest.mark.parametrize("keep, err", [(("1",), ArgumentTypeError), ((1.5,), ArgumentTypeError),
                                       ((9,), InvalidArgumentError), ((1, 1), InvalidArgumentError),
                                       (1, ArgumentTypeError)])
def test_kv_divergence_refuses_bad_layers(planted, keep, err):
    with pytest.raises(err, match=r"kv_full_precision_layers: expected a sequence of distinct layer indices"):
        kv_divergence(planted, _texts(planted, pieces=1, n=8), kv_full_precision_layers=keep, **LOWBIT)
