"""The paged path reads what the gather path reads (one definition of what a read returns).

``PagedCache(paged_attention=True)`` writes a pass's K/V first and attends over the
pages; the gather path reads the pages first and overlays the pass's K/V. Both must
read the pass's own rows at model precision (issue 33: the paged path read a 256-token
chunk's own tokens back quantized, 4-8x the gather path's KL). So for every KV format
their logits agree to float rounding over a multi-chunk prefill and decode, padded
batches included; and on SmolLM2 greedy through the paged path agrees with the gather
path at least as often as the gather path agrees with float32 KV.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations import hf_attention
from pagedkv.integrations.transformers import PagedCache
from pagedkv.manager.cache import PagedKVCache

from model_fixtures import smollm2, tiny  # noqa: F401

hf_attention.register()

FORMATS = {
    "int8": dict(kv_dtype="int8"),
    "int4_blockkeys_sink_window": dict(kv_dtype="int4", kv_key_quant="block", kv_window=8, kv_sink_tokens=4),
    "int4_window0": dict(kv_dtype="int4", kv_window=0, kv_sink_tokens=0),
    "int3_window": dict(kv_dtype="int3", kv_window=8),
    "int2_kivi_window_sinks": dict(kv_dtype="int2", kv_window=8, kv_sink_tokens=4),
    "fp8_e4m3_rotated": dict(kv_dtype="fp8_e4m3", kv_rotation=True),
    "float32": dict(),
}


def make_kv(model, **kw) -> PagedKVCache:
    return PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=128, block_size=4, dtype=torch.float32,
                                                   shuffle_free_blocks=3, **kw))


class paged_impl:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(hf_attention.NAME)

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)


@torch.no_grad()
def chunked_logits(model, cache, ids, mask, chunk, steps):
    """Logits of a prefill fed ``chunk`` columns at a time, then ``steps`` greedy steps."""
    cache.admit(ids, mask)
    out = []
    for s in range(0, ids.shape[1], chunk):
        out.append(model(ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk], past_key_values=cache).logits)
    for _ in range(steps):
        nxt = out[-1][:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        out.append(model(nxt, attention_mask=mask, past_key_values=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_paged_and_gather_paths_give_the_same_logits(tiny, fmt):
    """A padded batch prefilled in chunks of 16 (each attends to its own 16 tokens and
    to earlier ones read from the pages), then decode steps."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 45), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :13] = 0
    logits = {}
    for paged in (False, True):
        kv = make_kv(model, **FORMATS[fmt])
        ctx = paged_impl(model) if paged else torch.no_grad()
        with ctx, PagedCache(kv, paged_attention=paged) as cache:
            logits[paged] = chunked_logits(model, cache, ids, mask, 16, 6)
        assert len(kv) == 0
    real = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], dim=1).bool()
    a, b = logits[False][real], logits[True][real]
    torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)


def test_the_cache_refuses_a_quantized_read_of_the_pass_rows_without_them(tiny):
    """kv.attention on a quantized layer needs the pass's K/V (or pending=0 for queries
    whose rows are committed): reading them back quantized would differ from the gather."""
    model, _ = tiny
    kv = make_kv(model, kv_dtype="int8")
    kv.add_sequence("a")
    slots = kv.reserve("a", 6)
    k = torch.randn(6, 2, 16)
    kv.write(0, slots, k, -k)
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens, qp = np.array([6], np.int32), np.array([0, 2], np.int32)
    q = torch.randn(2, 4, 16)
    with pytest.raises(InvalidArgumentError, match=r"k_new: expected the pass's own K/V \(k_new, v_new\) for a "
                                                   r"quantized layer: the rows a forward pass wrote are read at "
                                                   r"model precision; pending=0 .*, got None"):
        kv.attention(0, q, indptr, indices, lens, qp)
    with pytest.raises(InvalidArgumentError, match=r"pending: expected zeros \[B\] without k_new and v_new"):
        kv.attention(0, q, indptr, indices, lens, qp, pending=np.array([1]))
    committed = kv.attention(0, q, indptr, indices, lens, qp, pending=np.array([0]))
    fresh = kv.attention(0, q, indptr, indices, lens, qp, k_new=k[4:], v_new=-k[4:])
    assert committed.shape == fresh.shape == q.shape
    assert float((committed - fresh).abs().max()) > 0     # int8 rows are not the computed ones
    kv.commit("a", 6, list(range(6)))
    kv.free("a")


@pytest.mark.model
def test_smollm2_greedy_through_the_paged_path_agrees_with_the_gather_path(smollm2):
    """Prompts of ~600 tokens from pydoc text the quality measurements do not use (the
    issue: int4 through the paged path diverged at token 0-2 where the gather path held
    for 16), prefilled in one pass, then 16 greedy tokens: for int8 and int4 (block keys,
    sink 4, window 128), the paged path's tokens equal the gather path's at least as
    often as the gather path's equal float32 KV's."""
    from pydoc_data.topics import topics

    model, tok = smollm2
    text = "\n\n".join(topics[k] for k in sorted(topics))
    toks = tok(text, add_special_tokens=False)["input_ids"]
    prompts = torch.tensor([toks[12_288 + 700 * i:12_288 + 700 * i + 600] for i in range(3)])
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)

    def run(paged, **kw):
        kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=160, block_size=16,
                                                     dtype=torch.float32, **kw))
        ctx = paged_impl(model) if paged else torch.no_grad()
        with ctx, PagedCache(kv, paged_attention=paged) as cache:
            return model.generate(prompts, past_key_values=cache, **gen)[:, prompts.shape[1]:]

    fp32 = model.generate(prompts, past_key_values=DynamicCache(config=model.config), **gen)[:, prompts.shape[1]:]
    for kw in (dict(kv_dtype="int8"), dict(kv_dtype="int4", kv_key_quant="block", kv_window=128, kv_sink_tokens=4)):
        gathered, paged = run(False, **kw), run(True, **kw)
        gather_vs_fp32 = float((gathered == fp32).float().mean())
        paged_vs_gather = float((paged == gathered).float().mean())
        assert paged_vs_gather >= gather_vs_fp32, (kw, paged_vs_gather, gather_vs_fp32)


def test_a_gather_by_sequence_reads_committed_rows_of_a_quantized_layer_only(tiny):
    """Rows reserved and written but not committed are the pass's own: a quantized layer
    holds them quantized, so gathering them is refused; committed rows read as stored."""
    model, _ = tiny
    for fmt, refused in (("int8", True), (None, False)):
        kv = make_kv(model, **({"kv_dtype": fmt} if fmt else {}))
        kv.add_sequence("a")
        slots = kv.reserve("a", 6)
        k = torch.randn(6, 2, 16)
        for layer in range(2):
            kv.write(layer, slots, k, -k)
        kv.commit("a", 4)
        if refused:
            with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most the committed tokens of a "
                                                           r"quantized layer's sequence .*, got 6 tokens of 'a', 4 "
                                                           r"committed"):
                kv.gather("a", 0)
        else:
            assert torch.equal(kv.gather("a", 0)[0], k)
        got, _ = kv.gather("a", 1, num_tokens=4)      # the committed rows
        assert got.shape[0] == 4
        kv.commit("a", 2)
        assert kv.gather("a", 1)[0].shape[0] == 6
        kv.free("a")


def test_a_prefill_chunk_reads_its_own_rows_as_computed():
    """chunked_prefill's chunk.gather(layer, k, v): the committed context from the cache,
    the chunk's own rows as computed; without them a quantized cache refuses."""
    from pagedkv.sched.prefill import chunked_prefill
    from pagedkv.sched.chunking import ChunkPolicy

    kv = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=16,
                                  dtype="float32", kv_dtype="int8"))
    gen = torch.Generator().manual_seed(0)
    k_all = torch.randn(10, 2, 16, generator=gen)
    seen = []

    def forward(chunk):
        k = k_all[chunk.start:chunk.end]
        kv.write(0, chunk.slot_mapping, k, -k)
        if chunk.start:
            with pytest.raises(InvalidArgumentError, match="num_tokens: expected at most the committed tokens"):
                chunk.gather(0)
        got, gotv = chunk.gather(0, k, -k)
        assert got.shape[0] == chunk.end and torch.equal(got[chunk.start:], k)
        seen.append(got[:chunk.start].clone())
        return torch.zeros(3)

    chunked_prefill(kv, "p", np.arange(10), forward, policy=ChunkPolicy.fixed(4))
    assert len(seen) == 3 and seen[0].shape[0] == 0
    stored = kv.gather("p", 0)[0]                   # committed: the int8 rows
    assert torch.equal(seen[2], stored[:8]) and not torch.equal(stored[:8], k_all[:8])
    kv.free("p")
