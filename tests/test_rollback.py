"""Rollback: BlockTables.truncate, PagedKVCache.truncate, PagedCache.crop and assisted generation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from model_fixtures import chat_ids, smollm2, tiny  # noqa: F401
from transformers import DynamicCache

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, SequenceNotFoundError
from pagedkv.integrations.transformers import PagedCache
from pagedkv.manager.cache import PagedKVCache
from pagedkv.testing.batches import left_pad
from pagedkv.testing.models import tiny_llama

BS = 4


def core(num_blocks=16):
    index = PrefixIndex(BS, num_blocks, hash_seed=1)
    pool = BlockPool(num_blocks, "lru", index=index)
    return pool, BlockTables(pool, BS, index)


def run(tables, key, tokens):
    """Admit, reserve and commit a whole prompt (its ids known)."""
    tables.add(key, np.array(tokens, np.int32))
    n = len(tokens) - tables.num_computed(key)
    tables.reserve(key, n)
    tables.commit(key, n)


def test_truncate_frees_emptied_blocks_and_keeps_the_rest():
    pool, t = core()
    run(t, 1, list(range(10)))                 # blocks: 4 + 4 + 2
    blocks = t.blocks(1).tolist()
    t.truncate(1, 5)                           # 5 tokens left: 2 blocks
    assert t.num_computed(1) == t.num_reserved(1) == 5
    assert t.blocks(1).tolist() == blocks[:2]
    assert t.tokens(1).tolist() == list(range(5))
    assert pool.num_in_use_blocks == 2
    t.check_invariants()
    t.remove(1)
    t.check_invariants()


def test_truncate_gives_back_reserved_slots_too():
    pool, t = core()
    run(t, 1, list(range(6)))
    t.reserve(1, 5)                            # 11 reserved, 3 blocks
    t.truncate(1, 2)
    assert (t.num_computed(1), t.num_reserved(1), len(t.blocks(1))) == (4, 4, 1)
    t.remove(1)
    t.check_invariants()


def test_truncate_errors_change_nothing():
    pool, t = core()
    run(t, 1, list(range(6)))
    run(t, 2, list(range(100, 103)))
    before = (t.blocks(1).tolist(), t.blocks(2).tolist(), t.num_computed(1), t.num_computed(2))
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most 3 \(the committed tokens\) "
                                                   r"for sequence 2, got 4 at index 1"):
        t.truncate(np.array([1, 2], np.int64), np.array([1, 4], np.int64))
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected counts >= 0, got -1 at index 0"):
        t.truncate(np.array([1], np.int64), np.array([-1], np.int64))
    with pytest.raises(SequenceNotFoundError):
        t.truncate(np.array([1, 9], np.int64), np.array([1, 1], np.int64))
    assert before == (t.blocks(1).tolist(), t.blocks(2).tolist(), t.num_computed(1), t.num_computed(2))
    t.remove(np.array([1, 2], np.int64))
    t.check_invariants()


def test_shared_block_is_copied_not_overwritten():
    pool, t = core()
    run(t, 1, list(range(7)))                  # block 1 holds tokens 4..6 (partial)
    t.fork(1, 2)
    shared = t.blocks(1).tolist()
    t.truncate(2, 2)                           # 2 now ends inside the shared partial block
    assert t.blocks(2).tolist() == shared[:2]
    slots = t.reserve(2, 1)                    # the write into it must go to a private copy
    copies = t.take_copies().tolist()
    assert copies == [[shared[1], t.blocks(2).tolist()[1]]]
    assert slots.tolist() == [t.blocks(2).tolist()[1] * BS + 1]
    assert t.blocks(1).tolist() == shared      # the other sequence is untouched
    t.remove(np.array([1, 2], np.int64))
    t.check_invariants()


def test_registered_block_left_partial_is_copied_and_stays_findable():
    pool, t = core()
    toks = list(range(9))
    run(t, 1, toks)                            # blocks 0 and 1 are full and registered
    full = t.blocks(1).tolist()[:2]
    assert t.index.match(np.array(toks, np.int32)).tolist() == full
    t.truncate(1, 3)                           # 6 left: block 1 is partial again
    assert t.info(1)["num_hashed"] == 1        # the cursor stepped back
    t.reserve(1, 2)                            # writes into block 1 copy it first
    assert t.take_copies().tolist() == [[full[1], t.blocks(1).tolist()[1]]]
    t.commit(1, 2, np.array([50, 51], np.int32))   # a different continuation registers anew
    assert t.info(1)["num_hashed"] == 2
    assert t.index.match(np.array(toks[:8], np.int32)).tolist() == full
    assert t.index.match(np.array(toks[:6] + [50, 51], np.int32)).tolist() == t.blocks(1).tolist()[:2]
    t.remove(1)
    t.check_invariants()


def test_cursor_whose_chain_was_evicted_stops_registering():
    pool, t = core(num_blocks=4)
    run(t, 1, list(range(8)))                  # blocks 0, 1 registered
    t.fork(1, 2)
    t.remove(1)
    t.truncate(2, 8)                           # everything gone: cursor back at the root
    assert t.info(2)["num_hashed"] == 0 and t.info(2)["tracking"]
    t.remove(2)
    t.check_invariants()


def test_manager_truncate_with_named_ids():
    kv = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=BS,
                                  dtype="float32"), allocate_store=False)
    kv.add_sequence("a", list(range(9)))
    kv.reserve("a", 9)
    kv.commit("a", 9)
    kv.truncate("a", 4)
    assert kv.seq_lens(["a"], computed=True).tolist() == [5]
    assert kv.num_blocks("a") == 2
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most 5 \(the committed tokens\) "
                                                   r"for sequence 'a', got 6 at index 0"):
        kv.truncate("a", 6)
    with pytest.raises(SequenceNotFoundError):
        kv.truncate("b", 1)
    kv.free("a")
    kv.check_invariants()


# ---- transformers ------------------------------------------------------------------
def make_kv(model, num_blocks=64):
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=BS, dtype=torch.float32,
                                     shuffle_free_blocks=3)
    return PagedKVCache(cfg)


def test_crop_drops_columns_like_dynamic_cache(tiny):  # noqa: F811
    model, tok = tiny
    kv = make_kv(model)
    ids = torch.tensor([tok.encode("paged attention rolls back")])
    with PagedCache(kv) as cache, torch.no_grad():
        model(ids, past_key_values=cache)
        dyn = DynamicCache(config=model.config)
        model(ids, past_key_values=dyn)
        assert cache.is_croppable
        cache.crop(-5)
        dyn.crop(-5)
        assert cache.get_seq_length() == dyn.get_seq_length() == ids.shape[1] - 5
        nxt = ids[:, -5:-3]
        a = model(nxt, past_key_values=cache).logits
        b = model(nxt, past_key_values=dyn).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        with pytest.raises(InvalidArgumentError, match="tokens_to_remove: expected an int, got 1.5"):
            cache.crop(1.5)
        with pytest.raises(InvalidArgumentError, match="crop: expected PagedCache.crop"):
            cache.layers[0].crop(-1)
    assert len(kv) == 0


def test_crop_with_left_padding_rows(tiny):  # noqa: F811
    model, tok = tiny
    kv = make_kv(model)
    rows = [tok.encode("short"), tok.encode("a longer prompt")]
    ids, mask = left_pad(rows, tok.pad_token_id)
    width = ids.shape[1]
    with PagedCache(kv) as cache:
        cache.admit(ids, mask)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
        cache.crop(-3)
        assert kv.seq_lens(cache.seq_ids, computed=True).tolist() == [len(rows[0]) - 3, len(rows[1]) - 3]
        target = width - len(rows[0]) - 1      # 4.x absolute form, inside row 0's padding
        cache.crop(target)
        assert cache.get_seq_length() == target
        assert kv.seq_lens(cache.seq_ids, computed=True).tolist() == [0, target]
    assert len(kv) == 0


class CropSpy:
    """Records every ``PagedCache.crop`` argument while active."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig = PagedCache.crop

        def spy(cache, n):
            self.calls.append(n)
            return orig(cache, n)

        monkeypatch.setattr(PagedCache, "crop", spy)


def rejecting_draft():
    """A tiny draft that proposes the plain model's choice shifted by one token id: the
    target model rejects nearly every draft token, so every step rolls back."""
    draft, _ = tiny_llama(seed=5)
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(torch.roll(draft.lm_head.weight.detach(), 1, 0))
    # Propose 4 tokens every step: a low-confidence draft would otherwise stop before
    # proposing anything, and there would be nothing to roll back.
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


@pytest.mark.parametrize("prompt", ["the quick brown fox", "paged kv"])
def test_assisted_generation_matches_plain_greedy(tiny, prompt, monkeypatch):  # noqa: F811
    model, tok = tiny
    ids = torch.tensor([tok.encode(prompt)])
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    plain = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    kv = make_kv(model, num_blocks=128)
    spy = CropSpy(monkeypatch)
    with PagedCache(kv) as cache:
        out = model.generate(ids, past_key_values=cache, assistant_model=rejecting_draft(), **kw)
    assert out.tolist() == plain.tolist()
    assert sum(n < 0 for n in spy.calls) >= 3, f"too few rollbacks to test crop: {spy.calls}"
    kv.check_invariants()
    assert len(kv) == 0


def test_prompt_lookup_decoding_on_smollm2_matches_plain_greedy(smollm2, monkeypatch):  # noqa: F811
    """Prompt-lookup decoding drafts n-grams of the prompt: some are accepted, some
    rejected and cropped. A plain paged run first registers the prompt, so the
    prompt-lookup run starts from a prefix hit on shared, registered blocks."""
    model, tok = smollm2
    ids = torch.tensor([chat_ids(tok, "Repeat exactly, twice: the cat sat on the mat near the door.")])
    kw = dict(max_new_tokens=32, do_sample=False)
    plain = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=256, block_size=BS, dtype=torch.float32,
                                     shuffle_free_blocks=3)
    kv = PagedKVCache(cfg)
    spy = CropSpy(monkeypatch)
    hits = []
    for lookup in (None, 4):
        with PagedCache(kv) as cache:
            hits.append(int(cache.admit(ids)[0]))
            out = model.generate(ids, past_key_values=cache, prompt_lookup_num_tokens=lookup, **kw)
        assert out.tolist() == plain.tolist()
        kv.check_invariants()
    assert hits == [0, (ids.shape[1] - 1) // BS * BS]
    assert any(n < 0 for n in spy.calls), f"no draft token was rejected: {spy.calls}"
    assert len(kv) == 0
