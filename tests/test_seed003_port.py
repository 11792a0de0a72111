"""Seed 003's test file (``mini_vllm/tests/python/test_kv_cache.py``), run on pagedkv.

The tests are the seed's, verbatim, except for these changes:

1. Import. ``from mini_vllm.kv_cache import ...`` became
   ``from pagedkv.compat.mini_vllm import ...``: the adapter's module.

2. ``test_cache_shape``. The seed asserted ``kv_cache.shape == (100, 2, 16, 8, 128)``
   with ``num_layers=32``: its ``kv_cache`` held ONE layer and ignored ``num_layers``
   (so did its ``bytes_per_block`` and ``total_memory_gb``), while a model with 32
   layers needs 32 of them. pagedkv keeps every layer in one arena, so ``kv_cache`` is
   ``(32, 100, 2, 16, 8, 128)`` and each layer (``kv_cache[layer]``,
   ``layer_cache(layer)``) has the seed's per-layer shape, which is still
   ``config.kv_cache_shape``. The test now asserts all three.

3. ``test_extend_sequence``, a comment only. The seed's comment said "Extend within
   same block" before asserting 2 blocks. The assertion is right and kept: 16 + 10 =
   26 tokens need ceil(26 / 16) = 2 blocks; the first extension crosses into a second
   block. The comment now says so. (Then 26 + 20 = 46 tokens need 3 blocks, as
   asserted.)

4. The ``cache_manager`` fixture frees, after each test, the sequences the test left
   allocated (the seed's tests end with live sequences). pagedkv's test suite checks
   after every test that each cache it made ends with every block free, to catch
   leaks in the library; this keeps that check meaningful here.

Nothing else changed, apart from this docstring, which replaces the seed's one-line
"Test KV Cache Implementation". In particular ``test_allocation_failure`` still expects
``RuntimeError``: the adapter raises ``AllocatorOutOfBlocksError``, which is both
pagedkv's ``OutOfBlocksError`` (a ``MemoryError``) and a ``RuntimeError``.

Adapter deviations that these tests do not observe (so no test changed for them):
``get_slot_mapping`` returns int64 slots, not int32 (pagedkv's slot dtype, which
``PagedKVCache.write`` requires); blocks are taken from the front of pagedkv's free
queue rather than popped from the back of a list. ``tests/test_compat_mini_vllm.py``
covers these and the rest of the adapter.
"""

import pytest
import torch
from pagedkv.compat.mini_vllm import CacheConfig, BlockAllocator, KVCacheManager


class TestBlockAllocator:
    def test_basic_allocation(self):
        allocator = BlockAllocator(num_blocks=100)

        # Allocate single block
        block = allocator.allocate()
        assert block >= 0 and block < 100
        assert allocator.num_free == 99
        assert allocator.get_ref_count(block) == 1

        # Free block
        allocator.free(block)
        assert allocator.num_free == 100
        assert allocator.get_ref_count(block) == 0

    def test_batch_allocation(self):
        allocator = BlockAllocator(num_blocks=100)

        blocks = allocator.allocate_n(10)
        assert len(blocks) == 10
        assert allocator.num_free == 90

        for block in blocks:
            allocator.free(block)
        assert allocator.num_free == 100

    def test_reference_counting(self):
        allocator = BlockAllocator(num_blocks=10)

        block = allocator.allocate()
        assert allocator.get_ref_count(block) == 1

        # Add references (for sharing)
        allocator.add_ref(block)
        allocator.add_ref(block)
        assert allocator.get_ref_count(block) == 3

        # Free requires 3 calls now
        allocator.free(block)
        assert allocator.get_ref_count(block) == 2
        allocator.free(block)
        assert allocator.get_ref_count(block) == 1
        allocator.free(block)
        assert allocator.get_ref_count(block) == 0
        assert allocator.num_free == 10

    def test_allocation_failure(self):
        allocator = BlockAllocator(num_blocks=5)

        allocator.allocate_n(5)

        with pytest.raises(RuntimeError):
            allocator.allocate()


class TestKVCacheManager:
    @pytest.fixture
    def cache_manager(self):
        config = CacheConfig(
            num_blocks=100,
            block_size=16,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=torch.float16,
            device="cpu"  # Use CPU for tests
        )
        manager = KVCacheManager(config)
        yield manager
        for seq_id in list(manager.sequence_tables):
            manager.free_sequence(seq_id)

    def test_allocate_sequence(self, cache_manager):
        table = cache_manager.allocate_sequence(seq_id=0, num_tokens=50)

        # 50 tokens @ 16 per block = 4 blocks
        assert len(table) == 4
        assert cache_manager.allocator.num_free == 96

    def test_extend_sequence(self, cache_manager):
        table = cache_manager.allocate_sequence(seq_id=0, num_tokens=16)
        assert len(table) == 1

        # Extend past the first block: 16 + 10 = 26 tokens need 2 blocks
        cache_manager.extend_sequence(seq_id=0, additional_tokens=10)
        assert len(cache_manager.sequence_tables[0]) == 2  # Now needs 2 blocks

        # Extend to need third block
        cache_manager.extend_sequence(seq_id=0, additional_tokens=20)
        assert len(cache_manager.sequence_tables[0]) == 3

    def test_slot_mapping(self, cache_manager):
        cache_manager.allocate_sequence(seq_id=0, num_tokens=32)

        # Get slots for first 16 tokens (first block)
        slots = cache_manager.get_slot_mapping(seq_id=0, start_pos=0, num_tokens=16)

        table = cache_manager.sequence_tables[0]
        block0 = table[0]

        # Slots should be block0 * 16 + offset
        for i, slot in enumerate(slots.tolist()):
            assert slot == block0 * 16 + i

    def test_free_sequence(self, cache_manager):
        cache_manager.allocate_sequence(seq_id=0, num_tokens=64)
        cache_manager.allocate_sequence(seq_id=1, num_tokens=64)

        assert cache_manager.allocator.num_free == 92

        cache_manager.free_sequence(seq_id=0)
        assert cache_manager.allocator.num_free == 96
        assert 0 not in cache_manager.sequence_tables

    def test_cache_shape(self, cache_manager):
        expected_shape = (100, 2, 16, 8, 128)
        # Changed (see the module docstring): all 32 layers, each of the seed's shape.
        assert cache_manager.config.kv_cache_shape == expected_shape
        assert cache_manager.kv_cache.shape == (32,) + expected_shape
        assert cache_manager.kv_cache[0].shape == expected_shape
        assert cache_manager.layer_cache(31).shape == expected_shape

    def test_stats(self, cache_manager):
        cache_manager.allocate_sequence(seq_id=0, num_tokens=48)

        stats = cache_manager.get_stats()
        assert stats["total_blocks"] == 100
        assert stats["used_blocks"] == 3
        assert stats["num_sequences"] == 1


if __name__ == "__main__":
    pytest.main([__file__, "-v"])
