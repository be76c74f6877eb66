"""The cluster prefix index in Redis (same contract as EmbeddedIndex, see kvstore.index).

Key layout, `ns` the namespace (`fingerprint[:16]`, or `{fingerprint[:16]}-k{key_id}` for a
keyed store: kvstore.hashing.store_namespace), `hex = hash_hex(h)`::

    kvmesh:{ns}:b:{hex}       string "1"     block object is in the store
    kvmesh:{ns}:c:{hex}       string "1"     checkpoint object is in the store
    kvmesh:{ns}:w:{worker}    sorted set     member hex, score = that block's lease deadline
                                             (Redis server clock, ms since epoch)
    kvmesh:{ns}:workers       sorted set     member worker id, score = its latest deadline

Memory leases are judged by the *Redis server's* clock, so nodes with skewed
clocks still agree: `publish_memory` runs a small Lua script that reads
`TIME`, adds `now + ttl` as the blocks' score in the worker's set and as the
worker's in `workers`, drops expired members, and keeps each key's PEXPIRE
at least `ttl` so abandoned sets vanish. Lease granularity is 1 ms.

`lookup` is one server-side step (`_LOOKUP_LUA`, one EVALSHA carrying the
chain as one string of hex): it reads the block keys in pages of `MGET` up to
the first miss, the checkpoint keys of that stored run, then, for each live
worker holding the chain's first block, its deadlines along the chain in pages
of `ZMSCORE` up to its first expired or missing one. One round trip and a few
commands per 512 blocks, whatever the chain's length (the lookup before it was
a pipeline of 3 + N commands: `bench/index_lookup.py` compares them). Needs
Redis >= 6.2 (ZMSCORE).

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
import struct
import threading
import time
from typing import Callable, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.hashing import U64_MAX, hash_hex
from kvstore.log_once import LogOnce
from kvstore.redact import redact_url
from kvstore.index_base import IndexStats, LookupResult, PrefixIndex, check_ttl, empty_lookup

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

_HEX = 16           # hash_hex's width: a chain travels to the scripts as one string of these
_PAGE = 512         # keys per MGET / ZADD / ZMSCORE inside the scripts (Lua's unpack has a limit)

# KEYS[1]: the worker's lease set; KEYS[2]: the workers set; ARGV[1]: worker id; ARGV[2]: ttl in
# ms; ARGV[3]: the hashes as hex, concatenated. Returns server time (ms).
_PUBLISH_MEMORY_LUA = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, chain = tonumber(ARGV[2]), ARGV[3]
local n, deadline = #chain / {_HEX}, now + ttl
for from = 1, n, {_PAGE} do
  local args = {{}}
  for i = from, math.min(from + {_PAGE} - 1, n) do
    args[#args + 1] = deadline
    args[#args + 1] = string.sub(chain, {_HEX} * i - {_HEX - 1}, {_HEX} * i)
  end
  redis.call('ZADD', KEYS[1], unpack(args))
end
local old = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not old or tonumber(old) < deadline then redis.call('ZADD', KEYS[2], deadline, ARGV[1]) end
for _, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return now
"""

# ARGV[1]: the namespace's key prefix; ARGV[2]: the chain's hashes as hex, concatenated.
# Returns {{stored, {{checkpoint indices}}, {{worker, count, worker, count, ...}}}} (see LookupResult).
_LOOKUP_LUA = f"""
local ns, chain = ARGV[1], ARGV[2]
local n = #chain / {_HEX}
local function hex(i) return string.sub(chain, {_HEX} * i - {_HEX - 1}, {_HEX} * i) end
local function page(prefix, from, to)
  local out = {{}}
  for i = from, to do out[#out + 1] = prefix .. hex(i) end
  return out
end
local function run(cmd, key, prefix, to, alive)   -- leading entries of 1..to that `alive` accepts
  local count = 0
  for from = 1, to, {_PAGE} do
    local last = math.min(from + {_PAGE} - 1, to)
    local got = key and redis.call(cmd, key, unpack(page(prefix, from, last)))
                    or redis.call(cmd, unpack(page(prefix, from, last)))
    for i = 1, #got do
      if not alive(got[i]) then return count end
      count = count + 1
    end
  end
  return count
end
local stored = run('MGET', nil, ns .. ':b:', n, function(v) return v end)
local marks = {{}}
for from = 1, stored, {_PAGE} do
  local got = redis.call('MGET', unpack(page(ns .. ':c:', from, math.min(from + {_PAGE} - 1, stored))))
  for i = 1, #got do
    if got[i] then marks[#marks + 1] = from + i - 2 end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function live(score) return score and tonumber(score) > now end
local memory = {{}}
if n > 0 then
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', ns .. ':workers', '(' .. now, '+inf')) do
    local key = ns .. ':w:' .. w
    if live(redis.call('ZSCORE', key, hex(1))) then
      memory[#memory + 1] = w
      memory[#memory + 1] = run('ZMSCORE', key, '', n, live)
    end
  end
end
return {{stored, marks, memory}}
"""


def _chain_hex(hashes: Sequence[int]) -> str:
    """The hashes as one string of `hash_hex`es (what the scripts read a chain from)."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes).hex()
    except struct.error:
        bad = next(h for h in hashes if not (isinstance(h, int) and 0 <= h <= U64_MAX))
        raise ValueError(f"hash must be a u64, got {bad}") from None


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
        self._lookup_script = self._client.register_script(_LOOKUP_LUA)
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

    def _lease_key(self, worker_id: str) -> str:
        return f"{self._ns}:w:{worker_id}"

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
        stored, marks, memory = self._lookup_script(args=[self._ns, _chain_hex(hashes)])
        return LookupResult(
            stored, tuple(marks), {memory[i].decode(): memory[i + 1] for i in range(0, len(memory), 2)}
        )

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
        keys = [self._lease_key(worker_id), f"{self._ns}:workers"]
        self._write(
            "publish_memory",
            lambda: self._publish_memory_script(keys=keys, args=[worker_id, ttl_ms, _chain_hex(hashes)]),
        )

    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._write("remove_memory",
                        lambda: self._client.zrem(self._lease_key(worker_id), *(hash_hex(h) for h in hashes)))

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
