"""The connector's tensor-parallel logic without an engine: two workers (BlockMovers of
rank 0 and 1) hold the head shards of the same KV, as vLLM registers them under
``tensor_parallel_size=2``, and map the scheduler side's arena; their reports go through
vLLM's own aggregation (``KVOutputAggregator``) to the scheduler side's
:func:`settle_reports`. A block counts only when both shards are there and verified."""
from __future__ import annotations

import json
from copy import copy

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm_codec import make_codec
from pagedkv.integrations.vllm_config import STORAGE_FORMATS, ConnectorConfig
from pagedkv.integrations.vllm_reports import ArenaReport, PagedKVWorkerMetadata, settle_reports
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

BS, HEADS, D, L, N, TP = 16, 4, 64, 2, 12, 2
H = HEADS // TP                                   # heads per rank
NS = b"model\x00\x00"


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


class Ranks:
    """The scheduler side's store (every rank's heads) and one mover per rank."""

    def __init__(self, tmp_path=None, storage="bf16"):
        extra = {"host_blocks": 8, "storage": storage}
        if tmp_path is not None:
            extra.update(disk_dir=str(tmp_path / "tier"), disk_blocks=32)
        self.store = PrefixStore(ConnectorConfig.from_extra(extra), KVSpec(L, HEADS, BS, D, torch.bfloat16),
                                 "model", tp_size=TP)
        g = torch.Generator().manual_seed(0)
        self.full = [torch.randn(N, HEADS, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
        self.movers, self.kv = [], []
        for rank in range(TP):
            kv = [t[:, rank * H:(rank + 1) * H].clone() for t in self.full]     # what vLLM gives rank r
            m = BlockMover()
            assert m.register(KVSpec(L, H, BS, D, torch.bfloat16), kv, "CPU_ATTN", rank=rank, tp_size=TP) is None
            self.movers.append(m)
            self.kv.append(kv)
        self.step = 0
        self.agg = KVOutputAggregator(expected_finished_count=TP)

    def mapped(self, rank):
        got, why, new = self.movers[rank].arena(self.store.arena.name)
        assert why is None, why
        return got, new

    def report(self, reports):
        """Each rank's report through vLLM's aggregation, then the scheduler side."""
        outs = []
        for r in reports:
            out = copy(EMPTY_MODEL_RUNNER_OUTPUT)
            meta = None if r is None else PagedKVWorkerMetadata({f"{r.arena}@{r.step}#{r.rank}": r})
            out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
            outs.append(out)
        got = self.agg.aggregate(outs).kv_connector_output.kv_connector_worker_meta
        settle_reports(got)

    def save(self, tokens, blocks, ranks_ok=(0, 1), ranks_failed=()):
        """Admit the blocks, each listed rank copies (or fails) its shard, reports settle."""
        s = self.store
        self.step += 1
        parent, saves = -1, []
        for i, b in enumerate(blocks):
            slot, created = s.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
            assert slot >= 0
            if created:
                saves.append((b, slot))
            parent = slot
        s.sent(self.step, [slot for _, slot in saves], [])
        reports = []
        for rank in range(TP):
            if rank not in ranks_ok and rank not in ranks_failed:
                reports.append(None)                # this rank's report never came with the step
                continue
            (sa, codec), new = self.mapped(rank)
            r = ArenaReport(arena=sa.name, step=self.step, rank=rank, opened=new)
            slots = [slot for _, slot in saves]
            if rank in ranks_ok:
                self.movers[rank].save(sa, codec, saves)
                r.saved = slots
            else:
                r.save_failed = slots
            reports.append(r)
        self.report(reports)
        return [slot for _, slot in saves]

    def load(self, chain, blocks, ranks_ok=(0, 1)):
        s = self.store
        self.step += 1
        s.lease(chain)
        s.sent(self.step, [], chain)
        reports = []
        for rank in range(TP):
            (sa, codec), new = self.mapped(rank)
            r = ArenaReport(arena=sa.name, step=self.step, rank=rank, opened=new)
            if rank in ranks_ok:
                self.movers[rank].load(sa, codec, list(zip(chain, blocks)))
                r.loaded = list(chain)
            else:
                r.load_failed = list(chain)
            reports.append(r)
        self.report(reports)


@pytest.mark.parametrize("storage", STORAGE_FORMATS)
def test_each_rank_copies_its_heads_into_its_slice_and_back(storage):
    t = Ranks(storage=storage)
    s = t.store
    tokens = toks(2 * BS + 3, 1)
    slots = t.save(tokens, [3, 7])
    assert s.worker_ready and s.opened_ranks == {0, 1}
    full_codec = make_codec(storage, HEADS, BS, D, torch.bfloat16, s.cfg.rotation_seed)
    for layer in range(L):
        # the arena block is the full-heads encoding of vLLM's KV (each head on its own)
        want = full_codec.encode(t.full[layer][[3, 7]])
        for a, arena in enumerate(s.arena.tensors):
            assert torch.equal(arena[layer][slots].view(torch.uint8), want[a].contiguous().view(torch.uint8))
    chain = s.lookup(tokens, NS, 2)
    assert chain == slots
    t.load(chain, [0, 1])
    for rank in range(TP):
        for layer in range(L):
            want = full_codec.decode(full_codec.encode(t.full[layer][[3, 7]]))[:, rank * H:(rank + 1) * H]
            assert torch.equal(t.kv[rank][layer][[0, 1]], want)       # exact: the same bytes decoded
    assert int(s.host.index.busy.sum()) == 0


@pytest.mark.parametrize("case", ["rank 1 never reported", "rank 0 failed"])
def test_a_block_missing_one_ranks_shard_is_never_a_hit(case):
    t = Ranks()
    s = t.store
    tokens = toks(BS + 1, 2)
    kw = {"ranks_ok": (0,)} if case == "rank 1 never reported" else {"ranks_ok": (1,), "ranks_failed": (0,)}
    t.save(tokens, [5], **kw)
    assert s.lookup(tokens, NS, 1) == []
    if case == "rank 1 never reported":     # it has not mapped the arena: loads wait, the name stays
        assert not s.worker_ready and s.arena.path.exists()
    assert not s.pending and int(s.host.index.busy.sum()) == 0          # abandoned, nothing held
    t.save(tokens, [5])                                                 # both ranks this time
    assert len(s.lookup(tokens, NS, 1)) == 1
    assert s.worker_ready and not s.arena.path.exists()


def test_a_load_one_rank_failed_releases_every_lease():
    t = Ranks()
    s = t.store
    tokens = toks(2 * BS + 1, 3)
    t.save(tokens, [1, 2])
    chain = s.lookup(tokens, NS, 2)
    hits = s.host.num_hit_tokens
    t.load(chain + chain[:1], [4, 5, 6], ranks_ok=(0,))      # slot chain[0] loaded twice: two leases
    assert s.host.num_hit_tokens == hits                     # not a hit: rank 1's blocks are not there
    assert int(s.host.index.busy.sum()) == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_one_corrupt_shard_on_disk_is_a_miss_for_the_whole_block(tmp_path, rank):
    t = Ranks(tmp_path)
    s = t.store
    tokens = toks(BS + 1, 4)
    t.save(tokens, [2])
    s.clear(disk=False)                                      # host empty: only disk can serve
    disk = tmp_path / "tier"
    record = json.loads((disk / "meta.json").read_text())["record_bytes"]
    raw = bytearray((disk / "blocks.bin").read_bytes())
    at = rank * H * BS * 2 * D * 2 + 40                      # inside `rank`'s heads of layer 0 (bf16)
    assert at < record
    raw[at] ^= 0xFF
    (disk / "blocks.bin").write_bytes(bytes(raw))
    assert s.lookup(tokens, NS, 1) == []
    assert s.num_disk_corrupt == 1


def test_the_format_names_the_tp_size_and_other_sizes_are_refused(tmp_path):
    t = Ranks(tmp_path)
    s = t.store
    assert s.format["tp_size"] == TP and s.format["tp_shards"] == [[0, 0, H], [1, H, H]]
    # one worker holding all heads (TP=1) maps no TP=2 arena (checked before the ranks
    # map it: the name is unlinked once every rank has)
    whole = BlockMover()
    assert whole.register(KVSpec(L, HEADS, BS, D, torch.bfloat16), t.full, "CPU_ATTN") is None
    got, why, _ = whole.arena(s.arena.name)
    assert got is None and "tensor-parallel size 2 differs from this engine's 1" in why
    tokens = toks(BS + 1, 5)
    t.save(tokens, [2])
    # a TP=1 engine on the same directory: another format, never served the TP=2 blocks
    one = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8, "disk_dir": str(tmp_path / "tier"),
                                                  "disk_blocks": 32}),
                      KVSpec(L, HEADS, BS, D, torch.bfloat16), "model")
    try:
        assert "tp_size" not in one.format
        assert one.lookup(tokens, NS, 1) == []
    finally:
        one.close()
    with pytest.raises(InvalidArgumentError, match="rank"):
        BlockMover().register(KVSpec(L, H, BS, D, torch.bfloat16), t.kv[0], "CPU_ATTN", rank=2, tp_size=2)
    with pytest.raises(InvalidArgumentError, match="tp_size"):
        PrefixStore(s.cfg, KVSpec(L, 3, BS, D, torch.bfloat16), "model", tp_size=2)
