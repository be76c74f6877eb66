"""KV events over a real private redis-server (kvstore/index/kv_event_stream.py): publisher -> stream ->
router index, snapshots on a gap or a late-joining router, trimming, and Redis restarted empty."""
from __future__ import annotations

import time
import uuid

import pytest
import redis

from kvmesh.cluster.messages import RouteHint
from kvmesh.cluster.serve.locator import PrefixLocator
from kvmesh.cluster.serve.routing import Candidate, decode_hint, rank_replicas
from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.index.kv_event_stream import RedisEventStream, decode, encode
from kvmesh.kvstore.index.kv_events import SNAPSHOT, KvEvent, KvEventFollower, KvEventIndex, KvEventPublisher
from tests.helpers import random_prompt, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

STORE_BYTES = 256 << 10     # the eviction test's store: well under its 24 prompts' blocks


@pytest.fixture
def namespace(redis_server):
    ns = f"evtest-{uuid.uuid4().hex[:8]}"
    yield ns
    client = redis.Redis.from_url(redis_server)
    client.delete(f"kvmesh:{ns}:events", f"kvmesh:{ns}:events:resync")
    client.close()


def router(url: str, ns: str) -> tuple[RedisEventStream, KvEventIndex, KvEventFollower]:
    stream = RedisEventStream(url, ns)
    index = KvEventIndex(stream.request_snapshot)
    return stream, index, KvEventFollower(stream, index, poll_s=0.05)


def drain(follow: KvEventFollower) -> None:
    """Apply everything there is; a connection the server dropped is reopened by the next call."""
    for _ in range(3):
        try:
            while follow.pump():
                pass
            return
        except redis.ConnectionError:
            continue


def test_events_round_trip_through_the_stream_encoding():
    for e in (KvEvent("w/dp1", "ep", 7, "stored", "host", (1, 2**64 - 1), 2.5),
              KvEvent("w", "ep", 3, SNAPSHOT, "", (), 1.0, (("device", (5, 6)), ("store", (9,))))):
        fields = encode(e)
        assert decode({k.encode(): str(v).encode() if not isinstance(v, bytes) else v
                       for k, v in fields.items()}) == e


def test_a_router_follows_publishers_over_redis(redis_server, namespace):
    stream, index, follow = router(redis_server, namespace)
    assert follow.pump() == 0                 # positions this reader at the stream's end
    pubs = [KvEventPublisher(f"r/dp{i}", RedisEventStream(redis_server, namespace), load=lambda i=i: float(i))
            for i in range(2)]
    pubs[0].stored("device", [1, 2, 3])
    pubs[1].stored("device", [1])
    pubs[1].stored("host", [2])
    pubs[0].removed("device", [3])
    drain(follow)
    assert index.longest_prefix([1, 2, 3]) == {"r/dp0": 2, "r/dp1": 2}
    assert index.loads() == {"r/dp0": 0.0, "r/dp1": 1.0}
    stream.close()


def test_a_router_started_late_resyncs_every_publisher_by_snapshot(redis_server, namespace):
    pub = KvEventPublisher("late/dp0", RedisEventStream(redis_server, namespace))
    pub.stored("device", [10, 11])            # before any router reads
    stream, index, follow = router(redis_server, namespace)
    follow.pump()
    pub.stored("device", [12])                # seq 1 of an epoch this router never saw start
    drain(follow)
    assert index.stats.gaps == 1 and index.longest_prefix([10]) == {}
    pub.beat()                                # takes the request from Redis, answers with a snapshot
    drain(follow)
    assert index.longest_prefix([10, 11, 12]) == {"late/dp0": 3}
    stream.close()


def test_a_trimmed_stream_is_a_gap_the_router_recovers_from(redis_server, namespace):
    stream, index, follow = router(redis_server, namespace)
    follow.pump()
    pub = KvEventPublisher("trim/dp0", RedisEventStream(redis_server, namespace, maxlen=1))
    pub.stored("device", [1])
    drain(follow)
    client = redis.Redis.from_url(redis_server)
    for h in range(2, 200):                   # the router is away; the stream keeps only the newest
        pub.stored("device", [h])
    client.xtrim(f"kvmesh:{namespace}:events", maxlen=1)   # what `~` does eventually, done now
    client.close()
    drain(follow)
    pub.beat()
    drain(follow)
    assert index.holdings("trim/dp0")["device"] == set(range(1, 200))
    stream.close()


def test_redis_restarted_empty_is_survived(redis_process, namespace):
    url = redis_process.url
    stream, index, follow = router(url, namespace)
    follow.pump()
    pub = KvEventPublisher("boot/dp0", RedisEventStream(url, namespace))
    pub.stored("device", [1, 2])
    drain(follow)
    redis_process.restart()                   # the stream and every request are gone
    pub.stored("device", [3])                 # lost if the old connection fails (then a backoff)
    pub.stored("device", [4])
    deadline = time.monotonic() + 10
    while index.longest_prefix([1, 2, 3, 4]) != {"boot/dp0": 4} and time.monotonic() < deadline:
        drain(follow)
        pub.beat()                            # reveals a gap, answers the resync
        drain(follow)
        time.sleep(0.1)
    assert index.longest_prefix([1, 2, 3, 4]) == {"boot/dp0": 4}
    stream.close()


def test_an_engine_publishes_what_its_pool_holds_and_a_router_sees_it(redis_server, tmp_path):
    """A real engine with the Redis index: after a prompt, the router's event index holds the
    prompt's whole blocks under the engine's worker id, and its load."""
    model = write_tiny_checkpoint(tmp_path / "m", "swa_csa_hca")
    engine = Engine(EngineConfig(model=str(model), block_tokens=16, kv_cache_bytes=16 << 20,
                                 index=redis_server, worker_id="eng-a/dp0", store=str(tmp_path / "store")))
    try:
        stream, index, follow = router(redis_server, engine.prefix.index.namespace)
        follow.pump()
        prompt = random_prompt(100, seed=3)
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        engine.prefix.events.beat()           # one heartbeat now: the snapshot this late router asked for
        drain(follow)
        engine.prefix.events.beat()
        drain(follow)
        hashes = engine.prefix.hasher.hashes(prompt[:96])
        assert index.longest_prefix(hashes, tiers=("device",)) == {"eng-a/dp0": 6}
        assert index.loads() == {"eng-a/dp0": 0.0}
        stream.close()
    finally:
        engine.close()


def test_a_pd_repeat_is_routed_to_the_decode_engine_whose_events_say_it_holds_the_prompt(redis_server, tmp_path):
    """Issue 30 item 2 with real engines (a decode pool's are this Engine): two publish over the
    Redis stream and the one that served the prompt holds its blocks, so the dispatcher's decode hint (the prefix
    hint, loads re-read) ranks its replica first, until it is busier than those blocks are worth."""
    model = write_tiny_checkpoint(tmp_path / "m", "swa_csa_hca")
    engines = [Engine(EngineConfig(model=str(model), block_tokens=16, kv_cache_bytes=16 << 20, index=redis_server,
                                   worker_id=f"dec-{w}", store=str(tmp_path / "store")))
               for w in "ab"]
    try:
        stream, index, follow = router(redis_server, engines[0].prefix.index.namespace)
        follow.pump()
        prompt = random_prompt(100, seed=30)
        engines[1].generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        for _ in range(2):                    # a snapshot each for this late router, then in sync
            for e in engines:
                e.prefix.events.beat()
            drain(follow)
        hashes = engines[1].prefix.hasher.hashes(prompt)
        prefix = RouteHint(prefix_blocks=index.longest_prefix(hashes), loads=index.loads(),
                           prompt_blocks=len(hashes), block_tokens=16)
        assert prefix.prefix_blocks == {"dec-b": 6} and prefix.loads == {"dec-a": 0.0, "dec-b": 0.0}
        hint = decode_hint(prefix, RouteHint(loads=index.loads(), block_tokens=16))
        decode = [Candidate("dec-a", 0.0, 1.0), Candidate("dec-b", 0.0, 1.0)]
        assert [rank_replicas(decode, hint, 1.0)[0] for _ in range(5)] == ["dec-b"] * 5
        index.charge("dec-b", 1000.0)         # busier than the 6 blocks are worth: the other goes first
        assert rank_replicas(decode, decode_hint(prefix, RouteHint(loads=index.loads(), block_tokens=16)),
                             1.0)[0] == "dec-a"
        stream.close()
    finally:
        for e in engines:
            e.close()


def test_the_locator_routes_from_events_without_an_index_round_trip(redis_server):
    """While events flow, a hint is the event index's answer and the prefix index is not asked;
    before any publisher is heard, the locator falls back to one index lookup."""
    fp = uuid.uuid4().hex * 2                  # a namespace of this test's own
    locator = PrefixLocator(redis_server)
    locator.configure(fp, 16)
    try:
        routes_from_events(locator, fp, redis_server)
    finally:
        locator.index.clear()
        locator.close()


def routes_from_events(locator: PrefixLocator, fp: str, redis_server: str) -> None:
    prompt = list(range(64))
    hashes = PrefixHasher(fp, 16).hashes(prompt)
    locator.index.publish_memory("r/dp1", hashes[:2], 30.0)
    assert locator.hint(prompt).prefix_blocks == {"r/dp1": 2}            # no events yet: the index
    assert locator.index.stats().lookups == 1
    pub = KvEventPublisher("r/dp0", RedisEventStream(redis_server, locator.index.namespace), load=lambda: 4.0)
    deadline = time.monotonic() + 10
    while not locator.events.live() and time.monotonic() < deadline:
        pub.beat()                                                     # seq 0: in sync at once
        time.sleep(0.05)
    pub.stored("device", hashes[:3])
    while locator.events.longest_prefix(hashes) == {} and time.monotonic() < deadline:
        time.sleep(0.05)
    hint = locator.hint(prompt)
    assert hint.prefix_blocks == {"r/dp0": 3} and hint.loads == {"r/dp0": 4.0}
    assert (hint.prompt_blocks, hint.block_tokens) == (4, 16)
    assert locator.load_hint().loads == {"r/dp0": 4.0}
    assert locator.index.stats().lookups == 1                           # no round trip this time
    assert locator.hints == {"events": 1, "index": 1, "index_slow": 0, "index_busy": 0}


def test_an_engine_under_eviction_publishes_exactly_what_its_pool_host_cache_and_store_hold(redis_server, tmp_path):
    """Small device pool, host cache and store, many distinct prompts: blocks are named, restored and
    evicted in all three tiers, and the router's event index ends equal to the engine's true holdings
    (the store's: the blocks its writer put and has not evicted)."""
    model = write_tiny_checkpoint(tmp_path / "m", "swa_csa_hca")
    engine = Engine(EngineConfig(model=str(model), block_tokens=16, kv_cache_bytes=512 << 10, max_num_seqs=2,
                                 host_cache_bytes=256 << 10, index=redis_server, worker_id="evict/dp0",
                                 store=str(tmp_path / "store"), store_capacity_bytes=STORE_BYTES))
    try:
        stream, index, follow = router(redis_server, engine.prefix.index.namespace)
        follow.pump()
        for seed in list(range(24)) + [20, 21, 0, 1]:      # the last: restored from memory, then the store
            engine.generate([random_prompt(90, seed=seed)], SamplingParams(max_tokens=3, temperature=0.0,
                                                                           ignore_eos=True))
        engine.prefix.flush()                              # every put durable (and published)
        for _ in range(2):
            engine.prefix.events.beat()
            drain(follow)
        assert engine.prefix.stats.hits and engine.prefix.events.dropped == 0
        truth = set(engine.blocks.by_hash)
        host = {h for kind, h in engine.prefix.host._items if kind == "block"}
        assert len(truth) < 24 * 5 and host                # the pool evicted: it cannot hold every prompt
        stored = set(engine.prefix.store.list("block"))
        assert engine.prefix.store.stats().evicted and stored          # the store evicted too
        held = index.holdings("evict/dp0")
        assert held["device"] == truth and held["host"] == host and held["store"] == stored
        assert index.tier_sizes()["store"] == len(stored)
        stream.close()
    finally:
        engine.close()
