"""The "pagedkv" attention registered in transformers: a PagedCache(paged_attention=True)
only writes, the attention reads the pages. Greedy ids must equal DynamicCache + SDPA
in float32 (the arena holds the exact K/V; only the summation order differs)."""
from __future__ import annotations

import pytest
import torch
from model_fixtures import PROMPTS, chat_ids, smollm2, tiny  # noqa: F401
from transformers import DynamicCache

from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations import hf_attention
from pagedkv.integrations.transformers import PagedCache
from pagedkv.manager.cache import PagedKVCache
from pagedkv.testing.batches import left_pad

hf_attention.register()


def make_kv(model, **kw) -> PagedKVCache:
    return PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=256, block_size=16, dtype=torch.float32,
                                                   shuffle_free_blocks=7, **kw))


class paged_impl:
    """Run the model with the registered attention, then give it back its own."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(hf_attention.NAME)

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)



def test_tiny_padded_batch_greedy_matches_and_update_only_writes(tiny):
    model, _ = tiny
    gen_t = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 40), generator=gen_t)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :3] = 0
    gen = dict(max_new_tokens=20, do_sample=False, attention_mask=mask, pad_token_id=0)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    kv = make_kv(model)
    with paged_impl(model), PagedCache(kv, paged_attention=True) as cache:
        cache.admit(ids, mask)
        calls = []
        real = kv.gather_pages
        kv.gather_pages = lambda *a, **k: calls.append(1) or real(*a, **k)
        out = model.generate(ids, past_key_values=cache, **gen)
        del kv.gather_pages
    assert calls == []                       # nothing gathered
    assert out.tolist() == ref.tolist()
    assert len(kv) == 0


def test_other_attention_with_a_paged_cache_is_refused(tiny):
    model, _ = tiny
    kv = make_kv(model)
    ids = torch.randint(3, 200, (1, 12))
    with PagedCache(kv, paged_attention=True) as cache:     # the model runs SDPA
        with pytest.raises(InvalidArgumentError, match="attn_implementation: expected 'pagedkv'"):
            model(ids, past_key_values=cache)
    assert len(kv) == 0


def test_paged_attention_flag_is_typed(tiny):
    model, _ = tiny
    with pytest.raises(InvalidArgumentError, match="paged_attention: expected True or False, got 1"):
        PagedCache(make_kv(model), paged_attention=1)


@pytest.mark.model
@pytest.mark.parametrize("kw", [{}, dict(kv_dtype="int8")], ids=["fp32", "int8"])
def test_smollm2_greedy_matches_dynamic_cache(smollm2, kw):
    model, tok = smollm2
    rows = [chat_ids(tok, p) for p in PROMPTS]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=24, do_sample=False, attention_mask=mask, pad_token_id=tok.pad_token_id)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    kv = make_kv(model, **kw)
    with paged_impl(model), PagedCache(kv, paged_attention=True) as cache:
        cache.admit(ids, mask)
        out = model.generate(ids, past_key_values=cache, **gen)
    if not kw:
        assert out.tolist() == ref.tolist()
    else:   # int8 KV: the gather path's tokens (same arena, same rows)
        with PagedCache(make_kv(model, **kw)) as cache:
            cache.admit(ids, mask)
            gathered = model.generate(ids, past_key_values=cache, **gen)
        agree = (out == gathered).float().mean().item()
        assert agree > 0.9, agree
    assert len(kv) == 0


SLIDING = {"mistral": "tiny_mistral", "gemma2": "tiny_gemma2", "gemma3": "tiny_gemma3", "qwen2": "tiny_qwen2"}


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_models_read_their_groups_pages_with_no_gather(name):
    """Sliding-window layer groups: each layer reads its group's pages (a sliding group
    holds only its window, so prompts longer than the window release blocks), padded
    batch, greedy ids equal to DynamicCache + SDPA."""
    from pagedkv.testing import sliding_models

    build = getattr(sliding_models, SLIDING[name], None)
    if build is None:
        pytest.fail(f"pagedkv.testing.sliding_models has no {SLIDING[name]}")
    model, tok = build(window=8)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (23, 11, 30)]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=20, do_sample=False, attention_mask=mask, pad_token_id=tok.pad_token_id)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=256, block_size=4, dtype=torch.float32,
                                                 shuffle_free_blocks=5))
    assert kv.config.layer_groups is not None
    with paged_impl(model), PagedCache(kv, paged_attention=True) as cache:
        cache.admit(ids, mask)
        calls = []
        real = kv.gather_pages
        kv.gather_pages = lambda *a, **k: calls.append(1) or real(*a, **k)
        out = model.generate(ids, past_key_values=cache, **gen)
        del kv.gather_pages
        sliding = [i for i, grp in enumerate(kv.config.layer_groups.groups) if grp.window]
        assert all(kv.released_tokens(cache.seq_ids, group=i).max() > 0 for i in sliding)
    assert calls == []
    assert out.tolist() == ref.tolist()
    assert len(kv) == 0
