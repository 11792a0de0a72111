"""The connector under vLLM's hybrid allocator without an engine: the KV cache groups
vLLM would configure (full attention and sliding window, each with its own block table),
the tensors its hybrid allocator registers (one tensor per layer position, shared by the
groups' layers of that position), and copies that name one block per group."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_connector import PagedKVConnector
from pagedkv.integrations.vllm_groups import group_ids, per_block, spec_of
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

BS, H, D, N = 16, 2, 64, 10
NS = b"model\x00\x00"
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
SW = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, sliding_window=2 * BS)


def name(i):
    return f"model.layers.{i}.self_attn.attn"


def config(*groups):
    return KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
                                          for spec, names in groups])


def test_the_connector_declares_hma_so_vllm_keeps_the_hybrid_allocator():
    assert supports_hma(PagedKVConnector)
    ktc = SimpleNamespace(kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.integrations.vllm")
    assert KVConnectorFactory.supports_hma_config(ktc)


def test_groups_give_every_layer_in_model_order():
    # Gemma-style: even layers sliding window (group 0), odd layers full attention (group 1)
    spec, why, names, groups = spec_of(config((SW, [name(0), name(2)]), (FULL, [name(1), name(3)])))
    assert why is None and spec == KVSpec(4, H, BS, D, torch.bfloat16)
    assert names == [name(i) for i in range(4)] and groups == [0, 1, 0, 1]
    # one full-attention group (the hybrid allocator off, or no sliding window): plain block ids
    assert spec_of(config((FULL, [name(1), name(0)])))[2:] == ([name(0), name(1)], None)
    # every layer within a window (Mistral): one group, whose blocks may be absent
    assert spec_of(config((SW, [name(0), name(1)])))[3] == [0, 0]


def test_groups_the_connector_cannot_store_are_named():
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    spec, why, _, _ = spec_of(config((FULL, [name(0)]), (mamba, [name(1)])))
    assert spec is None and "MambaSpec" in why
    other = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=2 * D, dtype=torch.bfloat16)
    spec, why, _, _ = spec_of(config((SW, [name(0)]), (other, [name(1)])))
    assert spec is None and "different shapes" in why


def blocks_of(*groups):
    """vLLM's KVCacheBlocks for a request: per group, its blocks (None: the null block)."""
    def mk(i):
        return SimpleNamespace(block_id=0, is_null=True) if i is None else SimpleNamespace(block_id=i, is_null=False)
    return SimpleNamespace(blocks=tuple([mk(i) for i in g] for g in groups))


def test_block_ids_per_group_with_the_windows_null_blocks():
    ids = group_ids(blocks_of([None, None, 7, 8], [1, 2, 3, 4]))
    assert ids == [[-1, -1, 7, 8], [1, 2, 3, 4]]
    assert per_block(ids, 1, 3, True) == [(-1, 2), (7, 3)]
    assert per_block([[5, 6]], 0, 2, False) == [5, 6]


class Hybrid:
    """A store and one mover over the tensors vLLM's hybrid allocator registers: layer
    positions 0 and 1 each hold one tensor, shared by that position's sliding-window layer
    (layers 0, 2 -> group 0) and full-attention layer (layers 1, 3 -> group 1)."""

    def __init__(self):
        self.store = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8}), KVSpec(4, H, BS, D, torch.bfloat16),
                                 "model")
        g = torch.Generator().manual_seed(0)
        shared = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(2)]
        self.kv = [shared[0], shared[0], shared[1], shared[1]]          # model order: layers 0..3
        self.groups = [0, 1, 0, 1]
        self.mover = BlockMover()
        assert self.mover.register(self.store.spec, self.kv, "CPU_ATTN", layer_groups=self.groups) is None
        self.store.worker_ready = True
        got, why, _ = self.mover.arena(self.store.arena.name)
        assert why is None
        self.sa, self.codec = got


def test_a_block_is_saved_from_each_layers_group_and_loaded_back_skipping_absent_ones():
    t = Hybrid()
    tokens = np.random.default_rng(1).integers(0, 50_000, 2 * BS + 1).astype(np.int32)
    s = t.store
    # the request's blocks: sliding-window group 2, 3; full-attention group 5, 6
    saves, parent = [], -1
    for i, blocks in enumerate([(2, 5), (3, 6)]):
        slot, created = s.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
        assert created
        saves.append((blocks, slot))
        parent = slot
    want = {(layer, i): t.kv[layer][blocks[t.groups[layer]]].clone()
            for layer in range(4) for i, (blocks, _) in enumerate(saves)}
    t.mover.save(t.sa, t.codec, saves)
    s.committed([slot for _, slot in saves])
    for layer in range(4):                                  # each layer's slot holds its group's block
        for i, (_, slot) in enumerate(saves):
            assert torch.equal(s.arena.tensors[0][layer][slot], want[(layer, i)])
    chain = s.lookup(tokens, NS, 2)
    assert chain == [slot for _, slot in saves]
    # a hit of 2 blocks with a 1-block window: the sliding-window group's first block is vLLM's null
    before = [t.kv[layer].clone() for layer in range(4)]
    s.lease(chain)
    t.mover.load(t.sa, t.codec, list(zip(chain, [(-1, 8), (9, 7)])))
    s.loaded(chain, ok=True)
    assert t.mover.num_absent_skipped == 2                  # block 0 of the 2 sliding-window layers
    for layer in range(4):
        g = t.groups[layer]
        targets = [8, 7] if g == 1 else [None, 9]
        for i, b in enumerate(targets):
            if b is not None:
                assert torch.equal(t.kv[layer][b], want[(layer, i)])
    # nothing but the targets changed (block 0, the null block, above all)
    changed = {b for layer in range(4) for b in range(N) if not torch.equal(t.kv[layer][b], before[layer][b])}
    assert changed <= {7, 8, 9}
    assert torch.equal(t.kv[0][0], before[0][0])


def test_group_pairs_are_checked_whole():
    t = Hybrid()
    with pytest.raises(InvalidArgumentError, match="ids in \\[0"):
        t.mover.save(t.sa, t.codec, [((-1, 5), 0)])         # a save needs every group's block
    with pytest.raises(ArgumentTypeError):
        t.mover.save(t.sa, t.codec, [(5, 0)])               # one id where each group needs one
    with pytest.raises(InvalidArgumentError, match="each destination once"):
        t.mover.load(t.sa, t.codec, [(0, (3, 4)), (1, (5, 4))])
    t.mover.load(t.sa, t.codec, [(0, (-1, 4)), (1, (-1, 5))])    # absent twice in one group: fine
    with pytest.raises(InvalidArgumentError, match="layer_groups"):
        BlockMover().register(t.store.spec, t.kv, "CPU_ATTN", layer_groups=[0, 2, 0, 2])


def test_one_sliding_window_group_names_its_blocks_in_one_tuples():
    # every layer within a window (Mistral): one group, whose blocks left the window are null
    store = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 4}), KVSpec(2, H, BS, D, torch.bfloat16), "model")
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(2)]
    m = BlockMover()
    assert m.register(store.spec, kv, "CPU_ATTN", layer_groups=[0, 0]) is None
    (sa, codec), why, _ = m.arena(store.arena.name)
    assert why is None
    m.save(sa, codec, [((3,), 0), ((4,), 1)])
    before = [t.clone() for t in kv]
    m.load(sa, codec, [(0, (-1,)), (1, (6,))])
    assert m.num_absent_skipped == 2                          # slot 0 skipped in both layers
    for layer in range(2):
        assert torch.equal(kv[layer][6], before[layer][4])
        assert torch.equal(kv[layer][:6], before[layer][:6]) and torch.equal(kv[layer][7:], before[layer][7:])
