"""The event-fed per-rank index (kvstore/index/kv_events.py): order, gaps, epochs, silence, snapshots."""
from __future__ import annotations

import random
import time

from kvmesh.kvstore.index.kv_events import (CLEARED, STORED, KvEvent, KvEventFollower, KvEventIndex, KvEventPublisher,
                               LocalEventBus)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lossy(LocalEventBus):
    """A real bus that loses the events a test tells it to (the network's part)."""

    def __init__(self):
        super().__init__()
        self.lose = False

    def send(self, event: KvEvent) -> None:
        if not self.lose:
            super().send(event)


def wired(clock=None, bus=None):
    bus = bus or LocalEventBus()
    index = KvEventIndex(bus.request_snapshot, expire_s=10.0, resync_s=2.0, clock=clock or Clock())
    return bus, index, KvEventFollower(bus, index, poll_s=0.0)


def test_changes_apply_in_order_and_the_longest_prefix_is_per_location():
    bus, index, follow = wired()
    a, b = KvEventPublisher("w1/dp0", bus), KvEventPublisher("w1/dp1", bus)
    a.stored("device", [1, 2, 3])
    b.stored("device", [1, 2])
    b.stored("host", [3, 4])
    a.removed("device", [3])
    follow.pump()
    assert index.longest_prefix([1, 2, 3, 4, 5]) == {"w1/dp0": 2, "w1/dp1": 4}
    assert index.longest_prefix([1, 2, 3], tiers=("device",)) == {"w1/dp0": 2, "w1/dp1": 2}
    assert index.longest_prefix([9, 1]) == {}
    assert index.holdings("w1/dp1") == {"device": {1, 2}, "host": {3, 4}, "store": set()}


def test_all_cleared_forgets_every_tier_of_that_location_only():
    bus, index, follow = wired()
    a, b = KvEventPublisher("a", bus), KvEventPublisher("b", bus)
    a.stored("device", [1, 2])
    a.stored("host", [3])
    b.stored("device", [1])
    a.cleared()
    follow.pump()
    assert index.longest_prefix([1, 2]) == {"b": 1}
    assert index.holdings("a") == {"device": set(), "host": set(), "store": set()}


def test_a_gap_drops_the_location_until_its_snapshot_restores_it():
    bus = Lossy()
    _, index, follow = wired(bus=bus)
    pub = KvEventPublisher("a", bus)
    pub.stored("device", [1])
    pub.stored("store", [1])
    bus.lose = True
    pub.stored("device", [2])         # lost
    bus.lose = False
    pub.stored("device", [3])         # seq 3 after seq 1: a gap
    follow.pump()
    assert index.stats.gaps == 1 and index.longest_prefix([1]) == {}     # never a stale answer
    assert index.resyncing() == 1 and index.tier_sizes() == {"device": 0, "host": 0, "store": 0}
    pub.beat()                        # the publisher sees the request and answers with a snapshot
    follow.pump()
    assert index.holdings("a")["device"] == {1, 2, 3} and index.stats.snapshots == 1
    assert index.resyncing() == 0 and index.tier_sizes() == {"device": 3, "host": 0, "store": 1}
    pub.removed("device", [1])        # in sync again: later changes apply
    follow.pump()
    assert index.longest_prefix([1, 2]) == {} and index.longest_prefix([2, 3]) == {"a": 2}


def test_a_heartbeat_reveals_lost_trailing_changes():
    bus = Lossy()
    _, index, follow = wired(bus=bus)
    pub = KvEventPublisher("a", bus)
    bus.lose = True
    pub.stored("device", [1, 2])
    bus.lose = False
    pub.beat()                        # seq 1 expected where the index expects 0: resync
    follow.pump()
    assert index.stats.gaps == 1
    pub.beat()
    follow.pump()
    assert index.longest_prefix([1, 2]) == {"a": 2}


def test_a_lost_snapshot_request_is_asked_again_after_resync_s():
    clock, bus = Clock(), Lossy()
    _, index, follow = wired(clock, bus)
    pub = KvEventPublisher("a", bus)
    pub.stored("device", [1])
    bus.lose = True
    pub.stored("device", [2])
    bus.lose = False
    pub.stored("device", [3])
    follow.pump()
    assert bus.snapshot_requested("a")     # someone else took the request: it is lost
    pub.beat()                            # a heartbeat, no snapshot
    follow.pump()
    assert index.holdings("a")["device"] == set()
    clock.now = 3.0
    pub.beat()                            # still out of sync past resync_s: asked again
    follow.pump()
    pub.beat()
    follow.pump()
    assert index.holdings("a")["device"] == {1, 2, 3} and index.stats.gaps == 2


def test_a_restarted_publisher_replaces_what_its_location_held():
    bus, index, follow = wired()
    KvEventPublisher("a", bus, epoch="one").stored("device", [1, 2])
    follow.pump()
    again = KvEventPublisher("a", bus, epoch="two")      # the rank restarted: an empty pool
    again.stored("device", [7])
    follow.pump()
    assert index.holdings("a")["device"] == {7} and index.stats.gaps == 0


def test_joining_an_epoch_after_its_start_resyncs_it():
    bus = Lossy()
    _, index, follow = wired(bus=bus)
    pub = KvEventPublisher("a", bus)
    bus.lose = True                       # the router was not there yet
    pub.stored("device", [1])
    bus.lose = False
    pub.stored("device", [2])
    follow.pump()
    pub.beat()
    follow.pump()
    assert index.stats.gaps == 1 and index.holdings("a")["device"] == {1, 2}


def test_a_silent_publisher_expires_and_a_beating_one_does_not():
    clock = Clock()
    bus, index, follow = wired(clock)
    quiet, alive = KvEventPublisher("quiet", bus, load=lambda: 3.0), KvEventPublisher("alive", bus)
    quiet.stored("device", [1])
    alive.stored("device", [1])
    follow.pump()
    assert index.loads() == {"quiet": 3.0, "alive": 0.0} and index.live()
    for t in (4.0, 8.0, 12.0):
        clock.now = t
        alive.beat()
        follow.pump()
    assert index.longest_prefix([1]) == {"alive": 1} and index.stats.expired == 1
    clock.now = 30.0
    follow.pump()
    assert not index.live() and index.longest_prefix([1]) == {}


def test_repeated_stores_and_absent_removals_send_nothing():
    bus = LocalEventBus()
    pub = KvEventPublisher("a", bus)
    pub.stored("device", [1, 1, 2])
    pub.stored("device", [2])
    pub.removed("device", [9])
    events = bus.read()
    assert [(e.kind, e.hashes, e.seq) for e in events] == [(STORED, (1, 2), 0)]


def test_a_full_bus_drops_its_oldest_events_and_the_index_recovers():
    bus = LocalEventBus(maxlen=4)
    _, index, follow = wired(bus=bus)
    pub = KvEventPublisher("a", bus)
    for h in range(10):
        pub.stored("device", [h])
    follow.pump()
    pub.beat()
    follow.pump()
    assert index.holdings("a")["device"] == set(range(10))


def test_the_publisher_beats_on_its_own_thread():
    bus = LocalEventBus()
    pub = KvEventPublisher("a", bus, load=lambda: 5.0, heartbeat_s=0.01).start()
    try:
        events = []
        for _ in range(200):
            events += bus.read(0.05)
            if events:
                break
    finally:
        pub.close()
    assert events and events[0].load == 5.0


def test_event_fed_index_equals_true_holdings_after_random_sequences_with_losses():
    """Property: random stores / removals / clears on several ranks, a lossy network, then one
    heartbeat round (which resyncs whoever lost something): the index is exactly the truth."""
    for seed in range(40):
        rng = random.Random(seed)
        clock, bus = Clock(), Lossy()
        _, index, follow = wired(clock, bus)
        pubs = [KvEventPublisher(f"w{i // 2}/dp{i % 2}", bus) for i in range(4)]
        truth = {p.location: {"device": set(), "host": set(), "store": set()} for p in pubs}
        for _ in range(rng.randint(10, 80)):
            p = rng.choice(pubs)
            bus.lose = rng.random() < 0.1
            op, tier = rng.random(), rng.choice(("device", "host", "store"))
            hashes = rng.sample(range(30), rng.randint(1, 5))
            if op < 0.55:
                p.stored(tier, hashes)
                truth[p.location][tier].update(hashes)
            elif op < 0.95:
                p.removed(tier, hashes)
                truth[p.location][tier].difference_update(hashes)
            else:
                p.cleared()
                truth[p.location] = {t: set() for t in truth[p.location]}
            if rng.random() < 0.3:
                follow.pump()
        bus.lose = False
        clock.now += 3.0                  # past resync_s: unanswered requests are asked again
        for _ in range(2):                # one beat reveals a gap, the next answers it
            for p in pubs:
                p.beat()
            follow.pump()
        for p in pubs:
            assert index.holdings(p.location) == truth[p.location], seed
        chain = list(range(30))
        for tier in ("device", "host", "store"):
            want = {}
            for loc, held in truth.items():
                n = next((i for i, h in enumerate(chain) if h not in held[tier]), len(chain))
                if n:
                    want[loc] = n
            assert index.longest_prefix(chain, tiers=(tier,)) == want, seed
        for chain in (list(range(30)), rng.sample(range(30), 30), []):     # the routing tiers together
            want = {}
            for loc, held in truth.items():
                n = next((i for i, h in enumerate(chain) if h not in held["device"] | held["host"]), len(chain))
                if n:
                    want[loc] = n
            assert index.longest_prefix(chain) == want, seed


def test_cleared_is_numbered_like_any_change():
    bus = LocalEventBus()
    pub = KvEventPublisher("a", bus)
    pub.cleared()
    pub.stored("host", [4])
    assert [(e.kind, e.seq) for e in bus.read()] == [(CLEARED, 0), (STORED, 1)]


def test_a_charged_load_stands_until_the_publisher_reports_again():
    bus, index, follow = wired()
    pub = KvEventPublisher("a", bus, load=lambda: 7.0)
    pub.beat()
    follow.pump()
    index.charge("a", 100.0)
    index.charge("unknown", 5.0)              # nobody to charge: ignored
    assert index.loads() == {"a": 107.0}
    pub.beat()
    follow.pump()
    assert index.loads() == {"a": 7.0}


class Broken(LocalEventBus):
    """A real bus whose sends fail while `down` (a transport that is unreachable)."""

    def __init__(self):
        super().__init__()
        self.down, self.tries = False, 0

    def send(self, event: KvEvent) -> None:
        self.tries += 1
        if self.down:
            raise ConnectionError("unreachable")
        super().send(event)


def test_a_failing_transport_is_not_tried_on_every_change_and_the_router_resyncs_after():
    clock, bus = Clock(), Broken()
    _, index, follow = wired(clock, bus)
    pub = KvEventPublisher("a", bus, clock=clock)
    pub.stored("device", [1])
    bus.down = True
    for h in range(2, 12):
        pub.stored("device", [h])                 # one try, then skipped while backing off
    assert bus.tries == 2 and pub.dropped == 10
    bus.down = False
    clock.now = 1.0                               # past the backoff: sends resume
    pub.stored("device", [12])
    follow.pump()
    pub.beat()
    follow.pump()
    assert index.holdings("a")["device"] == set(range(1, 13))


def test_a_nudge_beats_at_once_with_the_load_that_fell():
    """A request finishing nudges the publisher: the router hears the lower load now, not a whole
    heartbeat period later (a stale high load sent the next request for the prefix elsewhere)."""
    bus, load = LocalEventBus(), [67.0]
    pub = KvEventPublisher("a", bus, load=lambda: load[0], heartbeat_s=60.0).start()
    try:
        pub.stored("device", [1])
        assert [e.load for e in bus.read()] == [67.0]
        load[0] = 0.0
        pub.nudge()
        events = []
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            events = bus.read(0.05)
    finally:
        pub.close()
    assert [(e.kind, e.load) for e in events] == [("heartbeat", 0.0)]
