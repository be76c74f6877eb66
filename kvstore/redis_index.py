"""The cluster prefix index in Redis (same contract as EmbeddedIndex, see kvstore.index).

Key layout, `ns` the namespace (`fingerprint[:16]`, or `{fingerprint[:16]}-k{key_id}` for a
keyed store: kvstore.hashing.store_namespace), `hex = hash_hex(h)`::

    kvmesh:{ns}:b:{hex}   string "1"         block object is in the store
    kvmesh:{ns}:c:{hex}   string "1"         checkpoint object is in the store
    kvmesh:{ns}:m:{hex}   sorted set         member worker_id, score = lease deadline
                                             (Redis server clock, ms since epoch)

Memory leases are judged by the *Redis server's* clock, so nodes with skewed
clocks still agree: `publish_memory` runs a small Lua script that reads
`TIME`, adds `now + ttl` as the score, drops expired members, and keeps the
key's own PEXPIRE at least `ttl` so abandoned sets vanish. `lookup` is one
pipeline: `TIME`, one `MGET` for blocks, one for checkpoints, and one
`ZRANGE .. WITHSCORES` per hash; members whose score is <= the server time
are ignored. Lease granularity is therefore 1 ms.

Faults: when Redis is unreachable (connection refused/reset, timeout) or answers
with an error reply (READONLY after a failover, OOM under `noeviction`, LOADING,
BUSY, ...) no method raises. `lookup` returns an empty result and writes are dropped; one warning
is logged per outage; further calls are skipped (not attempted) until an
exponentially growing backoff deadline passes, then one call probes Redis and,
if it answers, everything resumes. Dropped publishes are not replayed: the
store is the truth and a miss only costs recompute (`rebuild_from` re-publishes).
The URL's password never reaches a log line (`kvstore.redact`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.hashing import hash_hex
from kvstore.log_once import LogOnce
from kvstore.redact import redact_url
from kvstore.index_base import IndexStats, LookupResult, PrefixIndex, check_ttl, empty_lookup, walk_memory

__all__ = ["RedisIndex"]

log = logging.getLogger(__name__)
T = TypeVar("T")

KEY_PREFIX = "kvmesh"
DEFAULT_SOCKET_TIMEOUT_S = 1.0
DEFAULT_BACKOFF_INITIAL_S = 0.1
DEFAULT_BACKOFF_MAX_S = 30.0
_CLEAR_BATCH = 1000  # keys per SCAN page / UNLINK call in clear()
# Every Redis failure is a fault: the index is a hint, and a request must not fail over it.
_FAULTS = (redis.exceptions.RedisError,)

# KEYS: lease sets; ARGV[1]: worker id; ARGV[2]: ttl in ms. Returns server time (ms).
_PUBLISH_MEMORY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + ttl, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return now
"""


class RedisIndex(PrefixIndex):
    """PrefixIndex over a Redis server; never raises into the caller when Redis is down.

    `clock` (monotonic seconds) only paces the reconnect backoff; leases use
    the server clock. Thread-safe: redis-py's pool is, and counters are locked.
    """

    def __init__(
        self,
        url: str,
        fingerprint: str,
        *,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
        namespace: str | None = None,
    ) -> None:
        super().__init__(fingerprint, namespace)
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, {backoff_max_s}"
            )
        self._url = redact_url(url)     # for logs; the client keeps the real one
        self._ns = f"{KEY_PREFIX}:{self.namespace}"
        # No client-level retries: our own backoff decides when to try again.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._publish_memory_script = self._client.register_script(_PUBLISH_MEMORY_LUA)
        self._clock = clock
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        self._healthy = True
        self._warned = LogOnce(log)     # each cause is warned about once
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._stats = dict.fromkeys(
            ("lookups", "hits", "hit_blocks", "writes", "errors", "skipped", "reconnects"), 0
        )

    # -- fault handling ----------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], T], default: T) -> T:
        """Run `fn` unless in backoff; on a connection fault return `default`."""
        with self._lock:
            if not self._healthy and self._clock() < self._retry_at:
                self._stats["skipped"] += 1
                return default
        try:
            result = fn()
        except _FAULTS as e:
            self._on_fault(op, e)
            return default
        self._on_success()
        return result

    def _on_fault(self, op: str, error: Exception) -> None:
        with self._lock:
            self._stats["errors"] += 1
            first = self._healthy
            self._healthy = False
            self._backoff_s = (
                self._backoff_initial_s
                if first
                else min(self._backoff_s * 2, self._backoff_max_s)
            )
            self._retry_at = self._clock() + self._backoff_s
            backoff = self._backoff_s
            new_cause = self._warned.first(f"{type(error).__name__}:{str(error).split(' ')[0]}")
            first = first and new_cause         # the outage's first fault, of a cause not warned about yet
        if first:
            log.warning(
                "prefix index at %s failed during %s (%s: %s); lookups miss and "
                "publishes are dropped until it answers again (retrying with backoff)",
                self._url, op, type(error).__name__, error,
            )
        else:
            log.debug("prefix index still unreachable (%s); next try in %.2fs", error, backoff)

    def _on_success(self) -> None:
        with self._lock:
            if self._healthy:
                return
            self._healthy = True
            self._backoff_s = 0.0
            self._stats["reconnects"] += 1
        log.info("prefix index at %s answers again; prefix reuse resumes", self._url)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def stats(self) -> IndexStats:
        """Counters since construction; `healthy` while Redis answers."""
        with self._lock:
            return IndexStats(**self._stats, healthy=self._healthy)

    # -- keys --------------------------------------------------------------------

    def _key(self, tier: str, h: int) -> str:
        return f"{self._ns}:{tier}:{hash_hex(h)}"

    def _keys(self, tier: str, hashes: Sequence[int]) -> list[str]:
        return [self._key(tier, h) for h in hashes]

    # -- PrefixIndex -------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> LookupResult:
        if not hashes:
            return empty_lookup()
        self._count("lookups")
        result = self._call("lookup", lambda: self._lookup(hashes), empty_lookup())
        if result.stored or result.memory:
            self._count("hits")
            self._count("hit_blocks", result.stored)
        return result

    def _lookup(self, hashes: Sequence[int]) -> LookupResult:
        pipe = self._client.pipeline(transaction=False)
        pipe.time()
        pipe.mget(self._keys("b", hashes))
        pipe.mget(self._keys("c", hashes))
        for key in self._keys("m", hashes):
            pipe.zrange(key, 0, -1, withscores=True)
        (secs, micros), blocks, checkpoints, *leases = pipe.execute()
        now_ms = secs * 1000 + micros // 1000
        stored = 0
        for present in blocks:
            if present is None:
                break
            stored += 1
        marks = tuple(i for i in range(stored) if checkpoints[i] is not None)
        memory = walk_memory(
            {w.decode() for w, deadline in members if deadline > now_ms} for members in leases
        )
        return LookupResult(stored, marks, memory)

    def _write(self, op: str, fn: Callable[[], object]) -> None:
        self._count("writes")
        self._call(op, fn, None)

    def publish_blocks(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._write("publish_blocks", lambda: self._client.mset(dict.fromkeys(self._keys("b", hashes), 1)))

    def remove_blocks(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._write("remove_blocks", lambda: self._client.delete(*self._keys("b", hashes)))

    def publish_checkpoint(self, h: int) -> None:
        self._write("publish_checkpoint", lambda: self._client.set(self._key("c", h), 1))

    def remove_checkpoint(self, h: int) -> None:
        self._write("remove_checkpoint", lambda: self._client.delete(self._key("c", h)))

    def publish_memory(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        check_ttl(ttl_s)
        if not hashes:
            return
        ttl_ms = max(1, round(ttl_s * 1000))
        self._write(
            "publish_memory",
            lambda: self._publish_memory_script(keys=self._keys("m", hashes), args=[worker_id, ttl_ms]),
        )

    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return

        def remove() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in self._keys("m", hashes):
                pipe.zrem(key, worker_id)
            pipe.execute()

        self._write("remove_memory", remove)

    def clear(self) -> None:
        def clear_namespace() -> None:
            batch: list[bytes] = []
            for key in self._client.scan_iter(match=f"{self._ns}:*", count=_CLEAR_BATCH):
                batch.append(key)
                if len(batch) >= _CLEAR_BATCH:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

        self._write("clear", clear_namespace)

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisIndex({self._url!r}, namespace={self._ns!r})"
