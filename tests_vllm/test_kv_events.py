"""vLLM's own KV-event classes read pagedkv's events: the batch a KVEventPublisher sends
decodes with ``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``,
field for field (the vLLM venv: .ci/vllm_tests.sh)."""
import time

import msgspec
import numpy as np
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.kv_events import KVEventPublisher

BS = 4


def fill(cache, seq, tokens):
    hit = cache.add_sequence(seq, tokens)
    cache.reserve(seq, len(tokens) - hit)
    cache.commit(seq, len(tokens) - hit)


def test_vllms_decoder_reads_every_event_pagedkv_publishes(tmp_path):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, num_blocks=6, dtype="float32",
                      enable_kv_events=True, prefix_host_blocks=3, prefix_disk_dir=str(tmp_path),
                      prefix_disk_blocks=16, prefix_tier_write="through")
    a = np.arange(100, 113, dtype=np.int32)
    with PagedKVCache(cfg) as cache, KVEventPublisher(cache, "tcp://127.0.0.1:0", topic="kv@pod@smol",
                                                     data_parallel_rank=1) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod@smol")
        sub.connect(pub.endpoint)
        time.sleep(0.1)
        fill(cache, "a", a)
        cache.free("a")
        cache.add_sequence("f")
        cache.reserve("f", cache.pool.num_free_blocks * BS)
        cache.free("f")
        cache.reset_prefix_cache()
        pub.publish()
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        sub.close(linger=0)
    assert topic == b"kv@pod@smol" and int.from_bytes(seq, "big") == 0
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 1 and batch.ts > 0
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    removed = [e for e in batch.events if isinstance(e, BlockRemoved)]
    cleared = [e for e in batch.events if isinstance(e, AllBlocksCleared)]
    assert {e.medium for e in stored} == {"GPU", "CPU", "STORAGE"}
    gpu = [e for e in stored if e.medium == "GPU"]
    assert len(gpu) == 1 and len(gpu[0].block_hashes) == 3 and gpu[0].parent_block_hash is None
    assert gpu[0].token_ids == a[:12].tolist() and gpu[0].block_size == BS
    assert gpu[0].group_idx == 0 and gpu[0].kv_cache_spec_kind == "full_attention"
    assert all(isinstance(h, int) and -2**63 <= h < 2**63 for e in stored for h in e.block_hashes)
    assert removed and removed[0].medium == "GPU" and set(removed[0].block_hashes) == set(gpu[0].block_hashes)
    assert len(cleared) == 3


def test_vllms_decoder_reads_the_connectors_tier_events(tmp_path):
    """The connector's take_events: its store's host and disk events as vLLM's objects,
    through vLLM's encoder and decoder."""
    import torch

    from pagedkv.events import EventsLost
    from pagedkv.events import BlockStored as PStored
    from pagedkv.integrations.vllm_config import ConnectorConfig
    from pagedkv.integrations.vllm_events import to_vllm
    from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
    from pagedkv.integrations.vllm_worker import BlockMover

    bs = 16
    store = PrefixStore(ConnectorConfig.from_extra({"host_blocks": 4, "disk_dir": str(tmp_path), "disk_blocks": 16}),
                        KVSpec(2, 2, bs, 32, torch.bfloat16), "model")
    try:
        kv = [torch.zeros(8, 2, bs, 64, dtype=torch.bfloat16) for _ in range(2)]
        store.mover = BlockMover()
        assert store.mover.register(store.spec, kv, "CPU_ATTN") is None     # vLLM for CPU's layout
        store.worker_ready = True
        store.enable_events()
        t = np.arange(2 * bs + 1, dtype=np.int32)
        s0, _ = store.admit(-1, t[:bs], b"ns")
        s1, _ = store.admit(s0, t[bs:2 * bs], b"ns")
        got, why, _ = store.mover.arena(store.arena.name)
        store.mover.save(*got, [(1, s0), (2, s1)])
        store.committed([s0, s1])
        store.clear(disk=True)
        ours = store.events.drain() + [EventsLost(2),
                                       PStored([5], 7, bs, None, [0], medium="remote", token_ids=list(range(bs)))]
    finally:
        store.close()
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=to_vllm(ours, bs)))
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == ["CPU", "STORAGE", "REMOTE"]
    assert stored[0].token_ids == t[:2 * bs].tolist() and stored[0].block_size == bs
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    assert stored[1].block_hashes == stored[0].block_hashes and stored[1].locality == "LOCAL"
    assert stored[2].locality == "REMOTE" and stored[2].parent_block_hash == 7
    assert sum(isinstance(e, AllBlocksCleared) for e in batch.events) == 3      # host, disk, the lost stretch
