"""PagedCache (a transformers Cache over PagedKVCache) against DynamicCache.

Real-model tests use SmolLM2-135M-Instruct in float32: with exact float32 K/V in
the arena, paged attention must reproduce DynamicCache's greedy ids and logits
(up to summation order). Fast protocol tests use the tiny random Llama.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pagedkv.manager.cache import PagedKVCache
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.batches import left_pad

from model_fixtures import (PROMPTS, chat_ids, perplexity_ids, prefill_decode_logits,  # noqa: F401
                            sliding_window_perplexity, smollm2, tiny)

BLOCK = 16


def make_kv(model, num_blocks=256, block_size=BLOCK, shuffle=7, **kw) -> PagedKVCache:
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=block_size,
                                     dtype=torch.float32, shuffle_free_blocks=shuffle, **kw)
    return PagedKVCache(cfg)



class ForwardCounter:
    """Counts the token columns fed to the model (prefill and decode)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.shape[1])

    def close(self):
        self.handle.remove()


def assert_all_free(kv: PagedKVCache):
    kv.check_invariants()
    assert len(kv) == 0
    assert kv.stats().allocated_blocks == 0


# ---- real model --------------------------------------------------------------------

@pytest.mark.model
def test_greedy_ids_match_dynamic_cache(smollm2):
    model, tok = smollm2
    kv = make_kv(model)
    for prompt in PROMPTS:
        ids = torch.tensor([chat_ids(tok, prompt)])
        gen = dict(max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
        ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
        with PagedCache(kv) as cache:
            cache.admit(ids)
            out = model.generate(ids, past_key_values=cache, **gen)
            table = kv.block_table(cache.seq_ids[0])
            assert len(table) == -(-(out.shape[1] - 1) // BLOCK)
        assert out.tolist() == ref.tolist(), (tok.decode(out[0]), tok.decode(ref[0]))
    assert_all_free(kv)


@pytest.mark.model
def test_logits_prefill_and_decode_match(smollm2):
    model, tok = smollm2
    kv = make_kv(model)
    ids = torch.tensor([chat_ids(tok, PROMPTS[2])])
    ref = prefill_decode_logits(model, ids, DynamicCache(config=model.config), steps=8)
    with PagedCache(kv) as cache:
        got = prefill_decode_logits(model, ids, cache, steps=8)
        table = kv.block_table(cache.seq_ids[0])
        # blocks come from a shuffled free list: physically out of order
        assert (np.diff(table) != 1).any(), table
        assert kv.num_tokens(cache.seq_ids[0]) == ids.shape[1] + 8
    diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
    assert max(diffs) < 1e-5, diffs
    assert_all_free(kv)


@pytest.mark.model
def test_left_padded_batch_matches_dynamic_cache(smollm2):
    model, tok = smollm2
    kv = make_kv(model)
    rows = [chat_ids(tok, p, system=None) for p in ["Hi!", PROMPTS[1], "Name three prime numbers larger than ten."]]
    ids, mask = left_pad(rows, tok.pad_token_id)
    assert len({len(r) for r in rows}) == 3
    gen = dict(max_new_tokens=16, do_sample=False, attention_mask=mask, pad_token_id=tok.pad_token_id)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        hits = cache.admit(ids, mask)
        assert hits.tolist() == [0, 0, 0]
        before = kv.stats().allocated_blocks
        out = model.generate(ids, past_key_values=cache, **gen)
        # padding never took a slot: each row holds exactly its own tokens
        lens = kv.seq_lens(cache.seq_ids, computed=True)
        assert lens.tolist() == [len(r) + 15 for r in rows]
        assert kv.stats().allocated_blocks - before == sum(-(-int(n) // BLOCK) for n in lens)
    assert out.tolist() == ref.tolist()
    assert_all_free(kv)


@pytest.mark.model
def test_prefix_sharing_skips_the_shared_prefill(smollm2):
    model, tok = smollm2
    kv = make_kv(model)
    first = torch.tensor([chat_ids(tok, PROMPTS[0])])
    second = torch.tensor([chat_ids(tok, PROMPTS[2])])
    common = next(i for i, (a, b) in enumerate(zip(first[0].tolist(), second[0].tolist())) if a != b)
    shared = common // BLOCK * BLOCK
    assert shared >= 32, "the system prompt spans at least two full blocks"
    gen = dict(max_new_tokens=8, do_sample=False)

    with PagedCache(kv, cache_salt="tenant-a") as cache:
        assert cache.admit(first).tolist() == [0]
        model.generate(first, attention_mask=torch.ones_like(first), past_key_values=cache, **gen)

    counter = ForwardCounter(model)
    try:
        with PagedCache(kv, cache_salt="tenant-a") as cache:
            assert cache.admit(second).tolist() == [shared]
            assert cache.get_seq_length() == shared
            out = model.generate(second, attention_mask=torch.ones_like(second), past_key_values=cache, **gen)
            assert cache.forward_tokens == second.shape[1] - shared + 7
        assert counter.tokens == second.shape[1] - shared + 7   # prefill without the prefix, 7 decodes
        counter.tokens = 0
        with PagedCache(kv, cache_salt="tenant-b") as cache:   # another namespace shares nothing
            assert cache.admit(second).tolist() == [0]
            other = model.generate(second, attention_mask=torch.ones_like(second), past_key_values=cache, **gen)
        assert counter.tokens == second.shape[1] + 7
    finally:
        counter.close()
    ref = model.generate(second, attention_mask=torch.ones_like(second),
                         past_key_values=DynamicCache(config=model.config), **gen)
    assert out.tolist() == ref.tolist() == other.tolist()
    assert kv.stats().hit_tokens >= shared
    assert_all_free(kv)


@pytest.mark.model
def test_batch_with_partial_prefix_hits(smollm2):
    # Rows hit different amounts: the common hit is skipped, each row's extra hit
    # tokens are recomputed but not rewritten, and the ids still match.
    model, tok = smollm2
    kv = make_kv(model)
    warm = torch.tensor([chat_ids(tok, PROMPTS[0])])
    with PagedCache(kv) as cache:
        cache.admit(warm)
        model(warm, past_key_values=cache)
    rows = [chat_ids(tok, PROMPTS[1]), chat_ids(tok, "Hello", system="Be brief.")]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=8, do_sample=False, attention_mask=mask, pad_token_id=tok.pad_token_id)
    with PagedCache(kv) as cache:
        hits = cache.admit(ids, mask)
        assert hits[0] >= 32 and hits[1] == 0
        out = model.generate(ids, past_key_values=cache, **gen)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    assert out.tolist() == ref.tolist()
    assert_all_free(kv)


@pytest.mark.model
@pytest.mark.slow
def test_perplexity_matches_dynamic_cache(smollm2, record_property):
    model, tok = smollm2
    kv = make_kv(model, num_blocks=160)
    ids = perplexity_ids(tok)
    ref = sliding_window_perplexity(model, ids, make_cache=lambda: DynamicCache(config=model.config))
    # chunks of 256: three of every four chunks attend to KV read back from the blocks
    got = sliding_window_perplexity(model, ids, make_cache=lambda: PagedCache(kv), chunk=256,
                                    on_window_done=lambda cache: cache.release())
    record_property("ppl_dynamic", ref)
    record_property("ppl_paged", got)
    assert abs(got - ref) / ref < 1e-4, (got, ref)
    assert 5 < ref < 30  # SmolLM2-135M on Python's pydoc topics: about 11.7
    assert_all_free(kv)


# ---- protocol, on the tiny model ---------------------------------------------------

def test_tiny_logits_match_with_chunked_prefill(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=32, block_size=4)
    ids = torch.tensor([tok.encode("paged attention reads blocks in any order")])
    with torch.no_grad():
        ref = model(ids, past_key_values=DynamicCache(config=model.config)).logits
        with PagedCache(kv) as cache:
            parts = [model(ids[:, s:s + 5], past_key_values=cache).logits for s in range(0, ids.shape[1], 5)]
            assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=0, atol=1e-5)
    assert_all_free(kv)


def test_lazy_rows_without_admit(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=32, block_size=4)
    ids = torch.tensor([tok.encode("abc"), tok.encode("xyz")])
    cache = PagedCache(kv)
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert len(cache.seq_ids) == 2 and cache.get_seq_length() == 4
    assert kv.seq_lens(cache.seq_ids, computed=True).tolist() == [4, 4]
    cache.release()
    assert_all_free(kv)


def test_select_drives_a_ragged_batch(tiny):
    # An engine's view: sequences of different lengths decoded in one batched forward.
    model, tok = tiny
    kv = make_kv(model, num_blocks=64, block_size=4)
    prompts = [tok.encode("one"), tok.encode("a longer second prompt")]
    cache = PagedCache(kv)
    refs = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            kv.add_sequence(i, p)
            ids = torch.tensor([p])
            mask, pos = cache.select([i], num_new_tokens=len(p))
            cache.set_input_ids(ids)
            model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            full = torch.tensor([p + [65]])
            refs.append(model(full).logits[0, -1])
        mask, pos = cache.select([0, 1])
        assert mask.tolist()[0][:len(prompts[1]) - len(prompts[0])] == [0] * (len(prompts[1]) - len(prompts[0]))
        assert pos[:, 0].tolist() == [len(p) for p in prompts]
        nxt = torch.tensor([[65], [65]])
        cache.set_input_ids(nxt)
        out = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(out, torch.stack(refs), rtol=0, atol=1e-5)
    assert kv.token_ids(1).tolist() == prompts[1] + [65]  # decode ids committed
    cache.release()
    assert len(kv) == 2  # select() does not take ownership
    kv.free([0, 1])
    assert_all_free(kv)


def test_num_return_sequences_forks_rows(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=64, block_size=4)
    ids = torch.tensor([tok.encode("fork me, please")])
    with PagedCache(kv) as warm:  # cache the prompt's full blocks
        warm.admit(ids)
        with torch.no_grad():
            model(ids, past_key_values=warm)
    gen = dict(max_new_tokens=5, do_sample=True, num_return_sequences=3, attention_mask=torch.ones_like(ids))
    torch.manual_seed(0)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    torch.manual_seed(0)
    with PagedCache(kv) as cache:
        assert cache.admit(ids).tolist() == [12]
        out = model.generate(ids, past_key_values=cache, **gen)
        assert len(cache.seq_ids) == 3  # the admitted row was forked for each return sequence
        tables = [kv.block_table(s) for s in cache.seq_ids]
        assert all((t[:3] == tables[0][:3]).all() for t in tables)  # the cached prefix is shared
    assert out.tolist() == ref.tolist()
    assert_all_free(kv)


def test_beam_search_matches_dynamic_cache(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=128, block_size=4)
    ids = torch.tensor([tok.encode("beams")])
    gen = dict(max_new_tokens=6, num_beams=3, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        out = model.generate(ids, past_key_values=cache, **gen)
    assert out.tolist() == ref.tolist()
    assert_all_free(kv)


def test_admit_rejects_right_padding(tiny):
    model, _ = tiny
    kv = make_kv(model, num_blocks=8, block_size=4)
    cache = PagedCache(kv)
    ids = torch.tensor([[5, 6, 7], [5, 6, 0]])
    with pytest.raises(InvalidArgumentError, match=r"attention_mask: expected left padding .*got row 1: \[1, 1, 0\]"):
        cache.admit(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ShapeError, match=r"attention_mask: expected shape \(2, 3\), got \(2, 2\)"):
        cache.admit(ids, torch.ones(2, 2))
    assert len(kv) == 0


def test_admit_twice_is_refused(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=8, block_size=4)
    with PagedCache(kv) as cache:
        cache.admit(torch.tensor([tok.encode("ab")]))
        with pytest.raises(InvalidArgumentError, match="admit: expected a PagedCache without rows"):
            cache.admit(torch.tensor([tok.encode("ab")]))
        cache.crop(0)
    assert_all_free(kv)


@pytest.mark.parametrize("paged", [False, True], ids=["gather", "paged-attention"])
def test_select_prefills_rows_of_different_lengths_in_one_forward(tiny, paged):
    # A batched prefill: row 0 has a cached prefix and a short new part, row 1 a whole
    # prompt; each row's last logits equal its prompt run alone.
    from pagedkv.integrations import hf_attention

    model, tok = tiny
    if paged:
        model.set_attn_implementation(hf_attention.register())
    kv = make_kv(model, num_blocks=64, block_size=4)
    first = tok.encode("a shared beginning of the prompt")
    prompts = [first + tok.encode(" and more"), tok.encode("an entirely different and longer prompt here")]
    cache = PagedCache(kv, paged_attention=paged)
    try:
        with torch.no_grad():
            kv.add_sequence(9, first)           # an earlier request leaves `first` cached
            ids = torch.tensor([first])
            mask, pos = cache.select([9], len(first))
            cache.set_input_ids(ids)
            model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            kv.free(9)
            hits = [kv.add_sequence(i, p) for i, p in enumerate(prompts)]
            assert hits[0] > 0 and hits[1] == 0
            new = [len(p) - h for p, h in zip(prompts, hits)]
            q = max(new)
            batch = torch.zeros(2, q, dtype=torch.long)
            for i, p in enumerate(prompts):
                tail = p[max(0, len(p) - q):]
                batch[i, q - len(tail):] = torch.tensor(tail)
            mask, pos = cache.select([0, 1], new)
            assert pos[1].tolist() == list(range(q)) and pos[0, -1].item() == len(prompts[0]) - 1
            assert mask.shape == (2, max(len(p) for p in prompts))
            cache.set_input_ids(batch)
            out = model(batch, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
            refs = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
        torch.testing.assert_close(out, refs, rtol=0, atol=1e-5)
        assert kv.token_ids(0).tolist() == prompts[0] and kv.token_ids(1).tolist() == prompts[1]
        with pytest.raises(ShapeError, match=r"num_new_tokens: expected an int or 2 counts \(one per row\), got 3"):
            cache.select([0, 1], [1, 1, 1])
        with pytest.raises(InvalidArgumentError, match=r"num_new_tokens: expected counts >= 1, got \[1, 0\]"):
            cache.select([0, 1], [1, 0])
    finally:
        cache.release()
        kv.free([s for s in (0, 1) if s in kv])
        if paged:
            model.set_attn_implementation("sdpa")
    assert_all_free(kv)


def test_select_refuses_to_orphan_admitted_rows(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=8, block_size=4)
    with PagedCache(kv) as cache:
        cache.admit(torch.tensor([tok.encode("ab")]))
        with pytest.raises(InvalidArgumentError, match="select: expected a PagedCache without admitted rows"):
            cache.select(cache.seq_ids)
    assert_all_free(kv)


def test_batch_mismatch_is_a_shape_error(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=16, block_size=4)
    with PagedCache(kv) as cache:
        cache.admit(torch.tensor([tok.encode("ab"), tok.encode("cd")]))
        with pytest.raises(ShapeError, match="key_states: expected batch 2"):
            with torch.no_grad():
                model(torch.tensor([[1, 2], [3, 4], [5, 6]]), past_key_values=cache)
    assert_all_free(kv)


def test_requires_a_store(tiny):
    model, _ = tiny
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=8, dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="kv: expected a PagedKVCache with a KV store"):
        PagedCache(PagedKVCache(cfg, allocate_store=False))
    with pytest.raises(InvalidArgumentError, match="kv: expected a PagedKVCache, got dict"):
        PagedCache({})


def test_out_of_blocks_leaves_cache_usable(tiny):
    model, tok = tiny
    kv = make_kv(model, num_blocks=2, block_size=4)
    cache = PagedCache(kv)
    with pytest.raises(MemoryError):
        with torch.no_grad():
            model(torch.tensor([tok.encode("far too long for two blocks")]), past_key_values=cache)
    cache.release()
    assert_all_free(kv)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int3", "fp8_e4m3"])
def test_quantized_cache_returns_the_pass_own_kv_exactly_and_history_from_the_arena(kv_dtype):
    # Attention over the tokens of the current pass sees their K/V as computed (as in
    # serving engines and HF's QuantizedCache); earlier tokens are read back quantized.
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=16, block_size=4,
                      dtype=torch.float32, kv_dtype=kv_dtype, kv_window=0)
    kv = PagedKVCache(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with PagedCache(kv) as cache:
        cache.admit(ids, mask)
        first = [(torch.randn(2, 2, 5, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g)) for _ in range(2)]
        for layer, (k, v) in enumerate(first):
            ok, ov = cache.update(k, v, layer)
            torch.testing.assert_close(ok[1], k[1], rtol=0, atol=0)    # all new: exact
            torch.testing.assert_close(ok[0, :, 2:], k[0, :, 2:], rtol=0, atol=0)
            assert not ok[0, :, :2].any() and not ov[0, :, :2].any()  # left padding stays zero
            torch.testing.assert_close(ov[0, :, 2:], v[0, :, 2:], rtol=0, atol=0)
        step = [(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)) for _ in range(2)]
        for layer, (k, v) in enumerate(step):
            ok, ov = cache.update(k, v, layer)
            assert ok.shape == (2, 2, 6, 32)
            torch.testing.assert_close(ok[:, :, -1:], k, rtol=0, atol=0)
            torch.testing.assert_close(ov[:, :, -1:], v, rtol=0, atol=0)
            hist_k, hist_v = first[layer]
            # history: the arena's dequantized values, close to but not equal to the originals
            assert not torch.equal(ok[1, :, :5], hist_k[1])
            atol = 1.3 if kv_dtype == "int3" else 0.6  # int3's step is 15/7 of int4's
            torch.testing.assert_close(ok[1, :, :5], hist_k[1], rtol=0, atol=atol)
            torch.testing.assert_close(ov[1, :, :5], hist_v[1], rtol=0, atol=atol)
            assert not ok[0, :, :2].any()


def test_window_holds_the_tokens_before_each_pass_exactly():
    # With kv_window=W every query of a pass sees the W tokens before the pass exact (the
    # read happens before the pass writes over the window), the pass's own tokens as
    # computed, and only older tokens dequantized.
    W = 3
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=16, block_size=4,
                      dtype=torch.float32, kv_dtype="int4", kv_window=W, kv_sink_tokens=0)
    kv = PagedKVCache(cfg)
    g = torch.Generator().manual_seed(2)
    seen = [[], []]  # per layer: every token's K as computed, in order
    with PagedCache(kv) as cache:
        cache.admit(torch.arange(7).view(1, 7), torch.ones(1, 7, dtype=torch.long))
        for q in (7, 4, 1, 5):
            for layer in range(2):
                k = torch.randn(1, 2, q, 32, generator=g)
                ok, _ = cache.update(k, k.clone(), layer)
                before = sum(t.shape[1] for t in seen[layer])
                seen[layer].append(k[0])
                truth = torch.cat(seen[layer], dim=1)
                assert ok.shape == (1, 2, before + q, 32)
                lo = max(0, before - W)
                torch.testing.assert_close(ok[0, :, lo:], truth[:, lo:], rtol=0, atol=0)
                if lo:
                    assert not torch.equal(ok[0, :, :lo], truth[:, :lo])   # older: dequantized
                    torch.testing.assert_close(ok[0, :, :lo], truth[:, :lo], rtol=0, atol=1.5)
    assert_all_free(kv)
