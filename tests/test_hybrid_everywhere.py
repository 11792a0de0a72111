"""Hybrid (sliding-window) models through every capability, end to end with transformers.

Four tiny families (random weights, seeded): Mistral (every layer slides), Gemma 2
(alternating sliding/full, attention logit soft-capping and a ``query_pre_attn_scalar``
that both change its output), Gemma 3 (5 sliding : 1 full) and Qwen2 (upper layers
slide). Prompts are longer than the window (8) so sliding groups release blocks, and
blocks of 3 tokens leave partial blocks. Every case compares ``PagedCache`` with
``DynamicCache`` (or with the model run without a cache, or with the single-process
run) in three modes: the gather path, ``paged_attention=True`` (the registered
"pagedkv" attention) and int8 KV. float32 modes must give identical greedy tokens;
int8 KV is held to the stated tolerance of :func:`assert_same`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config import support
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.integrations import hf_attention
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.batches import left_pad
from pagedkv.testing.sliding_models import tiny_gemma2_capped, tiny_gemma3, tiny_mistral, tiny_qwen2

hf_attention.register()

WINDOW = 8
BS = 3                 # blocks of 3: a 22-token prompt ends in a partial block
PROMPT = 22
NEW = 10
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
BUILDERS = {"mistral": tiny_mistral, "gemma2": tiny_gemma2_capped, "gemma3": tiny_gemma3, "qwen2": tiny_qwen2}
FAMILIES = sorted(BUILDERS)
MODES = {"gather": {}, "paged": {}, "int8": dict(kv_dtype="int8")}

_models: dict = {}


def family(name):
    """``(model, tokenizer, assistant)``: built once per module."""
    if name not in _models:
        model, tok = BUILDERS[name](window=WINDOW)
        small, _ = BUILDERS[name](window=WINDOW, seed=11, layers=2, **SMALL)
        _models[name] = (model, tok, small)
    return _models[name]


@pytest.fixture(params=FAMILIES)
def fam(request):
    return family(request.param)


class attention:
    """Run ``model`` with the "pagedkv" attention when ``paged``, then give it back its own."""

    def __init__(self, model, paged: bool):
        self.model, self.paged = model, paged

    def __enter__(self):
        self.old = self.model.config._attn_implementation
        if self.paged:
            self.model.set_attn_implementation(hf_attention.NAME)

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)


def paged_kv(model, mode="gather", grouped=True, **kw) -> PagedKVCache:
    opts = dict(num_blocks=256, block_size=BS, dtype=torch.float32, shuffle_free_blocks=3) | MODES[mode] | kw
    if not grouped:
        opts["layer_windows"] = None
    kv = PagedKVCache(CacheConfig.from_hf_config(model.config, **opts))
    assert (kv.config.layer_groups is not None) == grouped
    return kv


def prompt(seed=1, n=PROMPT):
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def gen_kw(tok, mask, **kw):
    # min_new_tokens: no early EOS, so every case decodes past the window
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                attention_mask=mask,
                return_dict_in_generate=True, output_logits=True) | kw


def reference(model, ids, mask, tok, **kw):
    return model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen_kw(tok, mask, **kw))


def released_somewhere(kv, seq_ids) -> bool:
    plan = kv.config.layer_groups
    return any(kv.released_tokens(seq_ids, group=g.index).max() > 0 for g in plan.groups if g.window)


def assert_same(out, ref, mode, flat=None, hit=False):
    """float32: the greedy tokens of ``ref`` (DynamicCache). int8: the first step's
    logits equal DynamicCache's (the prompt attends to its K/V as computed), and the
    whole output equals ``flat``, the same scenario on an int8 cache without layer
    groups (every layer's KV kept, the model's mask applying the window): the same
    quantized values, read through the groups, to float32 summation order (1e-4).
    After a prefix ``hit`` the prompt reads its prefix quantized, so only ``flat``
    applies."""
    if mode != "int8":
        assert out.sequences.tolist() == ref.sequences.tolist()
        return
    if not hit:
        torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
    assert flat is not None
    assert out.sequences.tolist() == flat.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(flat.logits), atol=1e-4, rtol=1e-4)


# ---- the models themselves -------------------------------------------------------------------

def test_the_tiny_models_have_their_families_layouts():
    kinds = {name: [t == "sliding_attention" for t in getattr(family(name)[0].config, "layer_types", None) or []]
             for name in FAMILIES}
    assert kinds["gemma2"] == [True, False, True, False]
    assert kinds["gemma3"] == [True] * 5 + [False]
    for name in FAMILIES:
        plan = paged_kv(family(name)[0]).config.layer_groups
        assert any(g.window == WINDOW for g in plan.groups)
        assert (name == "mistral") == all(g.window for g in plan.groups)


def test_gemma2_soft_capping_and_query_scalar_change_its_output():
    """So that the Gemma 2 cases below check both (a cache that ignored them would fail)."""
    model, tok, _ = family("gemma2")
    ids = prompt()
    want = reference(model, ids, torch.ones_like(ids), tok).sequences
    for change in (dict(softcap=None), dict(query_pre_attn_scalar=16)):
        other, _ = tiny_gemma2_capped(window=WINDOW, **change)
        assert reference(other, ids, torch.ones_like(ids), tok).sequences.tolist() != want.tolist(), change
    assert len(set(want[0, PROMPT:].tolist())) > 3


# ---- generate --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", sorted(MODES))
def test_generate_and_padded_batch(fam, mode):
    model, tok, _ = fam
    paged = mode == "paged"
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (PROMPT, 13, 5)]
    batch, bmask = left_pad(rows, tok.pad_token_id)
    ids = prompt()
    for x, m in ((ids, torch.ones_like(ids)), (batch, bmask)):
        ref = reference(model, x, m, tok)
        outs = []
        for grouped in (True, False) if mode == "int8" else (True,):
            kv = paged_kv(model, mode, grouped)
            with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
                cache.admit(x, m)
                outs.append(model.generate(x, past_key_values=cache, **gen_kw(tok, m)))
                assert not grouped or released_somewhere(kv, cache.seq_ids)
            assert len(kv) == 0
        assert_same(outs[0], ref, mode, outs[-1])


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_assisted_generation_with_a_smaller_assistant(fam, mode):
    """The assistant's rejected tokens are rolled back past the window (crop)."""
    model, tok, small = fam
    paged = mode == "paged"
    ids = prompt(3)
    kw = dict(return_dict_in_generate=False, output_logits=False)
    ref = reference(model, ids, torch.ones_like(ids), tok, **kw)
    kv = paged_kv(model, mode)
    crops = []
    with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
        real = cache.crop
        cache.crop = lambda n: (crops.append(n), real(n))[1]
        out = model.generate(ids, past_key_values=cache, assistant_model=small, **gen_kw(tok, torch.ones_like(ids),
                                                                                        **kw))
    assert any(n < 0 for n in crops), crops
    assert out.tolist() == ref.tolist()
    kv.check_invariants()


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_beam_search(fam, mode):
    model, tok, _ = fam
    paged = mode == "paged"
    ids = prompt(4)
    kw = dict(num_beams=3, return_dict_in_generate=False, output_logits=False)
    ref = reference(model, ids, torch.ones_like(ids), tok, **kw)
    kv = paged_kv(model, mode)
    with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
        cache.admit(ids)
        out = model.generate(ids, past_key_values=cache, **gen_kw(tok, torch.ones_like(ids), **kw))
    assert out.tolist() == ref.tolist()


# ---- rollback, as speculative decoding does -------------------------------------------------

@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_rollback_truncate_then_continue(fam, mode):
    """Draft 4 tokens, keep 0-2 of them (``crop``), continue: every step's logits equal
    the model's on the whole accepted sequence without a cache."""
    model, tok, _ = fam
    paged = mode == "paged"
    ids = prompt(5)
    kv = paged_kv(model, mode)
    kv.add_sequence("s", ids[0])
    seq = ids[0].tolist()
    cache = PagedCache(kv, paged_attention=paged)
    cache.activate_past_recording()
    g = torch.Generator().manual_seed(6)
    with attention(model, paged), torch.no_grad():
        mask, pos = cache.select(["s"], len(seq))
        cache.set_input_ids(ids)
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        for step in range(6):
            draft = torch.randint(3, 250, (1, 4), generator=g)
            mask, pos = cache.select(["s"], 4)
            cache.set_input_ids(draft)
            got = model(draft, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
            want = model(torch.tensor([seq + draft[0].tolist()])).logits[:, -4:]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert (got.argmax(-1) == want.argmax(-1)).all()
            keep = step % 3
            cache.crop(-(4 - keep))
            seq += draft[0, :keep].tolist()
            assert kv.num_tokens("s") == len(seq)
    assert released_somewhere(kv, ["s"])
    cache._stop_holding()
    kv.free("s")
    kv.check_invariants()


def test_rollback_past_a_released_window_is_refused_without_recording(fam):
    """Without recording the past, a crop reaching into blocks a sliding group already
    released is refused with a typed error and changes nothing."""
    model, tok, _ = fam
    ids = prompt(5, 30)
    kv = paged_kv(model)
    with PagedCache(kv) as cache:
        cache.admit(ids)
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
        before = kv.seq_lens(cache.seq_ids).tolist()
        with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most \d+ for sequence .*the window "
                                                       r"of the tokens left must still be held"):
            cache.crop(-25)
        assert kv.seq_lens(cache.seq_ids).tolist() == before
        kv.check_invariants()


# ---- prefix reuse, tiers, warm restart -----------------------------------------------------

@pytest.mark.parametrize("mode", sorted(MODES))
def test_prefix_reuse_across_two_requests(fam, mode):
    model, tok, _ = fam
    paged = mode == "paged"
    first = prompt(7)
    second = torch.cat([first[:, :19], prompt(8, 7)], dim=1)     # shares 19 tokens: 6 blocks
    runs = []
    for grouped in (True, False) if mode == "int8" else (True,):
        kv = paged_kv(model, mode, grouped)
        outs, hits = [], []
        with attention(model, paged):
            for ids in (first, second):
                with PagedCache(kv, paged_attention=paged) as cache:
                    hits.append(int(cache.admit(ids)[0]))
                    outs.append(model.generate(ids, past_key_values=cache, **gen_kw(tok, torch.ones_like(ids))))
        assert hits[0] == 0 and hits[1] == 18
        assert kv.stats().hit_tokens >= 18
        runs.append(outs)
    for k, ids in enumerate((first, second)):
        assert_same(runs[0][k], reference(model, ids, torch.ones_like(ids), tok), mode, runs[-1][k], hit=k == 1)
    if mode != "int8":     # a hit reads exactly what computing the prefix again would
        with PagedCache(paged_kv(model, mode)) as cold:
            cold.admit(second)
            again = model.generate(second, past_key_values=cold, **gen_kw(tok, torch.ones_like(second)))
        torch.testing.assert_close(torch.stack(runs[0][1].logits), torch.stack(again.logits), atol=1e-4, rtol=1e-4)


def flush_device(kv) -> None:
    """Every cached prefix leaves the device (down to the tiers)."""
    kv.add_sequence("flush")
    try:
        while True:
            kv.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    kv.free("flush")


@pytest.mark.parametrize("mode", ["gather", "paged", "int8"])
def test_host_and_disk_tiers_and_a_warm_restart(fam, mode, tmp_path):
    """A prompt's prefix goes down to the host tier, then to disk, then a new cache on
    the same directory: each time the second request hits it there and generates what
    DynamicCache generates."""
    model, tok, _ = fam
    paged = mode == "paged"
    ids = prompt(9)
    want = reference(model, ids, torch.ones_like(ids), tok)
    groups = len(paged_kv(model).config.layer_groups.groups)
    opts = dict(num_blocks=24 * groups, prefix_host_blocks=16 * groups, prefix_disk_dir=str(tmp_path / "tier"),
                prefix_disk_blocks=64 * groups)

    def serve(kv, x):
        with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
            hit = int(cache.admit(x)[0])
            return hit, model.generate(x, past_key_values=cache, **gen_kw(tok, torch.ones_like(x)))

    flat = None
    if mode == "int8":     # the same hit on an int8 cache without groups, from its device blocks
        with paged_kv(model, mode, grouped=False) as kv:
            serve(kv, ids)
            hit, flat = serve(kv, ids)
            assert hit == 21
    with paged_kv(model, mode, **opts) as kv:
        assert serve(kv, ids)[0] == 0
        flush_device(kv)
        hit, out = serve(kv, ids)                      # from the host tier
        assert hit == 21 and kv.stats().host_hit_tokens == 21
        assert_same(out, want, mode, flat, hit=True)
        serve(kv, prompt(10, 40))                      # pushes the first prompt on to disk
        flush_device(kv)
        serve(kv, prompt(11, 40))
        flush_device(kv)
        hit, out = serve(kv, ids)
        assert hit == 21 and kv.stats().disk_hit_tokens >= 21
        assert_same(out, want, mode, flat, hit=True)
    with paged_kv(model, mode, **opts) as kv:         # warm restart
        hit, out = serve(kv, ids)
        assert hit == 21 and kv.stats().disk_hit_tokens == 21
        assert_same(out, want, mode, flat, hit=True)


# ---- moves mid-generation: swap, compact -------------------------------------------------

class EveryStep(LogitsProcessor):
    """Calls ``fn(step)`` between two forward passes of ``generate``."""

    def __init__(self, fn):
        self.fn, self.step = fn, 0

    def __call__(self, input_ids, scores):
        self.step += 1
        self.fn(self.step)
        return scores


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_swap_out_and_in_mid_generation(fam, mode):
    """Twice during generate the sequence goes to the host tier, another one takes the
    device blocks and leaves, and it comes back into other blocks."""
    model, tok, _ = fam
    paged = mode == "paged"
    ids = prompt(12)
    want = reference(model, ids, torch.ones_like(ids), tok)
    kv = paged_kv(model, mode, host_num_blocks=256)
    swaps = []
    with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
        cache.admit(ids)

        def swap(step):
            if step in (2, 5):
                sid = cache.seq_ids[0]
                before = [kv.block_table(sid, group=g).tolist() for g in range(len(kv.config.layer_groups.groups))]
                swaps.append(kv.swap_out(sid))
                other = np.arange(3, 3 + 30, dtype=np.int32)
                kv.add_sequence("other", other)
                kv.reserve("other", 30)
                kv.commit("other", 30)
                kv.free("other")
                kv.swap_in(sid)
                after = [kv.block_table(sid, group=g).tolist() for g in range(len(before))]
                assert after != before

        out = model.generate(ids, past_key_values=cache, logits_processor=LogitsProcessorList([EveryStep(swap)]),
                             **gen_kw(tok, torch.ones_like(ids)))
    assert len(swaps) == 2 and all(swaps)
    assert_same(out, want, mode)


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_compact_mid_generation(fam, mode):
    model, tok, _ = fam
    paged = mode == "paged"
    ids = prompt(13)
    want = reference(model, ids, torch.ones_like(ids), tok)
    kv = paged_kv(model, mode, shuffle_free_blocks=11)
    moved = []
    with attention(model, paged), PagedCache(kv, paged_attention=paged) as cache:
        cache.admit(ids)
        step = EveryStep(lambda s: moved.append(len(kv.compact())) if s % 4 == 2 else None)
        out = model.generate(ids, past_key_values=cache, logits_processor=LogitsProcessorList([step]),
                             **gen_kw(tok, torch.ones_like(ids)))
    assert moved and moved[0] > 0
    assert_same(out, want, mode)


@pytest.mark.parametrize("name", FAMILIES)
def test_full_precision_layers_read_exactly(name):
    """``kv_full_precision_layers`` with layer groups: the layers sharing the exact
    layer's arena slot (one of each group) read back exactly what a float32 cache reads
    after the prefill; the others read int4. Where that slot would hold every layer
    (Gemma 3's six one-layer groups), the option is refused with a typed error."""
    model, tok, _ = family(name)
    plan = paged_kv(model).config.layer_groups
    if len(plan.groups[0].layers) == 1:
        with pytest.raises(InvalidArgumentError, match=r"kv_full_precision_layers: expected at least one quantized"):
            paged_kv(model, kv_dtype="int4", kv_full_precision_layers=(0,))
        return
    ids = prompt(14)
    layer = plan.groups[0].layers[0]
    exact = [i for i in range(model.config.num_hidden_layers) if plan.layer_slot[i] == plan.layer_slot[layer]]
    assert len(exact) == len(plan.groups)
    read = []
    for opts in (dict(kv_dtype="int4", kv_window=0, kv_full_precision_layers=(layer,)), {}):
        kv = paged_kv(model, **opts)
        with PagedCache(kv) as cache, torch.no_grad():
            cache.admit(ids)
            model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
            read.append([kv.gather_window(cache.seq_ids, i)[:2] for i in range(model.config.num_hidden_layers)])
    for i, (low, full) in enumerate(zip(*read)):
        same = torch.equal(low[0], full[0]) and torch.equal(low[1], full[1])
        assert same == (i in exact), f"layer {i}"
    want = reference(model, ids, torch.ones_like(ids), tok)
    with PagedCache(paged_kv(model, kv_dtype="int4", kv_full_precision_layers=(layer,))) as cache:
        cache.admit(ids)
        out = model.generate(ids, past_key_values=cache, **gen_kw(tok, torch.ones_like(ids)))
    assert out.sequences[0, :PROMPT + 1].tolist() == want.sequences[0, :PROMPT + 1].tolist()


# ---- transfer: a two-process prefill -> decode hand-off ------------------------------------

def test_two_process_handoff_gives_the_single_process_tokens(tmp_path):
    """Each family: rank 0 prefills with PagedCache and sends the sequence; rank 1
    decodes with the "pagedkv" attention; both equal DynamicCache's greedy tokens.
    ``send_prefix`` with layer groups: when the support table allows it, rank 1's next
    request hits the received prefix and generates the same; otherwise it is refused
    with UnsupportedCombinationError."""
    from test_distributed import assert_ok, run_ranks

    (r0, r1), _ = run_ranks("hybrid_generate", tmp_path, timeout=300)
    assert_ok(r0)
    assert_ok(r1)
    row = next(c.name for c in support.CAPABILITIES if c.name.startswith("send_prefix"))
    prefix_ok = support.supported(row, support.GROUPS)
    for name in FAMILIES:
        model, tok, _ = family(name)
        ids = prompt(15)
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=12,
                              do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
        want = want[0, PROMPT:].tolist()
        assert r0[f"{name}_local"][:len(want)] == want, name
        assert r1[f"{name}_remote"][:len(want)] == want, name
        assert r0[f"{name}_sent"] > 0
        if prefix_ok:
            assert r1[f"{name}_prefix_hit"] == 21 and r1[f"{name}_prefix_tokens"] == want, name
        else:
            assert "UnsupportedCombinationError" in r0[f"{name}_prefix_refused"]
