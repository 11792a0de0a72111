"""PagedCache over MLA latent rows: tiny random-weight DeepSeek-V3, DeepSeek-V2 and
GLM-4-MoE-Lite (transformers caches their latent: ``update(kv_nope, k_rot)``) give
greedy output identical to DynamicCache at batch 1, in a left-padded batch, with beams,
and after a prefix hit; what is not supported is refused when the cache is built."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.support import UnsupportedCombinationError
from pagedkv.errors import ShapeError
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.batches import left_pad
from pagedkv.testing.mla_models import MLA_MODELS


def paged(model, num_blocks=256, block_size=4, **over) -> PagedKVCache:
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=block_size,
                                     dtype=torch.float32, shuffle_free_blocks=3, **over)
    return PagedKVCache(cfg)


@pytest.fixture(scope="module", params=sorted(MLA_MODELS))
def mla_model(request):
    return MLA_MODELS[request.param]()


def test_the_cache_holds_one_latent_row_per_token(mla_model):
    model, _ = mla_model
    kv = paged(model)
    c = model.config
    assert (kv.config.kv_lora_rank, kv.config.qk_rope_head_dim) == (c.kv_lora_rank, c.qk_rope_head_dim)
    assert kv.config.bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4


def test_greedy_matches_dynamic_cache_batch_one(mla_model):
    model, _ = mla_model
    kv = paged(model)
    ids = torch.randint(3, 250, (1, 17), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        cache.admit(ids)
        out = model.generate(ids, past_key_values=cache, **gen)
        assert cache.forward_tokens == 17 + 15
    assert out.tolist() == ref.tolist()
    assert len(set(out[0, 17:].tolist())) > 1


def test_greedy_matches_dynamic_cache_with_left_padding(mla_model):
    model, tok = mla_model
    kv = paged(model)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (11, 19, 4)]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=12, do_sample=False, attention_mask=mask)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        cache.admit(ids, mask)
        out = model.generate(ids, past_key_values=cache, **gen)
    assert out.tolist() == ref.tolist()


def test_beam_search_matches_dynamic_cache(mla_model):
    model, _ = mla_model
    kv = paged(model)
    ids = torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    gen = dict(max_new_tokens=6, num_beams=3, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        out = model.generate(ids, past_key_values=cache, **gen)
    assert out.tolist() == ref.tolist()


def test_a_prefix_hit_skips_the_shared_prefill_and_gives_the_same_output(mla_model):
    model, _ = mla_model
    kv = paged(model)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 250, (1, 14), generator=g)
    first = torch.cat([system, torch.randint(3, 250, (1, 5), generator=g)], dim=1)
    second = torch.cat([system, torch.randint(3, 250, (1, 6), generator=g)], dim=1)
    gen = dict(max_new_tokens=10, do_sample=False)
    with PagedCache(kv) as cache:
        cache.admit(first)
        model.generate(first, attention_mask=torch.ones_like(first), past_key_values=cache, **gen)
    with PagedCache(kv) as cache:
        assert cache.admit(second).tolist() == [12]      # three full blocks of the system prompt
        out = model.generate(second, attention_mask=torch.ones_like(second), past_key_values=cache, **gen)
        assert cache.forward_tokens == second.shape[1] - 12 + 9
    ref = model.generate(second, attention_mask=torch.ones_like(second),
                         past_key_values=DynamicCache(config=model.config), **gen)
    assert out.tolist() == ref.tolist()
    assert kv.stats().hit_tokens == 12


def test_paged_attention_is_refused_when_the_cache_is_built():
    model, _ = MLA_MODELS["deepseek_v3"]()
    kv = paged(model)
    with pytest.raises(UnsupportedCombinationError, match=r"paged attention \(attention\): .*MLA latent KV"):
        PagedCache(kv, paged_attention=True)


def test_expanded_heads_are_a_typed_error_not_a_crash():
    model, _ = MLA_MODELS["deepseek_v3"]()
    kv = paged(model)
    with PagedCache(kv) as cache:
        with pytest.raises(ShapeError, match=r"key_states: expected the latent kv_nope \[batch, 1, tokens, 128\]"):
            cache.update(torch.zeros(1, 4, 3, 32), torch.zeros(1, 4, 3, 32), 0)
        assert len(kv) == 0 or kv.seq_lens(cache.seq_ids).tolist() == [0]   # the pass was undone
