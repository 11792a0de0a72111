"""Layer-wise copies of the connector's worker side (no vLLM needed): loads overlap the
forward layer by layer, saves run behind it on a bounded queue, failures fail the step."""
from __future__ import annotations

import threading

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_layerwise import LayerCopies
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

L, NB, H, BS, D = 4, 6, 2, 4, 8
NAMES = [f"model.layers.{i}.attn" for i in range(L)]


class Gated(BlockMover):
    """A mover whose copy of layer ``gate_layer`` waits for ``gate`` (and may fail)."""

    def __init__(self):
        super().__init__()
        self.gate, self.gate_layer, self.fail_layer = threading.Event(), -1, -1
        self.copied: list[tuple[str, int]] = []

    def _copy(self, kind, layer):
        if layer == self.gate_layer:
            assert self.gate.wait(30)
        if layer == self.fail_layer:
            raise OSError(f"{kind} of layer {layer} failed")
        self.copied.append((kind, layer))

    def load_layer(self, sa, codec, layer, slots, blocks):
        self._copy("load", layer)
        super().load_layer(sa, codec, layer, slots, blocks)

    def save_layer(self, sa, codec, layer, blocks, slots):
        self._copy("save", layer)
        super().save_layer(sa, codec, layer, blocks, slots)


@pytest.fixture
def rig():
    spec = KVSpec(L, H, BS, D, torch.bfloat16)
    store = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8}), spec, "model")
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(NB, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    dst = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    a, b = Gated(), Gated()
    assert a.register(spec, src, "CPU_ATTN") is None and b.register(spec, dst, "CPU_ATTN") is None
    sa, codec = a.arena(store.arena.name)[0]
    a.save(sa, codec, [(2, 0), (5, 1)])          # the tier holds blocks 2 and 5 in slots 0, 1
    copies = []
    yield store, (sa, codec), src, dst, b, copies
    for c in copies:
        c.close()
    store.close()


def test_loads_overlap_the_forward_layer_by_layer(rig):
    store, (sa, codec), src, dst, mover, copies = rig
    lc = LayerCopies(mover, NAMES, depth=1)
    copies.append(lc)
    mover.gate_layer = 2                      # layer 2's copy is slow
    lc.start_loads(sa, codec, [(0, 3), (1, 0)])
    lc.wait_layer(NAMES[0])                   # the forward of layer 0 may start...
    assert torch.equal(dst[0][3], src[0][2]) and torch.equal(dst[0][0], src[0][5])
    lc.wait_layer(NAMES[1])
    assert torch.equal(dst[1][3], src[1][2])
    assert not dst[2].any() and not dst[3].any()     # ...while later layers are not loaded yet
    waiter = threading.Thread(target=lc.wait_layer, args=(NAMES[2],))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()                  # the forward of layer 2 waits for its load
    mover.gate.set()
    waiter.join(30)
    lc.wait_layer(NAMES[3])
    assert lc.finish_loads() is None
    for i in range(L):
        assert torch.equal(dst[i][[3, 0]], src[i][[2, 5]]), i
        assert not dst[i][[1, 2, 4, 5]].any()
    assert [c for c in mover.copied if c[0] == "load"] == [("load", i) for i in range(L)]


def test_saves_run_behind_with_back_pressure(rig):
    store, (sa, codec), src, dst, mover, copies = rig
    # dst plays the engine now: its blocks 1 and 4 go to slots 2 and 3
    for i in range(L):
        dst[i][[1, 4]] = src[i][[0, 3]]
    lc = LayerCopies(mover, NAMES, depth=1)
    copies.append(lc)
    mover.gate_layer = 0
    lc.start_saves(sa, codec, [(1, 2), (4, 3)])
    lc.save_layer(NAMES[0])                   # queued; the thread blocks on it
    lc.save_layer(NAMES[1])                   # waits in the queue (depth 1)
    t = threading.Thread(target=lc.save_layer, args=(NAMES[2],))
    t.start()
    t.join(0.3)
    assert t.is_alive() and lc.num_backpressure >= 1      # a full queue holds the forward back
    mover.gate.set()
    t.join(30)
    assert lc.finish_saves() is None          # layer 3 was never passed on: saved now
    for i in range(L):
        assert torch.equal(sa.tensors[0][i][[2, 3]], src[i][[0, 3]]), i


def test_a_failed_or_unwaited_layer_fails_the_step(rig):
    store, (sa, codec), src, dst, mover, copies = rig
    lc = LayerCopies(mover, NAMES, depth=2)
    copies.append(lc)
    mover.fail_layer = 1
    lc.start_loads(sa, codec, [(0, 3)])
    for name in NAMES:
        lc.wait_layer(name)
    err = lc.finish_loads()
    assert isinstance(err, OSError) and "layer 1" in str(err)
    mover.fail_layer = -1
    lc.start_loads(sa, codec, [(0, 3)])
    lc.wait_layer(NAMES[0])                   # the forward skipped the others' waits
    err = lc.finish_loads()
    assert err is not None and "never waited" in str(err) and lc.num_unwaited == L - 1
    with pytest.raises(InvalidArgumentError, match="slot"):
        lc.start_loads(sa, codec, [(99, 0)])  # checked whole before anything is queued
    assert lc.finish_loads() is None


def test_layerwise_settings_are_checked():
    assert ConnectorConfig.from_extra({"transfer": "layerwise", "transfer_depth": 2}).transfer_depth == 2
    with pytest.raises(InvalidArgumentError, match="transfer"):
        ConnectorConfig.from_extra({"transfer": "async"})
    with pytest.raises(InvalidArgumentError, match="transfer_depth"):
        ConnectorConfig.from_extra({"transfer_depth": 0})
