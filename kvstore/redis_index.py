"""The cluster prefix index in Redis (same contract as EmbeddedIndex, see kvstore.index).

Key layout, `ns` the namespace (`fingerprint[:16]`, or `{fingerprint[:16]}-k{key_id}` for a
keyed store: kvstore.hashing.store_namespace); a *field* is a block hash as 8 big-endian bytes::

    kvmesh:{ns}:s             hash        field -> "1" block object is in the store, "2" checkpoint
                                          object is, "3" both (absent: neither)
    kvmesh:{ns}:l:{worker}    hash        field -> that block's lease deadline (Redis server
                                          clock, ms since epoch)
    kvmesh:{ns}:e:{worker}    sorted set  the same fields, score = the same deadline (finds the
                                          expired fields to drop)
    kvmesh:{ns}:holders       sorted set  member worker id, score = its latest deadline

Memory leases are judged by the *Redis server's* clock, so nodes with skewed
clocks still agree: `publish_memory` runs a small Lua script that reads
`TIME`, writes `now + ttl` as the blocks' deadline in the worker's hash and
sorted set and as the worker's score in `holders`, drops expired fields, and
keeps each key's PEXPIRE at least `ttl` so abandoned keys vanish. Lease
granularity is 1 ms.

`lookup` is one server-side step (`_LOOKUP_LUA`, one EVALSHA carrying the
chain as one binary string): the script cuts the chain into pages of 8-byte
fields with `struct.unpack` (no key names are built), reads the store hash
with `HMGET` page by page up to the first block that is not stored (the same
replies give the checkpoints of that run), then, for each live holder whose
lease covers the chain's first block, its deadlines along the chain with
`HMGET` up to its first expired or missing one. One round trip and a command
per 512 blocks and tier (`bench/index_lookup.py` measures it against the
per-key layout before it). Writes of the store tier are scripts too (a field
carries both flags, so setting one keeps the other).

Every hash also holds a `layout` field with a long value, which keeps it a hashtable (see
`_LAYOUT_VALUE`). Needs Redis >= 4.0 (multi-field HSET); tested with 7.0.

Upgrading from the per-key layout (`kvmesh:{ns}:b:{hex}`, `:c:{hex}`, `:w:{worker}`,
`:workers`): this layout never reads those keys, so an old namespace's entries are
ignored — lookups miss and the blocks are recomputed, never a wrong answer, until an
engine re-publishes its store at start-up (`rebuild_from`) and its leases as it runs.
The old block and checkpoint keys never expire; `clear()` removes old and new keys alike.

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

from kvstore.hashing import U64_MAX
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

_BLOCK, _CHECKPOINT = 1, 2     # the store hash's flags (its value is their sum)
_PAGE = 512         # fields per HMGET / HSET / ZADD inside the scripts (Lua's unpack has a limit)
# Every hash of the layout holds this field too: its value is longer than hash-max-listpack-value
# (64 by default), so Redis keeps the hash a hashtable. A hash of up to hash-max-listpack-entries
# (512) fields would otherwise be a listpack, where each HMGET field is a linear scan: a page of
# 512 fields took milliseconds, not microseconds. A block's field is 8 bytes, never this one.
_LAYOUT_FIELD = "layout"
_LAYOUT_VALUE = "kvmesh prefix index: fields are 8-byte block hashes; this value is long to keep a hashtable"
assert len(_LAYOUT_VALUE) > 64

# Every script reads a chain from one string of 8-byte fields: `fields(from, to)` is the list of
# the chain's fields from..to (1-based), cut by struct.unpack in one C call (its last return value,
# the next position, is dropped).
_FIELDS_LUA = f"""
local function fields(chain, from, to)
  local out = {{struct.unpack(string.rep('c8', to - from + 1), chain, 8 * from - 7)}}
  out[#out] = nil
  return out
end
local function hashtable(key) redis.call('HSET', key, '{_LAYOUT_FIELD}', '{_LAYOUT_VALUE}') end
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS[1]: the store hash; ARGV[1]: the flag (1 block, 2 checkpoint); ARGV[2]: "1" set, "0" clear;
# ARGV[3]: the fields. Other flags of a field are kept; a field left with none is deleted.
_STORE_WRITE_LUA = _FIELDS_LUA + f"""
local flag, set, chain = tonumber(ARGV[1]), ARGV[2] == '1', ARGV[3]
local n = #chain / 8
if set then hashtable(KEYS[1]) end
for from = 1, n, {_PAGE} do
  local page = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  local old = redis.call('HMGET', KEYS[1], unpack(page))
  local put, del = {{}}, {{}}
  for i = 1, #page do
    local was = tonumber(old[i] or 0)
    local has = math.floor(was / flag) % 2 == 1
    local now = (set and not has) and was + flag or ((not set and has) and was - flag or was)
    if now == 0 and was ~= 0 then del[#del + 1] = page[i]
    elseif now ~= was then put[#put + 1] = page[i]; put[#put + 1] = now end
  end
  if #put > 0 then redis.call('HSET', KEYS[1], unpack(put)) end
  if #del > 0 then redis.call('HDEL', KEYS[1], unpack(del)) end
end
return n
"""

# KEYS[1]: the worker's lease hash; KEYS[2]: its deadline set; KEYS[3]: the holders set;
# ARGV[1]: worker id; ARGV[2]: ttl in ms; ARGV[3]: the fields. Returns server time (ms).
_PUBLISH_MEMORY_LUA = _FIELDS_LUA + f"""
local now = server_ms()
local ttl, chain = tonumber(ARGV[2]), ARGV[3]
local n, deadline = #chain / 8, now + ttl
hashtable(KEYS[1])
for from = 1, n, {_PAGE} do
  local page = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  local args, scored = {{}}, {{}}
  for i = 1, #page do
    args[2 * i - 1], args[2 * i] = page[i], deadline
    scored[2 * i - 1], scored[2 * i] = deadline, page[i]
  end
  redis.call('HSET', KEYS[1], unpack(args))
  redis.call('ZADD', KEYS[2], unpack(scored))
end
while true do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, {_PAGE})
  if #expired == 0 then break end
  redis.call('HDEL', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
end
local old = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not old or tonumber(old) < deadline then redis.call('ZADD', KEYS[3], deadline, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return now
"""

# KEYS[1]: the worker's lease hash; KEYS[2]: its deadline set; ARGV[1]: the fields.
_REMOVE_MEMORY_LUA = _FIELDS_LUA + f"""
local chain = ARGV[1]
local n = #chain / 8
for from = 1, n, {_PAGE} do
  local page = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  redis.call('HDEL', KEYS[1], unpack(page))
  redis.call('ZREM', KEYS[2], unpack(page))
end
return n
"""

# ARGV[1]: the namespace's key prefix; ARGV[2]: the chain's fields.
# Returns {{stored, "i,j,..." (checkpoint indices: one string, not 1 reply per mark), {{worker, count, ...}}}}.
_LOOKUP_LUA = _FIELDS_LUA + f"""
local ns, chain = ARGV[1], ARGV[2]
local n = #chain / 8
local pages = {{}}                 -- page k: fields of blocks (k-1)*{_PAGE}+1 .., cut once, read by every walk
local function page(k)
  if not pages[k] then
    local from = (k - 1) * {_PAGE} + 1
    pages[k] = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  end
  return pages[k]
end
local pages_n = math.ceil(n / {_PAGE})
local marks, stored = {{}}, 0     -- the store walk: "1" block, "3" block + checkpoint, else a miss
for k = 1, pages_n do
  local got = redis.call('HMGET', ns .. ':s', unpack(page(k)))
  local m = #got
  for i = 1, m do
    local v = got[i]
    if v == '3' then marks[#marks + 1] = stored elseif v ~= '1' then m = -1; break end
    stored = stored + 1
  end
  if m < 0 then break end
end
local now = server_ms()
local memory = {{}}
if n > 0 then
  local first = page(1)[1]
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', ns .. ':holders', '(' .. now, '+inf')) do
    local key = ns .. ':l:' .. w
    local d = redis.call('HGET', key, first)
    if d and tonumber(d) > now then
      local alive, count = d, 0   -- a deadline string known to be live: a worker's leases share few
      for k = 1, pages_n do
        local got = redis.call('HMGET', key, unpack(page(k)))
        local m = #got
        for i = 1, m do
          local v = got[i]
          if v ~= alive then
            if not v or tonumber(v) <= now then m = -1; break end
            alive = v
          end
          count = count + 1
        end
        if m < 0 then break end
      end
      memory[#memory + 1] = w
      memory[#memory + 1] = count
    end
  end
end
return {{stored, table.concat(marks, ','), memory}}
"""


def _chain_fields(hashes: Sequence[int]) -> bytes:
    """The hashes as one string of 8-byte big-endian fields (what the scripts read a chain from)."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
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
        self._store_key = f"{self._ns}:s"
        self._store_write_script = self._client.register_script(_STORE_WRITE_LUA)
        self._publish_memory_script = self._client.register_script(_PUBLISH_MEMORY_LUA)
        self._remove_memory_script = self._client.register_script(_REMOVE_MEMORY_LUA)
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

    def _lease_keys(self, worker_id: str) -> list[str]:
        """The worker's lease hash and deadline set."""
        return [f"{self._ns}:l:{worker_id}", f"{self._ns}:e:{worker_id}"]

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
        stored, marks, memory = self._lookup_script(args=[self._ns, _chain_fields(hashes)])
        return LookupResult(
            stored, tuple(map(int, marks.split(b","))) if marks else (),
            {memory[i].decode(): memory[i + 1] for i in range(0, len(memory), 2)},
        )

    def _write(self, op: str, fn: Callable[[], object]) -> None:
        self._count("writes")
        self._call(op, fn, None)

    def _write_store(self, op: str, flag: int, present: bool, hashes: Sequence[int]) -> None:
        fields = _chain_fields(hashes)
        self._write(op, lambda: self._store_write_script(keys=[self._store_key], args=[flag, int(present), fields]))

    def publish_blocks(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._write_store("publish_blocks", _BLOCK, True, hashes)

    def remove_blocks(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._write_store("remove_blocks", _BLOCK, False, hashes)

    def publish_checkpoint(self, h: int) -> None:
        self._write_store("publish_checkpoint", _CHECKPOINT, True, [h])

    def remove_checkpoint(self, h: int) -> None:
        self._write_store("remove_checkpoint", _CHECKPOINT, False, [h])

    def publish_memory(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        check_ttl(ttl_s)
        if not hashes:
            return
        ttl_ms = max(1, round(ttl_s * 1000))
        keys = [*self._lease_keys(worker_id), f"{self._ns}:holders"]
        fields = _chain_fields(hashes)
        self._write("publish_memory", lambda: self._publish_memory_script(keys=keys, args=[worker_id, ttl_ms, fields]))

    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        if hashes:
            keys, fields = self._lease_keys(worker_id), _chain_fields(hashes)
            self._write("remove_memory", lambda: self._remove_memory_script(keys=keys, args=[fields]))

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
