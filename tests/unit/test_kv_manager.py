"""The KV-cache manager is the only allocator of blocks and state slots: admission is all
or nothing, a hit's resident blocks are shared (revived before anything is allocated, so
none is evicted), forks share full blocks, and freeing returns everything."""
from __future__ import annotations

import pytest
import torch

from tests.kv_parts import BT, block_data, compute, make_parts, prompt_of, request
from kvmesh.kvstore.transfer.kv_transport import TransferInFlight
from kvmesh.workers.engine.kv_manager import NO_HIT, KVLoadError
from kvmesh.workers.request import FirstToken, Resume


def test_admission_takes_a_slot_and_the_blocks_of_the_first_chunk():
    p = make_parts(num_blocks=8)
    seq = request(prompt_of(3))
    assert p.kv.allocate_slots(seq, 2 * BT + 1, NO_HIT)
    assert seq.slot is not None and len(seq.blocks) == 3
    assert p.pool.num_free == 5 and p.slots.num_free == 3
    assert all(p.pool.ref[b] == 1 for b in seq.blocks)


def test_a_running_sequence_grows_by_a_block_only_at_a_block_boundary():
    p = make_parts(num_blocks=8)
    seq = request(prompt_of(1, extra=0))
    assert p.kv.allocate_slots(seq, BT, NO_HIT) and len(seq.blocks) == 1
    seq.num_computed = BT - 1
    assert p.kv.allocate_slots(seq, 1) and len(seq.blocks) == 1
    seq.num_computed = BT
    assert p.kv.allocate_slots(seq, 1) and len(seq.blocks) == 2


def test_out_of_blocks_or_slots_allocates_nothing():
    p = make_parts(num_blocks=4, num_slots=2)
    seq = request(prompt_of(5))
    assert not p.kv.allocate_slots(seq, 5 * BT, NO_HIT)
    assert seq.slot is None and seq.blocks == []
    assert p.pool.num_free == 4 and p.slots.num_free == 2
    running = request(prompt_of(1), "running")
    assert p.kv.allocate_slots(running, BT, NO_HIT)
    running.num_computed = BT
    assert not p.kv.allocate_slots(running, 4 * BT)          # 3 free blocks, 4 needed
    assert len(running.blocks) == 1 and p.pool.num_free == 3
    other = request(prompt_of(1), "other")
    assert p.kv.allocate_slots(other, 1, NO_HIT)
    assert not p.kv.can_admit
    assert not p.kv.allocate_slots(request(prompt_of(1), "third"), 1, NO_HIT)


def test_free_returns_blocks_and_slot_and_named_blocks_stay_revivable():
    p = make_parts(num_blocks=8)
    seq = request(prompt_of(3))
    compute(p, seq)
    named = seq.blocks[:3]
    p.kv.free(seq)
    assert seq.blocks == [] and seq.slot is None
    assert p.pool.num_free == 8 and p.slots.num_free == 4
    assert all(p.pool.ref[b] == 0 and b in p.pool.cached for b in named)


def test_a_hit_revives_its_cached_blocks_before_allocating_so_none_is_evicted():
    p = make_parts(num_blocks=8)
    a, c, x = request(prompt_of(4), "a"), request(prompt_of(1, seed=9), "c"), request([5], "x")
    compute(p, a)                            # 4 named blocks + a partial one
    compute(p, c)                            # 1 named + a partial one
    assert p.kv.allocate_slots(x, 1, NO_HIT)   # holds the last block
    named, data = a.blocks[:4], [block_data(p.cache, b) for b in a.blocks[:4]]
    c_hash = c.chain[0]
    p.kv.free(a)                             # least recently freed first: a's blocks are evicted first
    p.kv.free(c)
    b = request(prompt_of(4), "b")           # the same prompt as a: its 4 full blocks are a hit
    hit = p.kv.get_computed_blocks(b)
    assert hit.num_tokens == 4 * BT and hit.resident == tuple(named)
    # 4 hit blocks + 3 new: the 2 free ones and one evicted - c's, never one of the hit
    assert p.kv.allocate_slots(b, 3 * BT, hit)
    assert b.blocks[:4] == named and len(set(b.blocks)) == 7 and p.pool.num_free == 0
    assert p.pool.lookup(c_hash) is None and all(p.pool.lookup(h) == n for h, n in zip(b.chain, named))
    assert all(p.pool.ref[n] == 1 for n in b.blocks)
    assert all(torch.equal(block_data(p.cache, n)[k], v[k]) for n, v in zip(named, data) for k in v)
    assert b.num_computed == b.cached_tokens == 4 * BT and p.prefix.stats.tier_hit_tokens["device"] == 4 * BT


def test_a_hit_that_does_not_fit_with_its_chunk_allocates_nothing_and_evicts_nothing():
    p = make_parts(num_blocks=6)
    a = request(prompt_of(4))
    compute(p, a)
    p.kv.free(a)
    b = request(prompt_of(4))
    hit = p.kv.get_computed_blocks(b)
    assert not p.kv.allocate_slots(b, 3 * BT, hit)          # 4 + 3 blocks > 6
    assert b.slot is None and b.blocks == [] and b.num_computed == 0
    assert p.pool.num_free == 6 and len(p.pool.cached) == 4 and p.slots.num_free == 4
    assert p.kv.get_computed_blocks(b).resident == hit.resident


def test_a_shared_hit_costs_no_blocks_and_counts_references():
    p = make_parts(num_blocks=8)
    a = request(prompt_of(3), "a")
    compute(p, a)
    b = request(prompt_of(3), "b")
    hit = p.kv.get_computed_blocks(b)
    free = p.pool.num_free
    assert p.kv.allocate_slots(b, 3, hit)                    # the 3 tokens after the hit: one new block
    assert b.blocks[:3] == a.blocks[:3] and all(p.pool.ref[x] == 2 for x in a.blocks[:3])
    assert p.pool.num_free == free - 1
    p.kv.free(a)
    p.kv.free(b)
    assert p.pool.num_free == 8 and all(p.pool.ref[x] == 0 for x in range(8))


def test_fork_shares_full_blocks_and_copies_the_partial_block_and_the_slot():
    p = make_parts(num_blocks=8)
    parent = request(prompt_of(2, extra=5), "p")
    compute(p, parent)
    child = request(parent.prompt, "c")
    assert p.kv.fork(parent, child)
    assert child.blocks[:2] == parent.blocks[:2] and all(p.pool.ref[b] == 2 for b in parent.blocks[:2])
    assert len(child.blocks) == 3 and child.blocks[2] != parent.blocks[2] and p.pool.ref[child.blocks[2]] == 1
    assert all(torch.equal(v, block_data(p.cache, child.blocks[2])[k])
               for k, v in block_data(p.cache, parent.blocks[2]).items())
    for lc in p.cache.layers:
        assert torch.equal(lc.ring[child.slot], lc.ring[parent.slot])
    p.kv.free(parent)
    p.kv.free(child)
    assert p.pool.num_free == 8 and p.slots.num_free == 4


def test_fork_without_a_free_slot_changes_nothing():
    p = make_parts(num_blocks=8, num_slots=1)
    parent = request(prompt_of(2, extra=5), "p")
    compute(p, parent)
    child = request(parent.prompt, "c")
    assert not p.kv.fork(parent, child)
    assert child.slot is None and child.blocks == [] and all(p.pool.ref[b] == 1 for b in parent.blocks)


def test_a_handed_off_cache_is_loaded_into_exactly_its_blocks_and_the_slot():
    p = make_parts(num_blocks=8)
    got = []
    seq = request(prompt_of(2, extra=0))     # block-aligned: the first decode token needs one more block
    seq.resume = Resume(FirstToken(7, -0.5),
                        lambda cache, blocks, slot, reused: got.append((list(blocks), slot, reused)))
    hit = p.kv.get_computed_blocks(seq)
    assert hit.num_tokens == 2 * BT and hit.handoff is seq.resume
    assert p.kv.allocate_slots(seq, 1, hit)
    assert got == [(seq.blocks[:2], seq.slot, 0)] and len(seq.blocks) == 3
    assert seq.num_computed == 2 * BT


def test_a_handoff_that_fails_to_load_raises_and_holds_nothing():
    p = make_parts(num_blocks=8)
    seq = request(prompt_of(2))

    def broken(cache, blocks, slot, reused):
        raise OSError("transfer failed")

    seq.resume = Resume(FirstToken(7, -0.5), broken)
    with pytest.raises(KVLoadError, match="transfer failed") as e:
        p.kv.allocate_slots(seq, 1, p.kv.get_computed_blocks(seq))
    assert isinstance(e.value.__cause__, OSError)
    assert seq.slot is None and seq.blocks == [] and p.pool.num_free == 8 and p.slots.num_free == 4


def test_a_handoff_given_up_in_flight_keeps_its_blocks_and_slot_until_the_transfer_is_over():
    """A timed-out NIXL READ still writes its bytes when a cut link heals: until then its
    memory must not go to another request."""
    p = make_parts(num_blocks=8)
    seq = request(prompt_of(2))
    over = []

    def timed_out(cache, blocks, slot, reused):
        raise TransferInFlight("READ timed out", lambda: bool(over))

    seq.resume = Resume(FirstToken(7, -0.5), timed_out)
    with pytest.raises(KVLoadError, match="timed out"):
        p.kv.allocate_slots(seq, 1, p.kv.get_computed_blocks(seq))
    assert seq.slot is None and seq.blocks == []
    taken = (p.pool.num_free, p.slots.num_free)
    p.kv.reap_landing()
    assert (p.pool.num_free, p.slots.num_free) == taken == (5, 3)     # 3 blocks + 1 slot still landing
    assert p.kv.landing == 1
    over.append(True)
    p.kv.reap_landing()
    assert (p.pool.num_free, p.slots.num_free) == (8, 4) and p.kv.landing == 0


def test_a_hit_that_cannot_be_written_is_served_cold_in_fresh_blocks(monkeypatch):
    p = make_parts(num_blocks=12)
    a = request(prompt_of(3), "a")
    compute(p, a)
    b = request(prompt_of(3), "b")
    hit = p.kv.get_computed_blocks(b)        # resident blocks shared with `a`, the slot rebuilt from them

    def broken(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(p.cache, "rebuild_slot", broken)
    assert p.kv.allocate_slots(b, 3, hit)
    assert b.num_computed == 0 and b.cached_tokens == 0 and b.slot is not None
    assert not set(b.blocks) & set(a.blocks) and len(b.blocks) == 4      # room for [0, 3 * BT + 3)
    assert all(p.pool.ref[x] == 1 for x in a.blocks) and p.prefix.stats.errors == 1
