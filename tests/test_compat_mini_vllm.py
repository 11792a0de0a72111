"""pagedkv.compat.mini_vllm (seed 003) beyond the seed's own tests: errors, all-or-nothing
failures, live tables, slots that address the arena, sharing by fork."""
import numpy as np
import pytest
import torch

from pagedkv.compat.mini_vllm import (AllocatorOutOfBlocksError, BlockAllocator, BlockTable, CacheConfig,
                                      KVCacheManager, UnallocatedBlockError)
from pagedkv.errors import (DeviceError, InvalidArgumentError, InvalidBlockError, OutOfBlocksError,
                            SequenceExistsError, SequenceNotFoundError)


def small_config(**kw):
    args = dict(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2, head_dim=4,
                dtype=torch.float32, device="cpu")
    args.update(kw)
    return CacheConfig(**args)


# ---- CacheConfig ----------------------------------------------------------------------
def test_config_sizes_count_every_layer():
    cfg = CacheConfig(num_blocks=100, block_size=16, num_layers=32, num_kv_heads=8, head_dim=128,
                      dtype=torch.float16, device="cpu")
    assert cfg.kv_cache_shape == (100, 2, 16, 8, 128)
    assert cfg.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2
    assert cfg.total_memory_gb == pytest.approx(100 * cfg.bytes_per_block / 2**30)


def test_config_bfloat16_is_two_bytes():
    # The seed sized every non-fp16 dtype at 4 bytes.
    assert small_config(dtype=torch.bfloat16).bytes_per_block == 2 * 2 * 4 * 2 * 4 * 2


def test_config_normalises_dtype_and_converts():
    cfg = small_config(dtype="fp16")
    assert cfg.dtype is torch.float16
    pk = cfg.to_pagedkv()
    assert (pk.num_layers, pk.num_kv_heads, pk.head_dim, pk.block_size, pk.num_blocks) == (2, 2, 4, 4, 8)
    assert pk.enable_prefix_caching is False
    assert cfg.to_pagedkv(layout="HND").layout == "HND"


def test_config_validates():
    with pytest.raises(InvalidArgumentError, match=r"num_blocks: expected an int >= 1, got 0"):
        small_config(num_blocks=0)
    with pytest.raises(TypeError, match=r"dtype: expected float32/fp32, float16/fp16 or bfloat16/bf16"):
        small_config(dtype=torch.int8)


# ---- BlockAllocator ------------------------------------------------------------------
def snapshot(a):
    return a.num_free, a.free_blocks, a.ref_counts


def test_allocator_takes_from_the_front_of_the_free_queue():
    a = BlockAllocator(6)
    front = a.free_blocks[:3]
    assert a.allocate_n(3) == front
    assert a.ref_counts == {b: 1 for b in front}
    assert a.can_allocate(3) and not a.can_allocate(4)


def test_allocation_failure_is_typed_and_changes_nothing():
    a = BlockAllocator(5)
    a.allocate_n(3)
    before = snapshot(a)
    with pytest.raises(AllocatorOutOfBlocksError, match=r"allocate needs 4 block\(s\), 2 free") as info:
        a.allocate_n(4)
    assert isinstance(info.value, OutOfBlocksError) and isinstance(info.value, MemoryError)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.needed, info.value.free) == (4, 2)
    assert snapshot(a) == before


def test_free_and_add_ref_of_a_free_block_raise_runtime_errors():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    before = snapshot(a)
    with pytest.raises(UnallocatedBlockError, match=rf"block_id: expected an allocated block \(ref_cnt >= 1\), got block {b}, which is free"):
        a.free(b)
    with pytest.raises(RuntimeError, match="which is free"):
        a.add_ref(b)
    assert snapshot(a) == before


def test_block_ids_are_validated():
    a = BlockAllocator(4)
    for bad in (-1, 4, True, "1", 1.0):
        with pytest.raises(InvalidBlockError, match=r"block_id: expected a block id in \[0, 4\)"):
            a.get_ref_count(bad)
        with pytest.raises(InvalidBlockError):
            a.free(bad)
    with pytest.raises(InvalidArgumentError, match=r"n: expected an int >= 0, got -1"):
        a.allocate_n(-1)
    for bad in (0, -3, 2.0):
        with pytest.raises(InvalidArgumentError, match=rf"num_blocks: expected an int >= 1, got {bad}"):
            BlockAllocator(bad)
    assert BlockAllocator(np.int64(3)).num_free == 3
    assert a.allocate_n(0) == [] and a.num_free == 4


def test_snapshots_are_copies():
    a = BlockAllocator(4)
    a.free_blocks.clear()
    a.ref_counts[0] = 9
    assert a.num_free == 4 and a.free_blocks == [0, 1, 2, 3] and a.ref_counts == {}


def test_freed_blocks_are_reused_first():
    a = BlockAllocator(8)
    blocks = a.allocate_n(4)
    a.free(blocks[2])
    assert a.allocate() == blocks[2]


# ---- BlockTable ------------------------------------------------------------------------
def test_standalone_block_table():
    t = BlockTable()
    t.append(7)
    t.append(3)
    assert len(t) == 2 and t[1] == 3 and list(t) == [7, 3] and t.table == [7, 3]
    tensor = t.as_tensor()
    assert tensor.dtype == torch.int32 and tensor.tolist() == [7, 3]
    with pytest.raises(InvalidBlockError, match=r"block_id: expected a block id >= 0, got -1"):
        t.append(-1)
    with pytest.raises(IndexError):
        t[2]


# ---- KVCacheManager ----------------------------------------------------------------------
@pytest.fixture
def manager():
    m = KVCacheManager(small_config())
    yield m
    for seq_id in list(m.sequence_tables):   # what the test left live; the leak check sees the rest
        m.free_sequence(seq_id)


def test_table_returned_by_allocate_is_live(manager):
    table = manager.allocate_sequence(0, 3)
    assert len(table) == 1
    manager.extend_sequence(0, 2)
    assert len(table) == 2 and table.table == manager.cache.block_table(0).tolist()
    assert manager.sequence_lengths[0] == 5 and dict(manager.sequence_lengths) == {0: 5}
    assert table.as_tensor().device.type == "cpu"
    with pytest.raises(InvalidArgumentError, match=r"block_table: expected a standalone BlockTable"):
        table.append(5)


def test_extension_inside_a_block_allocates_nothing(manager):
    manager.allocate_sequence(0, 5)
    free = manager.allocator.num_free
    manager.extend_sequence(0, 3)
    assert manager.allocator.num_free == free and manager.sequence_lengths[0] == 8
    manager.extend_sequence(0, 0)
    assert manager.sequence_lengths[0] == 8


def test_failed_allocate_sequence_changes_nothing(manager):
    manager.allocate_sequence(0, 20)   # 5 of 8 blocks
    before = snapshot(manager.allocator)
    with pytest.raises(RuntimeError, match=r"allocate_sequence needs 4 block\(s\), 3 free"):
        manager.allocate_sequence(1, 13)
    assert 1 not in manager.sequence_tables and len(manager.sequence_tables) == 1
    assert snapshot(manager.allocator) == before
    manager.cache.check_invariants()


def test_failed_extend_changes_nothing(manager):
    manager.allocate_sequence(0, 30)
    table_before = manager.sequence_tables[0].table
    with pytest.raises(AllocatorOutOfBlocksError, match=r"extend_sequence needs 1 block\(s\), 0 free"):
        manager.extend_sequence(0, 3)
    assert manager.sequence_tables[0].table == table_before and manager.sequence_lengths[0] == 30


def test_unknown_and_duplicate_sequences(manager):
    manager.allocate_sequence(0, 4)
    with pytest.raises(SequenceExistsError, match=r"seq_id: expected a new sequence id, got 0 \(already live\)"):
        manager.allocate_sequence(0, 4)
    assert manager.sequence_lengths[0] == 4
    with pytest.raises(KeyError, match=r"seq_id: expected a live sequence id, got 9 \(unknown\)"):
        manager.extend_sequence(9, 1)
    with pytest.raises(SequenceNotFoundError):
        manager.sequence_tables[9]
    with pytest.raises(InvalidArgumentError, match=r"additional_tokens: expected an int >= 0, got -2"):
        manager.extend_sequence(0, -2)
    manager.free_sequence(9)   # ignored, as in the seed
    assert manager.sequence_lengths[0] == 4


def test_slots_address_the_arena(manager):
    manager.allocate_sequence(0, 6)
    slots = manager.get_slot_mapping(0, 2, 4)
    blocks = manager.sequence_tables[0].table
    assert slots.dtype == torch.int64
    assert slots.tolist() == [blocks[0] * 4 + 2, blocks[0] * 4 + 3, blocks[1] * 4, blocks[1] * 4 + 1]
    key = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)
    manager.cache.write(1, slots, key, -key)
    layer = manager.layer_cache(1)   # [num_blocks, 2, block_size, heads, head_dim]
    assert torch.equal(layer[blocks[1], 0, 1], key[3])
    assert torch.equal(layer[blocks[0], 1, 2], -key[0])
    with pytest.raises(InvalidArgumentError, match=r"starts, counts: expected a range inside the 6 reserved tokens"):
        manager.get_slot_mapping(0, 4, 3)


def test_fork_shares_blocks_and_copies_on_write(manager):
    manager.allocate_sequence(0, 6)
    slots = manager.get_slot_mapping(0, 0, 6)
    key = torch.randn(6, 2, 4)
    manager.cache.write(0, slots, key, key)
    manager.fork_sequence(0, 1)
    shared = manager.sequence_tables[0].table
    assert manager.sequence_tables[1].table == shared
    assert all(manager.allocator.get_ref_count(b) == 2 for b in shared)
    manager.extend_sequence(1, 1)   # writes into the shared partial block: copied first
    child = manager.sequence_tables[1].table
    assert child[0] == shared[0] and child[1] != shared[1]
    assert manager.allocator.get_ref_count(shared[1]) == 1
    k_child, _ = manager.cache.gather(1, 0)
    assert torch.equal(k_child[:6], key)
    manager.free_sequence(0)
    manager.free_sequence(1)
    assert manager.allocator.num_free == 8
    manager.cache.check_invariants()


def test_manager_allocator_is_a_read_only_view(manager):
    manager.allocate_sequence(0, 4)
    block = manager.sequence_tables[0][0]
    assert manager.allocator.get_ref_count(block) == 1
    for call in (lambda: manager.allocator.allocate(), lambda: manager.allocator.free(block),
                 lambda: manager.allocator.add_ref(block)):
        with pytest.raises(InvalidArgumentError, match=r"allocator: expected a standalone BlockAllocator"):
            call()
    assert manager.allocator.ref_counts == {block: 1}
    manager.cache.check_invariants()


def test_stats(manager):
    manager.allocate_sequence(0, 9)
    assert manager.get_stats() == {
        "total_blocks": 8, "free_blocks": 5, "used_blocks": 3, "utilization": 3 / 8,
        "num_sequences": 1, "total_memory_gb": manager.config.total_memory_gb,
    }
    assert manager.kv_cache.numel() * manager.kv_cache.element_size() == 8 * manager.config.bytes_per_block


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_default_device_without_a_gpu():
    with pytest.raises(DeviceError, match=r"config.device: expected a device torch can allocate on"):
        KVCacheManager(small_config(device="cuda"))


def test_manager_rejects_a_foreign_config():
    with pytest.raises(InvalidArgumentError, match=r"config: expected a pagedkv.compat.mini_vllm.CacheConfig"):
        KVCacheManager(small_config().to_pagedkv())
