"""The block pool (kvstore/device/block_pool.py, DESIGN §1): refcounted blocks, a hash -> block map
that outlives a release (revival), LRU eviction of cached blocks that reports the hashes it drops."""
from __future__ import annotations

import pytest

from kvmesh.kvstore.device.block_pool import BlockPool, OutOfBlocks


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


def test_block_pool_rejects_an_empty_size():
    with pytest.raises(ValueError):
        BlockPool(0)
