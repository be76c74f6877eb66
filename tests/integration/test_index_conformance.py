"""One conformance suite for every PrefixIndex (embedded and real Redis), plus the Redis
fault behaviour: an outage is a miss, never an exception, and reuse resumes by itself."""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Callable, Iterator, NamedTuple

import pytest

from kvmesh.kvstore.hashing import PrefixHasher, store_namespace
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.index.embedded import EmbeddedIndex, IndexStats, LookupResult, PrefixIndex, make_index
from kvmesh.kvstore.index.redis_index import RedisIndex


def _fingerprint() -> str:
    return uuid.uuid4().hex  # a fresh namespace per test: tests never see each other


def _chain(fingerprint: str, blocks: int = 6) -> list[int]:
    return PrefixHasher(fingerprint, 4).hashes(list(range(4 * blocks)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness(NamedTuple):
    make: Callable[..., PrefixIndex]  # a new index bound to a fingerprint (and a namespace of it)
    wait: Callable[[float], None]  # let this many seconds of lease time pass
    ttl_s: float  # a lease short enough for a fast test


@pytest.fixture(params=["embedded", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    made: list[PrefixIndex] = []
    if request.param == "embedded":
        clock = FakeClock()

        def make(fp: str, namespace: str | None = None) -> PrefixIndex:
            made.append(EmbeddedIndex(fp, clock=clock, namespace=namespace))
            return made[-1]

        def wait(seconds: float) -> None:
            clock.now += seconds

        yield Harness(make, wait, ttl_s=10.0)
    else:
        url = request.getfixturevalue("redis_server")

        def make(fp: str, namespace: str | None = None) -> PrefixIndex:
            made.append(RedisIndex(url, fp, namespace=namespace))
            return made[-1]

        yield Harness(make, time.sleep, ttl_s=0.4)  # server-clock leases, 1 ms granularity
    for index in made:
        index.clear()
        index.close()


def test_lookup_of_unknown_prefix_is_empty(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    assert index.lookup(_chain(index.fingerprint)) == LookupResult(0, (), {})
    assert index.lookup([]) == LookupResult(0, (), {})


def test_lookup_walk_stops_at_first_missing_block(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    index.publish_blocks(hs[:2] + hs[3:])  # block 2 missing
    assert index.lookup(hs).stored == 2
    index.publish_blocks([hs[2]])
    assert index.lookup(hs).stored == 6
    assert index.lookup(hs[:4]).stored == 4


def test_checkpoints_are_reported_only_inside_the_stored_prefix(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    index.publish_blocks(hs[:4])
    for i in (1, 3, 5):
        index.publish_checkpoint(hs[i])
    assert index.lookup(hs).checkpoints == (1, 3)
    index.remove_blocks([hs[2]])
    result = index.lookup(hs)
    assert (result.stored, result.checkpoints) == (2, (1,))


def test_checkpoint_namespace_is_separate_from_blocks(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    index.publish_checkpoint(hs[0])
    assert index.lookup(hs) == LookupResult(0, (), {})


def test_memory_lease_counts_leading_blocks_per_worker(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    index.publish_memory("w1", hs[:3], harness.ttl_s)
    index.publish_memory("w2", hs[:1] + hs[2:], harness.ttl_s)  # gap at block 1
    index.publish_memory("w3", hs[1:], harness.ttl_s)  # lacks block 0: holds no prefix
    assert index.lookup(hs).memory == {"w1": 3, "w2": 1}
    assert index.lookup(hs).stored == 0  # memory is not the store tier


def test_memory_lease_expires_unless_renewed(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 2)
    ttl = harness.ttl_s
    index.publish_memory("w1", hs, ttl)
    index.publish_memory("w2", hs, ttl)
    harness.wait(ttl * 0.6)
    index.publish_memory("w1", hs, ttl)  # renew w1 only
    harness.wait(ttl * 0.6)
    assert index.lookup(hs).memory == {"w1": 2}
    harness.wait(ttl * 0.6)
    assert index.lookup(hs).memory == {}


def test_remove_memory_ends_a_lease_early(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 3)
    index.publish_memory("w1", hs, harness.ttl_s)
    index.remove_memory("w1", [hs[1]])
    assert index.lookup(hs).memory == {"w1": 1}
    index.remove_memory("w-absent", hs)  # no-op


def test_remove_blocks_and_checkpoints(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 3)
    index.publish_blocks(hs)
    index.publish_checkpoint(hs[2])
    index.remove_checkpoint(hs[2])
    index.remove_blocks([hs[0]])
    assert index.lookup(hs) == LookupResult(0, (), {})
    assert index.lookup(hs[1:]).stored == 2
    index.remove_blocks(hs)
    index.remove_checkpoint(hs[0])  # removing what is absent is a no-op


def test_a_block_and_its_checkpoint_come_and_go_independently(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 3)
    index.publish_checkpoint(hs[1])                 # before its block
    index.publish_blocks(hs)
    index.publish_blocks(hs)                        # again: idempotent, the checkpoint stays
    assert index.lookup(hs) == LookupResult(3, (1,), {})
    index.remove_blocks([hs[1]])                    # the checkpoint outlives its block ...
    assert index.lookup(hs) == LookupResult(1, (), {})
    index.publish_blocks([hs[1]])                   # ... and shows again with it
    assert index.lookup(hs) == LookupResult(3, (1,), {})
    index.remove_checkpoint(hs[1])
    assert index.lookup(hs) == LookupResult(3, (), {})


def test_a_worker_whose_older_leases_expired_holds_only_the_renewed_ones(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 4)
    ttl = harness.ttl_s
    index.publish_memory("w1", hs, ttl)
    harness.wait(ttl * 0.6)
    index.publish_memory("w1", hs[:2], ttl)         # renews the first two only
    assert index.lookup(hs).memory == {"w1": 4}
    harness.wait(ttl * 0.6)
    assert index.lookup(hs).memory == {"w1": 2}


def test_a_worker_back_after_its_leases_ran_out_holds_only_what_it_publishes_again(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint, 4)
    ttl = harness.ttl_s
    index.publish_memory("w1", hs, ttl)
    index.publish_memory("w2", hs, ttl)
    harness.wait(ttl * 1.2)                         # every lease of both is over
    index.publish_memory("w1", hs[:1], ttl)         # w1 starts again, with its first block only
    assert index.lookup(hs).memory == {"w1": 1}
    index.publish_memory("w1", hs[2:], ttl)
    assert index.lookup(hs).memory == {"w1": 1}     # block 1 is not held again: a gap
    index.publish_memory("w1", hs[1:2], ttl)
    assert index.lookup(hs).memory == {"w1": 4}


def test_namespaces_isolate_fingerprints(harness: Harness) -> None:
    a, b = harness.make(_fingerprint()), harness.make(_fingerprint())
    hs = _chain(a.fingerprint)  # the *same* hash values published under both namespaces
    a.publish_blocks(hs)
    a.publish_checkpoint(hs[0])
    a.publish_memory("w1", hs, harness.ttl_s)
    assert b.lookup(hs) == LookupResult(0, (), {})
    b.publish_blocks(hs[:1])
    b.clear()
    assert a.lookup(hs) == LookupResult(6, (0,), {"w1": 6})  # clear only touched b


def test_namespaces_isolate_store_keys_of_one_fingerprint(harness: Harness) -> None:
    fp = _fingerprint()
    one, two = (harness.make(fp, store_namespace(fp, StoreKey(k * 32).key_id)) for k in "12")
    unkeyed = harness.make(fp)
    hs = _chain(fp)
    one.publish_blocks(hs)
    one.publish_checkpoint(hs[0])
    assert two.lookup(hs) == unkeyed.lookup(hs) == LookupResult(0, (), {})
    two.remove_blocks(hs)           # what a wrong-key node does after its misses
    unkeyed.clear()
    assert one.lookup(hs) == LookupResult(6, (0,), {})


def test_clear_empties_the_namespace(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    index.publish_blocks(hs)
    index.publish_checkpoint(hs[1])
    index.publish_memory("w1", hs, harness.ttl_s)
    index.clear()
    assert index.lookup(hs) == LookupResult(0, (), {})


def test_nonpositive_lease_is_rejected(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    with pytest.raises(ValueError, match="ttl_s"):
        index.publish_memory("w1", _chain(index.fingerprint, 1), 0)


def test_stats_count_lookups_hits_and_writes_the_same_way(harness: Harness) -> None:
    index = harness.make(_fingerprint())
    hs = _chain(index.fingerprint)
    assert index.stats() == IndexStats()
    index.lookup(hs)
    index.lookup([])                                   # an empty chain is no lookup
    index.publish_blocks(hs[:3])
    index.publish_blocks([])                           # nothing to write
    index.publish_checkpoint(hs[1])
    index.publish_memory("w1", hs[:1], harness.ttl_s)
    index.lookup(hs)
    assert index.stats() == IndexStats(lookups=2, hits=1, hit_blocks=3, writes=3)


@pytest.mark.parametrize("seed", range(4))
def test_long_chains_give_redis_and_embedded_the_same_answers(redis_server: str, seed: int) -> None:
    """Redis walks a chain server-side in pages of 512 keys: misses on and beside a page's edge,
    checkpoints in every page, several workers' leases ending at different blocks."""
    import random
    rng = random.Random(seed)
    fp = _fingerprint()
    hs = _chain(fp, 1500)
    redis_index, embedded = RedisIndex(redis_server, fp), EmbeddedIndex(fp)
    try:
        miss = rng.choice([0, 1, 511, 512, 513, 1023, 1024, 1200, 1500])
        stored = hs[:miss] + hs[miss + 1:]
        checkpoints = rng.sample(hs, 60)
        leases = {f"w{i}": hs[:rng.choice([0, 1, 511, 512, 900, 1500])] for i in range(3)}
        leases["late"] = hs[5:]                           # holds no leading block
        for index in (redis_index, embedded):
            index.publish_blocks(stored)
            for h in checkpoints:
                index.publish_checkpoint(h)
            for worker, chain in leases.items():
                index.publish_memory(worker, chain, 60.0)
        for chain in (hs, hs[:513], hs[:1], hs[700:]):
            assert redis_index.lookup(chain) == embedded.lookup(chain)
        assert redis_index.lookup(hs).stored == miss
    finally:
        redis_index.clear()
        redis_index.close()


@pytest.mark.parametrize("seed", range(4))
def test_leases_with_gaps_removals_and_restarts_give_redis_and_embedded_the_same_answers(
        redis_server: str, seed: int) -> None:
    """Redis counts holders from one hash of every block's holders (`m`), not worker by worker:
    leases published with gaps, removed in the middle and at the ends, renewed, and a worker
    that comes back after its leases ran out must count exactly as the embedded index does."""
    import random
    rng = random.Random(seed)
    fp = _fingerprint()
    hs = _chain(fp, 1200)
    clock = FakeClock()
    redis_index, embedded = RedisIndex(redis_server, fp), EmbeddedIndex(fp, clock=clock)
    ttl = 0.5
    try:
        def both(op: str, *args) -> None:
            for index in (redis_index, embedded):
                getattr(index, op)(*args)

        def check() -> None:
            for chain in (hs, hs[:rng.randrange(1, 1200)], hs[rng.randrange(1, 1200):]):
                assert redis_index.lookup(chain) == embedded.lookup(chain)

        workers = [f"w{i}" for i in range(5)]
        for _ in range(12):
            w = rng.choice(workers)
            a = rng.choice([0, 0, 1, 511, 512, 513, rng.randrange(1200)])
            b = rng.choice([a + 1, 1200, rng.randrange(a + 1, 1201)])
            kind = rng.choice(["publish", "publish", "gap", "remove", "remove_one"])
            if kind == "publish":
                both("publish_memory", w, hs[a:b], ttl * 100)
            elif kind == "gap":
                hole = rng.randrange(a, b)
                both("publish_memory", w, hs[a:hole] + hs[hole + 1:b], ttl * 100)
            elif kind == "remove":
                both("remove_memory", w, hs[a:b])
            else:
                both("remove_memory", w, [hs[rng.randrange(a, b)]])
            check()
        # a worker whose leases all run out, then holds again: nothing of its earlier life counts
        both("publish_memory", "brief", hs[:900], ttl)
        check()
        time.sleep(ttl * 1.2)
        clock.now += ttl * 1.2
        both("publish_memory", "brief", hs[:300] + hs[301:600], ttl * 100)
        both("publish_memory", workers[0], hs[:10], ttl * 100)
        check()
        assert redis_index.lookup(hs).memory["brief"] == 300
    finally:
        redis_index.clear()
        redis_index.close()


def test_a_silent_workers_records_leave_the_holders_hash(redis_server: str) -> None:
    """Once its leases have run out, another worker's publishes take a silent worker's
    records out of the holders hash, and its entry with them (nothing of it is left)."""
    fp = _fingerprint()
    index = RedisIndex(redis_server, fp)
    try:
        hs = _chain(fp, 3000)
        index.publish_memory("gone", hs, 0.3)
        index.publish_memory("here", hs[:2], 60.0)
        ns = f"kvmesh:{index.namespace}"
        assert b"gone@" in b"".join(index._client.hvals(f"{ns}:m"))
        time.sleep(0.4)
        index.publish_memory("here", hs[:2], 60.0)      # takes up to 2,048 of its 3,000 records
        assert index._client.zscore(f"{ns}:holders", "gone") is not None
        index.publish_memory("here", hs[:2], 60.0)      # and the rest, and its entry
        assert b"gone@" not in b"".join(index._client.hvals(f"{ns}:m"))
        assert index._client.zscore(f"{ns}:holders", "gone") is None
        assert not index._client.exists(f"{ns}:l:gone", f"{ns}:e:gone")
        assert index._client.hget(f"{ns}:t", "gone") is None
        assert index.lookup(hs).memory == {"here": 2}
    finally:
        index.clear()
        index.close()


def test_records_left_in_the_holders_hash_by_an_earlier_life_never_count(redis_server: str) -> None:
    """A worker's lease keys can go (their TTL) while the holders hash, which every worker
    renews, keeps its records: a worker that holds again gets a new token, so they never count."""
    fp = _fingerprint()
    index = RedisIndex(redis_server, fp)
    try:
        hs = _chain(fp, 4)
        index.publish_memory("w1", hs, 0.3)
        ns = f"kvmesh:{index.namespace}"
        index._client.delete(f"{ns}:l:w1", f"{ns}:e:w1", f"{ns}:holders")   # as if they had expired
        time.sleep(0.4)
        index.publish_memory("w1", hs[:1], 60.0)
        assert index.lookup(hs).memory == {"w1": 1}
    finally:
        index.clear()
        index.close()


def test_redis_hashes_stay_hashtables_so_a_page_read_is_not_a_scan(redis_server: str) -> None:
    """A hash of <= 512 small fields would be a listpack, where HMGET scans per field."""
    fp = _fingerprint()
    index = RedisIndex(redis_server, fp)
    try:
        hs = _chain(fp, 3)
        index.publish_checkpoint(hs[0])
        index.publish_memory("w1", hs, 60.0)
        ns = f"kvmesh:{index.namespace}"
        for key in (f"{ns}:s", f"{ns}:l:w1", f"{ns}:m"):
            assert index._client.object("encoding", key) == b"hashtable", key
    finally:
        index.clear()
        index.close()


# -- Redis faults ------------------------------------------------------------------


def test_redis_outage_is_a_miss_then_reuse_resumes(redis_process, caplog: pytest.LogCaptureFixture) -> None:
    fp = _fingerprint()
    hs = _chain(fp)
    index = RedisIndex(redis_process.url, fp, socket_timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2)
    index.publish_blocks(hs)
    assert index.lookup(hs).stored == 6
    redis_process.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.index.redis_index"):
            for _ in range(10):
                assert index.lookup(hs) == LookupResult(0, (), {})
                index.publish_blocks(hs)
                index.publish_memory("w1", hs, 1.0)
                index.remove_blocks(hs)
                index.clear()
                time.sleep(0.02)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "kvmesh.kvstore.index.redis_index"]
        assert len(warned) == 1     # another module's KV-event thread on the same Redis may warn too: not this index's
        assert not index.stats().healthy and index.stats().errors >= 1
    finally:
        redis_process.restart()
    deadline = time.monotonic() + 5.0
    while True:  # the restarted server is empty: publish again until it takes
        index.publish_blocks(hs)
        if index.lookup(hs).stored == 6:
            break
        assert time.monotonic() < deadline, "reuse did not resume after Redis came back"
        time.sleep(0.05)
    stats = index.stats()
    assert stats.healthy and stats.reconnects == 1
    index.clear()
    index.close()


def test_redis_backoff_skips_calls_until_the_deadline() -> None:
    clock = FakeClock()
    index = RedisIndex(
        "redis://127.0.0.1:1/0", _fingerprint(), socket_timeout_s=0.2,
        backoff_initial_s=1.0, backoff_max_s=4.0, clock=clock,
    )  # port 1: nothing listens there
    hs = _chain(index.fingerprint, 2)
    assert index.lookup(hs).stored == 0
    for _ in range(5):
        index.lookup(hs)
        index.publish_blocks(hs)
    assert (index.stats().errors, index.stats().skipped) == (1, 10)
    clock.now += 1.0  # backoff passed: one probe, which fails and doubles the backoff
    index.lookup(hs)
    clock.now += 1.0
    index.lookup(hs)
    assert (index.stats().errors, index.stats().skipped) == (2, 11)
    index.close()


def _waits(index: RedisIndex, clock: FakeClock, faults: int, step: float = 0.01) -> list[float]:
    """The time from each failed probe to the next one, stepping the fake clock by `step`."""
    hs = _chain(index.fingerprint, 1)
    waits = []
    index.lookup(hs)
    for _ in range(faults):
        errors, start = index.stats().errors, clock.now
        while index.stats().errors == errors:
            clock.now += step
            index.lookup(hs)
        waits.append(clock.now - start)
    return waits


def test_redis_backoff_waits_are_jittered_between_half_and_all_of_the_doubling_backoff() -> None:
    firsts = []
    for seed in range(8):
        clock = FakeClock()
        index = RedisIndex("redis://127.0.0.1:1/0", _fingerprint(), socket_timeout_s=0.2, backoff_initial_s=0.4,
                           backoff_max_s=1.6, clock=clock, rng=random.Random(seed))   # port 1: nothing listens
        waits = _waits(index, clock, 5)
        index.close()
        for wait, backoff in zip(waits, (0.4, 0.8, 1.6, 1.6, 1.6)):    # doubling up to the cap
            assert backoff / 2 - 0.011 <= wait <= backoff + 0.011, (seed, waits)
        firsts.append(round(waits[0], 2))
    # replicas that lost Redis at once probe it again at different times
    assert len(set(firsts)) >= 5 and max(firsts) - min(firsts) >= 0.08, firsts


def test_make_index_accepts_local_and_redis_specs_only(redis_server: str) -> None:
    fp = _fingerprint()
    assert isinstance(make_index("local", fp), EmbeddedIndex)
    redis_index = make_index(redis_server, fp)
    assert isinstance(redis_index, RedisIndex)
    redis_index.close()
    with pytest.raises(ValueError, match="memcached://x"):
        make_index("memcached://x", fp)
