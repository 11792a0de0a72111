"""PagedCache with recurrent-state layers (Mamba, Mamba2, Gated DeltaNet, short
convolutions) against each model's own cache: tiny random models of the families
transformers runs on a CPU, greedy output identical at batch 1 and in a left-padded
batch, and after a prefix hit that restores a state snapshot."""
from __future__ import annotations

import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.support import UnsupportedCombinationError
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.batches import left_pad
from pagedkv.testing.state_models import STATE_MODELS, state_config

BS = 4
#: families whose greedy output matches the model's own cache, hits included
WORKING = ["mamba2", "falcon_mamba", "bamba", "granitemoehybrid", "falcon_h1", "jamba", "nemotron_h",
           "zamba2", "qwen3_next", "qwen3_5", "lfm2"]
_models: dict = {}


def model_of(family):
    if family not in _models:
        _models[family] = STATE_MODELS[family]()[0].eval()
    return _models[family]


def make_kv(model, **kw):
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=64, block_size=BS, dtype=torch.float32,
                                     state_slots=24, **kw)
    return PagedKVCache(cfg)



def own(model, ids, mask=None, n=4):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def paged(model, kv, ids, mask=None, n=4, prefill=False):
    """(output, hit tokens per row) of greedy generation through a PagedCache."""
    with PagedCache(kv) as cache, torch.no_grad():
        hits = cache.admit(ids, mask)
        if prefill:
            cache.prefill(model, ids, mask)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False)
    return out, hits


@pytest.mark.parametrize("family", WORKING)
def test_greedy_equals_the_models_own_cache_with_prefix_hits(family):
    model = model_of(family)
    kv = make_kv(model)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, 256, (1, 12), generator=g)      # 12 tokens: ends exactly on a block boundary
    out, hits = paged(model, kv, a, prefill=True)          # snapshots at 8 (prefill's end) and 12
    assert hits.tolist() == [0]
    assert torch.equal(out, own(model, a))
    # the same prompt continued: a hit at the boundary the first prompt ended on
    b = torch.cat([a, torch.randint(3, 256, (1, 5), generator=g)], 1)
    out, hits = paged(model, kv, b, prefill=True)
    assert hits.tolist() == [12]
    assert torch.equal(out, own(model, b))
    # a prompt of 9 tokens hits at 8 (the snapshot prefill() kept): far shorter than a state page
    c = torch.cat([a[:, :8], torch.randint(3, 256, (1, 1), generator=g)], 1)
    out, hits = paged(model, kv, c)
    assert hits.tolist() == [8]
    assert torch.equal(out, own(model, c))
    assert kv.stats().states.snapshots >= 3
    # a left-padded batch: rows resume at one column (12 and 4 pads + 8 hit tokens)
    rows = [b[0, :13].tolist(), a[0, :8].tolist() + [7]]
    ids, mask = left_pad(rows)
    out, hits = paged(model, kv, ids, mask)
    assert hits.tolist() == [12, 8]
    assert torch.equal(out, own(model, ids, mask))



@pytest.mark.parametrize("family", WORKING)
def test_beam_search_equals_the_models_own_cache(family):
    # generate() repeats the prompt per beam and reorders the rows at every step: forks
    # whose states are copied on write, and partial blocks copied (none with K/V on a
    # pure Mamba model, which once broke the copy)
    model = model_of(family)
    kv = make_kv(model)
    a = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    gen = dict(max_new_tokens=5, do_sample=False, num_beams=3)
    with torch.no_grad():
        ref = model.generate(a, **gen)
    with PagedCache(kv) as cache, torch.no_grad():
        cache.admit(a)
        out = model.generate(a, past_key_values=cache, **gen)
    assert torch.equal(out, ref)

def test_a_kv_only_hit_is_cut_back_to_the_newest_snapshot():
    model = model_of("qwen3_5")
    kv = make_kv(model, state_checkpoint_every=1)
    a = torch.randint(3, 256, (1, 17), generator=torch.Generator().manual_seed(2))
    paged(model, kv, a, prefill=True)                    # snapshots at 4 (every block) ... 16
    snaps = kv._groups.snapshots
    snaps.remove(next(s for s in snaps.snapshots() if len(s.tokens) == 16))
    out, hits = paged(model, kv, a)
    assert hits.tolist() == [12]                         # the chain holds 16 tokens, the states 12
    assert torch.equal(out, own(model, a))


def test_a_snapshot_of_another_prefix_gives_other_output():
    # negative control: put the states of another prompt in the snapshot a hit restores
    # and the output changes (so the identity test above can fail)
    model = model_of("qwen3_5")
    g = torch.Generator().manual_seed(3)
    a, other = torch.randint(3, 256, (1, 17), generator=g), torch.randint(3, 256, (1, 17), generator=g)
    kv = make_kv(model, state_checkpoint_every=1)
    paged(model, kv, a, prefill=True)
    kv2 = make_kv(model, state_checkpoint_every=1)
    paged(model, kv2, other, prefill=True)
    snap = next(s for s in kv._groups.snapshots.snapshots() if len(s.tokens) == 16)
    wrong = next(s for s in kv2._groups.snapshots.snapshots() if len(s.tokens) == 16)
    for name in ("conv", "ssm"):
        kv.state_arena(name)[:, snap.slot] = kv2.state_arena(name)[:, wrong.slot]
    out, hits = paged(model, kv, a, n=8)
    assert hits.tolist() == [16]
    assert not torch.equal(out, own(model, a, n=8))


def test_minimax_is_refused_naming_the_layer_type():
    with pytest.raises(UnsupportedCombinationError, match="linear_attention"):
        CacheConfig.from_hf_config(state_config("minimax"), num_blocks=8, state_slots=4)


def test_kimi_linear_hits_where_one_token_is_left():
    # transformers' Kimi-Linear cannot run a pass of several tokens over cached columns
    # (its own DynamicCache fails the same way): a hit that leaves one token to compute works
    model = model_of("kimi_linear")
    kv = make_kv(model)
    a = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    out, hits = paged(model, kv, a)
    assert hits.tolist() == [0]
    assert torch.equal(out, own(model, a))
    b = torch.cat([a, torch.tensor([[9]])], 1)
    out, hits = paged(model, kv, b)
    assert hits.tolist() == [12]
    assert torch.equal(out, own(model, b))


def test_an_unknown_family_with_state_layers_is_refused_naming_the_layer_type():
    src = dict(model_type="not_a_family", num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
               layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UnsupportedCombinationError, match="'linear_attention' of model_type 'not_a_family'"):
        CacheConfig.from_hf_config(src, num_blocks=8, state_slots=4)
    src["model_type"], src["layer_types"] = "qwen3_5", ["linear_attention", "cross_attention"]
    with pytest.raises(UnsupportedCombinationError, match="'cross_attention' at index 1"):
        CacheConfig.from_hf_config(src, num_blocks=8, state_slots=4)


def test_state_tensors_read_from_the_config():
    cfg = CacheConfig.from_hf_config(state_config("qwen3_5"), num_blocks=8, state_slots=4)
    assert cfg.layer_kinds == ("state", "attention", "state") and cfg.num_layers == 1
    # Gated DeltaNet: conv over q, k (2 x 2 heads x 8) and v (4 heads x 8); a [4, 8, 8] delta state
    assert [(t.name, t.shape) for t in cfg.state_spec.tensors] == [("conv", (64, 4)), ("ssm", (4, 8, 8))]
    cfg = CacheConfig.from_hf_config(state_config("mamba2"), num_blocks=8, state_slots=4)
    assert cfg.num_layers == 0 and cfg.layer_kinds == ("state",) * 3
