"""Block pool, slot pool, cache layout sizes and the memory split (DESIGN §1)."""
from __future__ import annotations

import pytest

from kvstore.block_pool import BlockPool, OutOfBlocks
from kvstore.cache_tensors import size_pools
from kvstore.layout import CSA, HCA, SWA, CacheLayout, LayoutError, LayoutParams
from kvstore.state_slots import OutOfSlots, SlotPool

V4_PRO_TYPES = (HCA, HCA) + (CSA, HCA) * 29 + (CSA,)
V4_PRO = LayoutParams(layer_types=V4_PRO_TYPES, head_dim=512, index_head_dim=128, csa_ratio=4, hca_ratio=128,
                      window=128, dtype="bfloat16")


# ---- BlockPool ------------------------------------------------------------------------------------
def test_allocate_release_and_refcount():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert a != b and pool.num_free == 1 and pool.ref[a] == 1
    pool.set_hash(a, 5)
    assert pool.acquire(5) == a and pool.ref[a] == 2           # a second holder
    pool.release(a)
    assert pool.num_free == 1             # still referenced
    pool.release(a)
    assert pool.num_free == 2 and pool.can_allocate(2) and not pool.can_allocate(3)
    assert pool.lookup(5) == a                                 # cached until evicted
    with pytest.raises(AssertionError, match="double free"):
        pool.release(a)


def test_out_of_blocks_when_everything_is_referenced():
    pool = BlockPool(2)
    held = [pool.allocate(), pool.allocate()]
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.release(held[0])
    assert pool.allocate() == held[0]


def test_released_hashed_block_is_revived_by_acquire():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.set_hash(b, 0xABC)
    pool.release(b)
    assert pool.num_free == 2 and pool.lookup(0xABC) == b     # cached, not forgotten
    assert pool.acquire(0xABC) == b
    assert pool.ref[b] == 1 and pool.num_free == 1
    assert pool.acquire(0xABC) == b and pool.ref[b] == 2       # shared by a second request
    assert pool.acquire(0xDEF) is None


def test_set_hash_keeps_the_first_block_holding_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.set_hash(a, 7)
    pool.set_hash(b, 7)
    assert pool.lookup(7) == a and pool.block_hash[b] is None


def test_lru_eviction_of_cached_blocks_reports_evicted_hashes():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for h, b in zip((101, 102, 103), blocks):
        pool.set_hash(b, h)
    for b in (blocks[1], blocks[0], blocks[2]):                # freed in this order: LRU is 102, 101, 103
        pool.release(b)
    pool.acquire(101)
    pool.release(blocks[0])                                    # touched again: now most recent
    assert pool.allocate() == blocks[1]
    assert pool.allocate() == blocks[2]
    assert pool.evicted_hashes == [102, 103]
    assert pool.lookup(102) is None and pool.lookup(103) is None and pool.lookup(101) == blocks[0]
    assert pool.allocate() == blocks[0] and pool.evicted_hashes == [102, 103, 101]
    with pytest.raises(OutOfBlocks):
        pool.allocate()


def test_never_hashed_free_blocks_are_used_before_evicting_cached_ones():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.set_hash(a, 1)
    pool.release(a)
    b = pool.allocate()
    assert b != a and pool.lookup(1) == a and pool.evicted_hashes == []


def test_pools_reject_empty_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        SlotPool(0)


# ---- SlotPool ------------------------------------------------------------------------------------
def test_slot_pool_allocates_each_slot_once():
    pool = SlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfSlots):
        pool.allocate()
    pool.release(slots[1])
    assert pool.num_free == 1 and pool.allocate() == slots[1]
    pool.release(slots[0])
    with pytest.raises(AssertionError, match="double free"):
        pool.release(slots[0])


# ---- layout -----------------------------------------------------------------------------------------
def test_v4_pro_classical_cache_is_9848_bytes_per_token():
    layout = CacheLayout.build(V4_PRO, 128)
    assert layout.layer_count_by_type() == {CSA: 30, HCA: 31}
    assert layout.bytes_per_token() == 9848
    per_type = layout.bytes_per_token_by_type()
    assert per_type[CSA] == 30 * (512 + 128) * 2 / 4 and per_type[HCA] == 31 * 512 * 2 / 128
    classical = layout.bytes_per_token() * 2 ** 20
    assert round(classical / 2 ** 30, 2) == 9.62
    assert layout.footprint(2 ** 20) == classical + layout.slot_bytes


def test_block_and_slot_bytes_per_layer_type():
    params = LayoutParams((SWA, CSA, HCA), head_dim=64, index_head_dim=32, csa_ratio=4, hca_ratio=16,
                          window=8, dtype="float32")
    layout = CacheLayout.build(params, 32)
    csa_block = (32 // 4) * (64 + 32) * 4
    hca_block = (32 // 16) * 64 * 4
    assert layout.block_bytes == csa_block + hca_block
    ring = 8 * 64 * 4
    csa_state = ring + (2 * 4 * 2 * 64 + 2 * 4 * 2 * 32 + 2 * 4 * 64 + 2 * 4 * 32) * 4
    hca_state = ring + 2 * 16 * 64 * 4
    assert layout.slot_bytes == ring + csa_state + hca_state
    assert layout.footprint(33) == 2 * layout.block_bytes + layout.slot_bytes
    assert layout.swa_bytes_per_token() == 3 * 64 * 4


@pytest.mark.parametrize("block_tokens", [64, 96, 0, -128])
def test_block_tokens_not_a_multiple_of_the_ratio_lcm_is_refused(block_tokens):
    with pytest.raises(LayoutError, match="multiple of 128"):
        CacheLayout.build(V4_PRO, block_tokens)


def test_unknown_cache_dtype_is_refused():
    with pytest.raises(LayoutError, match="unsupported cache dtype"):
        CacheLayout.build(LayoutParams((CSA,), 64, 32, 4, 128, 8, dtype="float64"), 128)


def test_swa_only_model_accepts_any_block_size():
    layout = CacheLayout.build(LayoutParams((SWA, SWA), 64, 32, 4, 128, 8, "bfloat16"), 5)
    assert layout.block_bytes == 0 and layout.slot_bytes == 2 * 8 * 64 * 2


# ---- memory split ---------------------------------------------------------------------------------
def test_size_pools_splits_the_budget_into_slots_and_blocks():
    layout = CacheLayout.build(V4_PRO, 128)
    budget = 1 << 30
    blocks, slots = size_pools(layout, budget, max_slots=16)
    assert slots == 16
    assert slots * layout.slot_bytes + blocks * layout.block_bytes <= budget
    assert budget - (slots * layout.slot_bytes + blocks * layout.block_bytes) < layout.block_bytes


def test_size_pools_leaves_each_slot_room_for_a_block_when_memory_is_short():
    layout = CacheLayout.build(V4_PRO, 128)
    budget = 3 * (layout.slot_bytes + layout.block_bytes) + 10
    blocks, slots = size_pools(layout, budget, max_slots=64)
    assert slots == 3 and blocks >= slots
    assert slots * layout.slot_bytes + blocks * layout.block_bytes <= budget


@pytest.mark.parametrize("swa_blocks", [False, True])
def test_layout_sizes_equal_what_the_cache_tensors_allocate(swa_blocks):
    import torch

    from kvstore.cache_tensors import CacheTensors
    from kvstore.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
    layout = CacheLayout.build(LayoutParams((SWA, CSA, HCA, CSA), 64, 32, 4, 128, 64, "float32"), 128)
    cache = CacheTensors(layout, num_blocks=3, num_slots=2, dtype=torch.float32, swa_blocks=swa_blocks)
    per_block = sum(t[0].numel() * t.element_size() for lc in cache.layers for t in lc.blocks.values())
    per_slot = sum(t[0].numel() * t.element_size() for lc in cache.layers for t in [lc.ring, *lc.tails.values()])
    assert per_block == layout.resident_block_bytes(swa_blocks)
    assert per_slot == layout.slot_bytes
