"""KV cache events: what every engine rank holds, pushed to the router (DESIGN §11).

    engine rank                                            router (ingress)
    KvEventPublisher ── stored / removed / cleared ──▶ transport ──▶ KvEventFollower ─▶ KvEventIndex
                     ── heartbeat (load) / snapshot ─▶            (one thread)        (longest_prefix, loads)

Transports: `LocalEventBus` (a bounded in-process queue: the embedded index, tests, the router
bench) and `kvmesh.kvstore.index.kv_event_stream.RedisEventStream` (one Redis stream per namespace).

Numbering. Every event names its publisher's location (the name the prefix index's memory tier
uses: `{worker}` or `{worker}/dp{rank}`), an epoch (new at every start) and a sequence number.
Changes (stored, removed, cleared) take seq 0, 1, 2, ... of their epoch; a heartbeat or a snapshot
carries the next seq without taking it (so a heartbeat also reveals lost trailing changes). The index
applies a location's changes in order; a gap, or an epoch first seen after its seq 0, puts that
location in resync: its entries are dropped, a snapshot is requested through the transport (again
every `resync_s` until one comes) and its changes are ignored until a snapshot (the publisher's full
holdings at that seq) arrives. A location that sends nothing for `expire_s` is forgotten.

Tiers. `device` and `host` are a rank's own memory (the prefix cache publishes them); `store` is the
shared store, where a rank's store publishes the blocks it put and those it removed (evicted, rejected;
kvstore/store/object_store.py). The store is global: a block there is restorable by every rank alike, so it tells
ranks apart by nothing and routing scores ranks on the memory tiers only (`ROUTING_TIERS`); the index
keeps the store tier per publisher like the others (snapshots, resyncs, expiry) and counts it in
`tier_sizes` (/metrics). It is what each rank put and has not itself removed, not the store's listing:
a block one rank put and another evicted stays under the first (a stale hint, as below).

Everything here is a hint: a lost, late or stale event costs a cache hit, never a wrong answer (the
engine still checks its own pool, and the store is the truth).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from kvmesh.kvstore.log_once import LogOnce

log = logging.getLogger(__name__)

TIERS = ("device", "host", "store")
ROUTING_TIERS = ("device", "host")      # what a rank can restore without the shared store
STORED, REMOVED, CLEARED, HEARTBEAT, SNAPSHOT = "stored", "removed", "cleared", "heartbeat", "snapshot"
CHANGES = (STORED, REMOVED, CLEARED)
HEARTBEAT_S = 1.0           # a publisher's heartbeat period (it also answers snapshot requests then)
EXPIRE_S = 10.0             # silence after which the router forgets a publisher
RESYNC_S = 2.0              # how long the router waits for a snapshot before asking again
BACKOFF_S = 0.1             # a publisher's first pause after a failed send (doubling)
NUDGE_S = 0.05              # the shortest gap between two beats (a nudged beat waits this long)


@dataclass(frozen=True)
class KvEvent:
    """One message from a publisher. `hashes`: the blocks a change names (cleared: none, every
    tier); `held`: a snapshot's holdings, per tier; `load`: the publisher's load when it sent this."""
    location: str
    epoch: str
    seq: int
    kind: str
    tier: str = "device"
    hashes: tuple[int, ...] = ()
    load: float = 0.0
    held: tuple[tuple[str, tuple[int, ...]], ...] = ()


class EventTransport(Protocol):
    """Carries events from publishers to routers. A failed `send` may raise or drop the event:
    either way the router sees a gap and resyncs."""

    def send(self, event: KvEvent) -> None: ...

    def snapshot_requested(self, location: str) -> bool:
        """Publisher side: whether a router asked `location` for a snapshot (the request is consumed)."""

    def read(self, timeout_s: float) -> list[KvEvent]:
        """Router side: the events since the last read, in order (waits up to `timeout_s` for one)."""

    def request_snapshot(self, location: str) -> None: ...


class LocalEventBus:
    """In-process transport: a bounded queue (the oldest events are dropped when full: a gap the
    index resyncs from) and a set of snapshot requests. One reader; thread-safe."""

    def __init__(self, maxlen: int = 65536):
        self._queue: deque[KvEvent] = deque(maxlen=maxlen)
        self._wanted: set[str] = set()
        self._ready = threading.Condition()

    def send(self, event: KvEvent) -> None:
        with self._ready:
            self._queue.append(event)
            self._ready.notify()

    def snapshot_requested(self, location: str) -> bool:
        with self._ready:
            wanted = location in self._wanted
            self._wanted.discard(location)
            return wanted

    def read(self, timeout_s: float = 0.0) -> list[KvEvent]:
        with self._ready:
            if not self._queue and timeout_s > 0:
                self._ready.wait(timeout_s)
            out = list(self._queue)
            self._queue.clear()
            return out

    def request_snapshot(self, location: str) -> None:
        with self._ready:
            self._wanted.add(location)


class KvEventPublisher:
    """One engine rank's side: numbers and sends its changes, heartbeats with its load, answers
    snapshot requests. Keeps its own holdings per tier (a snapshot's source; repeated stores and
    removals of absent hashes send nothing). Thread-safe: the engine thread reports changes, the
    heartbeat thread (`start`) beats."""

    def __init__(self, location: str, transport: EventTransport, load: Callable[[], float] = lambda: 0.0,
                 epoch: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.location, self.transport, self.load = location, transport, load
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self.heartbeat_s, self._clock = heartbeat_s, clock
        self.seq = 0
        self.dropped = 0                # events not sent (a failed send, or skipped while backing off)
        self._backoff_s, self._retry_at = 0.0, 0.0
        self.held: dict[str, set[int]] = {t: set() for t in TIERS}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()          # `nudge`: beat now, not at the next period
        self._thread: threading.Thread | None = None
        self._warn = LogOnce(log)

    def stored(self, tier: str, hashes: Iterable[int]) -> None:
        with self._lock:
            new = [h for h in dict.fromkeys(hashes) if h not in self.held[tier]]
            if new:
                self.held[tier].update(new)
                self._change(STORED, tier, new)

    def removed(self, tier: str, hashes: Iterable[int]) -> None:
        with self._lock:
            gone = [h for h in dict.fromkeys(hashes) if h in self.held[tier]]
            if gone:
                self.held[tier].difference_update(gone)
                self._change(REMOVED, tier, gone)

    def cleared(self) -> None:
        with self._lock:
            for held in self.held.values():
                held.clear()
            self._change(CLEARED, "", ())

    def beat(self) -> None:
        """A heartbeat with the current load, or a snapshot when a router asked for one."""
        if self._backing_off():
            return
        try:
            wanted = self.transport.snapshot_requested(self.location)
        except Exception as e:
            self._failed(e)
            return
        with self._lock:
            held = tuple((t, tuple(hs)) for t, hs in self.held.items() if hs) if wanted else ()
            self._send(KvEvent(self.location, self.epoch, self.seq, SNAPSHOT if wanted else HEARTBEAT,
                               load=self.load(), held=held))

    def _change(self, kind: str, tier: str, hashes: Sequence[int]) -> None:
        event = KvEvent(self.location, self.epoch, self.seq, kind, tier, tuple(hashes), self.load())
        self.seq += 1           # taken even when the send fails: the router sees the gap
        self._send(event)

    def _send(self, event: KvEvent) -> None:
        if self._backing_off():
            self.dropped += 1
            return
        try:
            self.transport.send(event)
        except Exception as e:      # events are hints: the router resyncs on the gap
            self.dropped += 1
            self._failed(e)
            return
        self._backoff_s = 0.0

    def _backing_off(self) -> bool:
        """After a failure nothing is sent until a backoff (doubling, up to EXPIRE_S) passes: a
        transport that hangs must not stall the engine's steps on every change."""
        return self._backoff_s > 0 and self._clock() < self._retry_at

    def _failed(self, e: Exception) -> None:
        self._backoff_s = min(2 * self._backoff_s or BACKOFF_S, EXPIRE_S)
        self._retry_at = self._clock() + self._backoff_s
        self._warn(type(e).__name__, "kv events of %s: %s: %s (the router resyncs when they flow again)",
                   self.location, type(e).__name__, e)

    def nudge(self) -> None:
        """Ask the heartbeat thread to beat now (the engine calls this when a request finishes: a
        load that fell must not stay stale at the router for a whole period, or the next request
        for the prefix this rank holds goes elsewhere). Never blocks; beats stay `NUDGE_S` apart."""
        self._wake.set()

    def start(self) -> "KvEventPublisher":
        """Beat every `heartbeat_s`, and when nudged, on a daemon thread until `close`."""
        def loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(self.heartbeat_s)
                if self._stop.is_set():
                    break
                self._wake.clear()
                self.beat()
                self._stop.wait(NUDGE_S)
        self._thread = threading.Thread(target=loop, name=f"kv-events:{self.location}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class _Source:
    """One publisher as the index knows it."""
    epoch: str
    next_seq: int = 0
    seen: float = 0.0
    load: float = 0.0
    resync_at: float | None = None      # waiting for a snapshot since (None: in sync)
    held: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})


@dataclass
class EventIndexStats:
    events: int = 0
    gaps: int = 0               # resyncs started (a gap, or an epoch joined after its start)
    snapshots: int = 0          # snapshots applied
    expired: int = 0            # publishers forgotten after silence


class KvEventIndex:
    """The router's in-memory per-location index, fed by events (see the module docstring).

    `longest_prefix` walks a chain in O(matched length x holders per block), no I/O.
    `request_snapshot(location)` is how a resync asks (the transport's). Thread-safe."""

    def __init__(self, request_snapshot: Callable[[str], None], expire_s: float = EXPIRE_S,
                 resync_s: float = RESYNC_S, clock: Callable[[], float] = time.monotonic):
        self._request, self.expire_s, self.resync_s, self._clock = request_snapshot, expire_s, resync_s, clock
        self._sources: dict[str, _Source] = {}
        self._where: dict[str, dict[int, set[str]]] = {t: {} for t in TIERS}    # tier -> hash -> locations
        self._lock = threading.Lock()
        self.stats = EventIndexStats()

    # ---- feeding ------------------------------------------------------------------------------
    def apply(self, e: KvEvent) -> None:
        with self._lock:
            self.stats.events += 1
            now = self._clock()
            src = self._sources.get(e.location)
            if src is None or src.epoch != e.epoch:         # a new publisher, or one that restarted
                if src is not None:
                    self._drop(e.location, src)
                src = self._sources[e.location] = _Source(e.epoch)
                if e.seq and e.kind != SNAPSHOT:            # joined after its start: ask for the rest
                    self._resync(e.location, src, now)
            src.seen, src.load = now, e.load
            if e.kind == SNAPSHOT:
                self._snapshot(e, src)
            elif src.resync_at is not None:
                if now - src.resync_at > self.resync_s:     # the request or its answer was lost
                    self._resync(e.location, src, now)
            elif e.seq != src.next_seq:
                self._resync(e.location, src, now)
            elif e.kind in CHANGES:
                src.next_seq += 1
                self._change(e, src)

    def _change(self, e: KvEvent, src: _Source) -> None:
        if e.kind == CLEARED:
            self._drop_held(e.location, src)
            return
        where, held = self._where[e.tier], src.held[e.tier]
        for h in e.hashes:
            if e.kind == STORED:
                held.add(h)
                where.setdefault(h, set()).add(e.location)
            elif h in held:
                held.discard(h)
                self._unmark(where, h, e.location)

    def _snapshot(self, e: KvEvent, src: _Source) -> None:
        self._drop_held(e.location, src)
        for tier, hashes in e.held:
            src.held[tier].update(hashes)
            where = self._where[tier]
            for h in hashes:
                where.setdefault(h, set()).add(e.location)
        src.next_seq, src.resync_at = e.seq, None
        self.stats.snapshots += 1

    def _resync(self, location: str, src: _Source, now: float) -> None:
        self._drop_held(location, src)
        src.resync_at = now
        self.stats.gaps += 1
        try:
            self._request(location)
        except Exception as e:      # asked again after resync_s
            log.debug("snapshot request for %s failed: %s", location, e)

    def expire(self) -> list[str]:
        """Forget every publisher silent for `expire_s`; their locations."""
        with self._lock:
            now = self._clock()
            gone = [loc for loc, s in self._sources.items() if now - s.seen > self.expire_s]
            for loc in gone:
                self._drop(loc, self._sources[loc])
            self.stats.expired += len(gone)
            return gone

    def _drop(self, location: str, src: _Source) -> None:
        self._drop_held(location, src)
        del self._sources[location]

    def _drop_held(self, location: str, src: _Source) -> None:
        for tier, held in src.held.items():
            where = self._where[tier]
            for h in held:
                self._unmark(where, h, location)
            held.clear()

    @staticmethod
    def _unmark(where: dict[int, set[str]], h: int, location: str) -> None:
        holders = where.get(h)
        if holders is not None:
            holders.discard(location)
            if not holders:
                del where[h]

    # ---- reading ------------------------------------------------------------------------------
    def longest_prefix(self, hashes: Sequence[int], tiers: Sequence[str] = ROUTING_TIERS) -> dict[str, int]:
        """Location -> how many leading blocks of `hashes` it holds in any of `tiers` (those
        holding none omitted). One pass down the chain, stopping when no location holds every
        block so far; a location's count is set once, where it drops out (O(holders of the first
        block + blocks walked), not O(holders x blocks))."""
        with self._lock:
            maps = [m for m in (self._where[t] for t in tiers) if m]
            if not maps:
                return {}
            held = maps[0].get if len(maps) == 1 else (lambda h: set().union(*(m.get(h, ()) for m in maps)))
            out: dict[str, int] = {}
            alive: set[str] | None = None
            for i, h in enumerate(hashes):
                here = held(h) or set()
                if alive is None:
                    alive = set(here)
                elif not alive <= here:
                    for loc in alive - here:
                        out[loc] = i
                    alive &= here
                if not alive:
                    return out
            out.update(dict.fromkeys(alive or (), len(hashes)))
            return out

    def loads(self) -> dict[str, float]:
        """Location -> its load as last pushed (every known publisher, in sync or not)."""
        with self._lock:
            return {loc: s.load for loc, s in self._sources.items()}

    def charge(self, location: str, load: float) -> None:
        """Add `load` to `location`'s until its next event says what it is (a router that just
        sent it work, so the next decision does not pile onto it before it reports)."""
        with self._lock:
            src = self._sources.get(location)
            if src is not None:
                src.load += load

    def holdings(self, location: str) -> dict[str, set[int]]:
        """What the index believes `location` holds, per tier (copies; empty when unknown)."""
        with self._lock:
            src = self._sources.get(location)
            return {t: set(src.held[t]) if src else set() for t in TIERS}

    def resyncing(self) -> int:
        """Publishers dropped until their snapshot comes (a gap, or joined mid-epoch)."""
        with self._lock:
            return sum(s.resync_at is not None for s in self._sources.values())

    def tier_sizes(self) -> dict[str, int]:
        """Tier -> distinct blocks some publisher holds there."""
        with self._lock:
            return {t: len(where) for t, where in self._where.items()}

    def live(self) -> bool:
        """Whether any publisher was heard from within `expire_s` (else callers fall back)."""
        with self._lock:
            now = self._clock()
            return any(now - s.seen <= self.expire_s for s in self._sources.values())


class KvEventFollower:
    """The router's reader: a daemon thread that applies what `transport` delivers to `index` and
    expires silent publishers, until `close`."""

    def __init__(self, transport: EventTransport, index: KvEventIndex, poll_s: float = 0.2):
        self.transport, self.index, self.poll_s = transport, index, poll_s
        self._stop = threading.Event()
        self._warn = LogOnce(log)
        self._thread = threading.Thread(target=self._loop, name="kv-event-follower", daemon=True)

    def start(self) -> "KvEventFollower":
        self._thread.start()
        return self

    def pump(self) -> int:
        """Apply what has arrived (waiting up to poll_s) and expire the silent; events applied."""
        events = self.transport.read(self.poll_s)
        for e in events:
            self.index.apply(e)
        self.index.expire()
        return len(events)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.pump()
            except Exception as e:      # the transport is down: routing falls back until it answers
                self._warn(type(e).__name__, "kv event stream: %s: %s", type(e).__name__, e)
                self.index.expire()
                self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
