"""The prefix cache finds a hit across its tiers - device pool, host cache, store (a real
ObjectStore on disk) - block by block from the fastest tier that has it, and fills the
blocks the manager gives it with exactly the bytes that were computed. A missing or
corrupt object makes the hit shorter, never wrong."""
from __future__ import annotations

import os

import torch

from kvmesh.kvstore.store.tiers import nbytes
from tests.kv_parts import BT, block_data, compute, make_parts, prompt_of, request
from kvmesh.workers.engine.kv_manager import NO_HIT
from kvmesh.workers.sampling.params import SamplingParams


def same_blocks(cache, blocks, want) -> bool:
    return all(torch.equal(block_data(cache, b)[k], w[k]) for b, w in zip(blocks, want) for k in w)


def evict_all(p) -> None:
    """Take every block once (evicting every named one), then give them back unnamed."""
    hog = request([7] * (p.pool.num_blocks * BT), "hog")
    assert p.kv.allocate_slots(hog, p.pool.num_blocks * BT, NO_HIT)
    p.kv.free(hog)


def restore(p, prompt, rid="b"):
    seq = request(prompt, rid)
    hit = p.kv.get_computed_blocks(seq)
    assert p.kv.allocate_slots(seq, len(prompt) - hit.num_tokens, hit)
    return seq, hit


def test_blocks_evicted_from_the_device_come_back_from_the_host_cache():
    p = make_parts(num_blocks=8)
    a = request(prompt_of(4), "a")
    compute(p, a)
    want = [block_data(p.cache, b) for b in a.blocks[:4]]
    p.kv.free(a)
    evict_all(p)
    assert p.pool.by_hash == {}
    b, hit = restore(p, prompt_of(4))
    assert hit.resident == (None,) * 4 and hit.restore.tiers == ("host",) * 4
    assert same_blocks(p.cache, b.blocks[:4], want)
    assert b.cached_tokens == b.num_computed == 4 * BT
    assert [p.pool.lookup(h) for h in b.chain[:4]] == b.blocks[:4]      # named again: a device hit next
    assert p.prefix.stats.blocks_from_host == 4 and p.prefix.stats.tier_hit_tokens["host"] == 4 * BT


def test_a_fresh_worker_restores_from_the_store_what_another_wrote(tmp_path):
    writer = make_parts(tmp_path)
    a = request(prompt_of(4), "a")
    compute(writer, a)
    want = [block_data(writer.cache, b) for b in a.blocks[:4]]
    reader = make_parts(tmp_path)              # empty pool and host cache, the same store
    b, hit = restore(reader, prompt_of(4))
    assert hit.restore.tiers == ("store",) * 4
    assert same_blocks(reader.cache, b.blocks[:4], want)
    assert reader.store.stats().reads == 4
    assert reader.prefix.stats.bytes_loaded == sum(nbytes(o) for o in hit.restore.loaded.values()) > 0
    assert reader.prefix.stats.tier_hit_tokens == {"device": 0, "host": 0, "store": 4 * BT}


def test_each_block_comes_from_the_fastest_tier_that_has_it(tmp_path):
    block_bytes = nbytes(make_parts().cache.block_state(0))
    p = make_parts(tmp_path, num_blocks=12, host_bytes=3 * block_bytes)   # the host keeps the last 3 written
    a = request(prompt_of(5), "a")
    compute(p, a)                               # named on the device, all 5 in the store, 2..4 in the host
    want = [block_data(p.cache, x) for x in a.blocks[:5]]
    p.kv.free(a)
    hog = request([7] * (12 * BT), "hog")       # evict the 3 least recently freed named blocks: 0, 1, 2
    assert p.kv.allocate_slots(hog, (p.pool.num_free - 2) * BT, NO_HIT)
    p.kv.free(hog)
    assert [p.pool.lookup(h) is not None for h in a.chain[:5]] == [False, False, False, True, True]
    b, hit = restore(p, prompt_of(5), "b")
    assert hit.restore.tiers == ("store", "store", "host", "device", "device")
    assert same_blocks(p.cache, b.blocks[:5], want)
    assert p.prefix.stats.tier_hit_tokens == {"device": 2 * BT, "host": BT, "store": 2 * BT}


def test_a_corrupt_store_object_truncates_the_hit_and_is_removed(tmp_path):
    writer = make_parts(tmp_path)
    compute(writer, request(prompt_of(5), "w"))
    chain = writer.prefix.chain(request(prompt_of(5)), 5)
    path = writer.store._path("block", chain[3])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(data)
    reader = make_parts(tmp_path)
    b, hit = restore(reader, prompt_of(5))
    assert hit.num_tokens == 3 * BT and b.cached_tokens == 3 * BT
    assert reader.prefix.stats.truncated_hits == 1
    assert reader.store.stats().corrupt == 1 and not reader.store.contains("block", chain[3])


def test_a_missing_store_object_truncates_the_hit_and_is_dropped_from_the_index(tmp_path):
    writer = make_parts(tmp_path)
    compute(writer, request(prompt_of(5), "w"))
    chain = writer.prefix.chain(request(prompt_of(5)), 5)
    reader = make_parts(tmp_path)               # its index lists all 5
    assert reader.prefix.index.lookup(chain).stored == 5
    os.unlink(writer.store._path("block", chain[2]))
    b, hit = restore(reader, prompt_of(5))
    assert hit.num_tokens == 2 * BT and reader.prefix.stats.truncated_hits == 1
    assert reader.prefix.index.lookup(chain).stored == 2


def test_a_checkpoint_restores_the_state_it_saved_and_a_missing_one_is_a_miss(tmp_path):
    policy = f"periodic:{2 * BT}"
    writer = make_parts(tmp_path, policy)
    a = request(prompt_of(4), "a")
    compute(writer, a)                          # checkpoints at the prompt's last block boundary
    state = writer.cache.slot_state(a.slot, 4 * BT)
    reader = make_parts(tmp_path, policy)
    b, hit = restore(reader, prompt_of(4))
    assert hit.num_tokens == 4 * BT and hit.restore.plan.checkpoint == 3 and hit.restore.state is not None
    got = reader.cache.slot_state(b.slot, 4 * BT)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    other = make_parts(tmp_path, policy)
    ckpt = writer.prefix.chain(a, 4)[3]
    writer.store.delete("checkpoint", ckpt)
    assert other.kv.get_computed_blocks(request(prompt_of(4))) == NO_HIT
    assert other.prefix.stats.truncated_hits == 1


def test_a_request_that_wants_prompt_logprobs_is_never_restored():
    p = make_parts()
    compute(p, request(prompt_of(3), "a"))
    seq = request(prompt_of(3), "b")
    seq.params = SamplingParams(max_tokens=4, prompt_logprobs=0)
    assert p.kv.get_computed_blocks(seq) == NO_HIT and p.prefix.stats.lookups == 0
    assert p.kv.get_computed_blocks(request(prompt_of(3), "c")).num_tokens == 3 * BT


def test_released_blocks_are_reported_to_the_index_once_evicted(tmp_path):
    p = make_parts(tmp_path, num_blocks=8)
    a = request(prompt_of(3), "a")
    compute(p, a)
    hashes = a.chain[:3]
    assert p.prefix.index.lookup(hashes).memory          # published as held in this worker's memory
    p.kv.free(a)
    assert p.prefix.index.lookup(hashes).memory          # freed but revivable: still there
    evict_all(p)
    p.prefix.after_step(request([1], "idle"))            # the next step reports evictions
    assert not p.prefix.index.lookup(hashes).memory
