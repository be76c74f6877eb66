"""The cluster prefix index in Redis (same contract as EmbeddedIndex, see kvstore.index.embedded).

Key layout, `ns` the namespace (`fingerprint[:16]`, or `{fingerprint[:16]}-k{key_id}` for a
keyed store: kvstore.hashing.store_namespace); a *field* is a block hash as 8 big-endian bytes::

    kvmesh:{ns}:s             hash        field -> "1" block object is in the store, "2" checkpoint
                                          object is, "3" both (absent: neither)
    kvmesh:{ns}:l:{worker}    hash        field -> that block's lease deadline (Redis server
                                          clock, ms since epoch)
    kvmesh:{ns}:e:{worker}    sorted set  the same fields, score = the same deadline (finds the
                                          expired fields to drop)
    kvmesh:{ns}:holders       sorted set  member worker id, score = its latest deadline
    kvmesh:{ns}:m             hash        field -> the tokens of every worker with a lease record
                                          on that block, each between NUL bytes
    kvmesh:{ns}:t             hash        worker id -> its token, `{worker}@{n}`
    kvmesh:{ns}:tn            string      the counter n of tokens

Memory leases are judged by the *Redis server's* clock, so nodes with skewed
clocks still agree: `publish_memory` runs a small Lua script that reads
`TIME`, writes `now + ttl` as the blocks' deadline in the worker's hash and
sorted set and as the worker's score in `holders`, drops expired fields, and
keeps each key's PEXPIRE at least `ttl` + `_LEASE_GRACE_MS` so abandoned keys vanish. Lease
granularity is 1 ms.

`lookup` is one server-side step (`_LOOKUP_LUA`, one EVALSHA carrying the
chain as one binary string): the script cuts the chain into pages of 8-byte
fields with `struct.unpack` (no key names are built), reads the store hash
with `HMGET` page by page up to the first block that is not stored (the same
replies give the checkpoints of that run), then the holders: every live
holder whose lease covers the chain's first block is followed in one walk of
`m`, which reads each block once for all of them (a run of blocks with the
same holders is the same value, compared once) and ends a holder's count at
its first block without its token. A holder with a lease past its deadline
that no publish has swept yet (its deadline set says so) is walked in its own
hash instead, deadline by deadline. One round trip and a command per 512
blocks and tier (`bench/index_lookup.py` measures it against the per-key
layout before it). Writes of the store tier are scripts too (a field carries
both flags, so setting one keeps the other).

Every script that writes a lease writes all three records of it (`l`, `e` and
the token in `m`), so a token in `m` means a lease record in `l`. A worker
starts holding under a new token when its holders entry has run out (what its
earlier life left is dropped first, or, if its keys are gone, can never count
again). A silent worker's records leave `m` a bounded number per call of any
other worker's publish (`_GC_FIELDS`), its holders entry with the last; lease
keys live `_LEASE_GRACE_MS` past their last lease so that can happen. Memory
leases are hints: if Redis evicts one of these keys (a `maxmemory` policy that
evicts), a count can be off until the next publishes — a routing miss, never a
wrong answer.

Every hash also holds a `layout` field with a long value, which keeps it a hashtable (see
`_LAYOUT_VALUE`). Needs Redis >= 4.0 (multi-field HSET); tested with 7.0.

Upgrading from the per-key layout (`kvmesh:{ns}:b:{hex}`, `:c:{hex}`, `:w:{worker}`,
`:workers`): this layout never reads those keys, so an old namespace's entries are
ignored — lookups miss and the blocks are recomputed, never a wrong answer, until an
engine re-publishes its store at start-up (`rebuild_from`) and its leases as it runs.
The old block and checkpoint keys never expire; `clear()` removes old and new keys alike.
From the hash layout before `m`: a live holder with no token is walked in its own hash (exact);
its next publish gives it a token and drops its older leases, which its next renewal (the whole
pool, every half lease) publishes again — until then a lookup undercounts it, a routing miss.

Faults: when Redis is unreachable (connection refused/reset, timeout) or answers
with an error reply (READONLY after a failover, OOM under `noeviction`, LOADING,
BUSY, ...) no method raises. `lookup` returns an empty result and writes are dropped; one warning
is logged per outage; further calls are skipped (not attempted) until an
exponentially growing backoff deadline passes, then one call probes Redis and,
if it answers, everything resumes. Each wait is drawn between half the backoff and
all of it ("equal jitter"), so the replicas that lost Redis together do not all
probe it again in the same instant. Dropped publishes are not replayed: the
store is the truth and a miss only costs recompute (`rebuild_from` re-publishes).
The URL's password never reaches a log line (`kvmesh.kvstore.redact`).
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from typing import Callable, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.kvstore.hashing import U64_MAX
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.redact import redact_url
from kvmesh.kvstore.index.base import IndexStats, LookupResult, PrefixIndex, check_ttl, empty_lookup

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

# The holders tier. A worker's leases are kept three ways, written together by every script:
#   l:{worker}  hash        field -> deadline        (the truth for one worker)
#   e:{worker}  sorted set  field, score deadline    (finds the expired fields)
#   m           hash        field -> SEP tok1 SEP tok2 SEP ...: the tokens of every worker with a
#                           lease record on that block (expired or not), so a lookup reads a block
#                           once for all its holders
# A worker's token is `{worker}@{n}`, n new each time the worker starts holding again after its
# holders entry ran out (t: worker -> token; tn: the counter), so what an earlier life left in `m`
# never counts for a later one.
_HOLDERS_LUA = _FIELDS_LUA + f"""
local SEP = '\\0'
local function add_token(v, token)
  if not v then return SEP .. token .. SEP end
  if string.find(v, SEP .. token .. SEP, 1, true) then return v end
  return v .. token .. SEP
end
local function drop_token(v, token)   -- false: the value is left with no token
  local pat = SEP .. token .. SEP
  local i = string.find(v, pat, 1, true)
  if not i then return v end
  v = string.sub(v, 1, i) .. string.sub(v, i + #pat)
  if v == SEP then return false end
  return v
end
-- apply `change` (add_token or drop_token) for `token` to the m values of a list of fields
local function retoken(mkey, list, token, change)
  for from = 1, #list, {_PAGE} do
    local page = {{}}
    for i = from, math.min(from + {_PAGE} - 1, #list) do page[#page + 1] = list[i] end
    local old = redis.call('HMGET', mkey, unpack(page))
    local put, del = {{}}, {{}}
    for i = 1, #page do
      local was = old[i]            -- false: no value
      if was or change == add_token then
        local now = change(was, token)
        if now == false then del[#del + 1] = page[i]
        elseif now ~= was then put[#put + 1] = page[i]; put[#put + 1] = now end
      end
    end
    if #put > 0 then redis.call('HSET', mkey, unpack(put)) end
    if #del > 0 then redis.call('HDEL', mkey, unpack(del)) end
  end
end
-- drop up to `budget` of a worker's lease records (all when budget is nil) from l, e and m;
-- returns true when none is left
local function forget(ns, w, token, budget)
  local lkey, ekey = ns .. ':l:' .. w, ns .. ':e:' .. w
  while true do
    local n = budget and math.min(budget, {_PAGE}) or {_PAGE}
    local gone = redis.call('ZRANGE', ekey, 0, n - 1)
    if #gone == 0 then redis.call('DEL', lkey, ekey); return true end
    redis.call('HDEL', lkey, unpack(gone))
    redis.call('ZREM', ekey, unpack(gone))
    if token then retoken(ns .. ':m', gone, token, drop_token) end
    if budget then
      budget = budget - #gone
      if budget <= 0 then
        if redis.call('ZCARD', ekey) > 0 then return false end
        redis.call('DEL', lkey, ekey)
        return true
      end
    end
  end
end
"""

# Lease keys outlive a silent worker by this much, so its records can still be taken out of `m`
# (by its own next publish, or a little at a time by any other worker's: `_GC_FIELDS` per call).
_LEASE_GRACE_MS = 600_000
_GC_FIELDS = 2048

# KEYS[1]: the worker's lease hash; KEYS[2]: its deadline set; KEYS[3]: the holders set; KEYS[4]: m;
# KEYS[5]: t (worker -> token); KEYS[6]: tn (the token counter).
# ARGV[1]: worker id; ARGV[2]: ttl in ms; ARGV[3]: the fields; ARGV[4]: the namespace's key prefix
# (a silent worker's keys are named from it). Returns server time (ms).
_PUBLISH_MEMORY_LUA = _HOLDERS_LUA + f"""
local now = server_ms()
local w, ttl, chain, ns = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local n, deadline = #chain / 8, now + ttl
local token = redis.call('HGET', KEYS[5], w)
local score = redis.call('ZSCORE', KEYS[3], w)
if not token or not score or tonumber(score) <= now then
  forget(ns, w, token, nil)       -- its earlier life's leases are all over: none is left anywhere
  token = w .. '@' .. redis.call('INCR', KEYS[6])
  redis.call('HSET', KEYS[5], w, token)
end
hashtable(KEYS[1])
hashtable(KEYS[4])
for from = 1, n, {_PAGE} do
  local page = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  local args, scored = {{}}, {{}}
  for i = 1, #page do
    args[2 * i - 1], args[2 * i] = page[i], deadline
    scored[2 * i - 1], scored[2 * i] = deadline, page[i]
  end
  redis.call('HSET', KEYS[1], unpack(args))
  redis.call('ZADD', KEYS[2], unpack(scored))
  retoken(KEYS[4], page, token, add_token)
end
while true do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, {_PAGE})
  if #expired == 0 then break end
  redis.call('HDEL', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
  retoken(KEYS[4], expired, token, drop_token)
end
if not score or tonumber(score) < deadline then redis.call('ZADD', KEYS[3], deadline, w) end
-- one silent worker's records out of m, a bounded number per call; its entry goes with the last
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1)[1]
if dead and dead ~= w then
  if forget(ns, dead, redis.call('HGET', KEYS[5], dead), {_GC_FIELDS}) then
    redis.call('ZREM', KEYS[3], dead)
    redis.call('HDEL', KEYS[5], dead)
  end
end
local keep = ttl + {_LEASE_GRACE_MS}
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
return now
"""

# KEYS[1]: the worker's lease hash; KEYS[2]: its deadline set; KEYS[3]: m; KEYS[4]: t.
# ARGV[1]: worker id; ARGV[2]: the fields.
_REMOVE_MEMORY_LUA = _HOLDERS_LUA + f"""
local chain = ARGV[2]
local n = #chain / 8
local token = redis.call('HGET', KEYS[4], ARGV[1])
for from = 1, n, {_PAGE} do
  local page = fields(chain, from, math.min(from + {_PAGE} - 1, n))
  redis.call('HDEL', KEYS[1], unpack(page))
  redis.call('ZREM', KEYS[2], unpack(page))
  if token then retoken(KEYS[3], page, token, drop_token) end
end
return n
"""

# ARGV[1]: the namespace's key prefix; ARGV[2]: the chain's fields.
# Returns {{stored, "i,j,..." (checkpoint indices: one string, not 1 reply per mark), {{worker, count, ...}}}}.
_LOOKUP_LUA = _HOLDERS_LUA + f"""
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
-- one worker's lease hash field by field, up to its first expired or missing lease
local function walk(key)
  local alive, count = nil, 0     -- a deadline string known to be live: a worker's leases share few
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
  return count
end
local memory, counts, active, left = {{}}, {{}}, {{}}, 0
if n > 0 then
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', ns .. ':holders', '(' .. now, '+inf')) do
    local key = ns .. ':l:' .. w
    local d = redis.call('HGET', key, page(1)[1])
    if d and tonumber(d) > now then     -- its lease covers the chain's first block
      local token = redis.call('HGET', ns .. ':t', w)
      -- a lease record past its deadline and not swept yet is in m still: walk this one's own hash
      if token and #redis.call('ZRANGEBYSCORE', ns .. ':e:' .. w, '-inf', now, 'LIMIT', 0, 1) == 0 then
        active[SEP .. token .. SEP] = w
        left = left + 1
      else
        counts[w] = walk(key)
      end
    end
  end
end
if left > 0 then                  -- the holders walk: each block read once for every holder
  local prev, i = nil, 0
  for k = 1, pages_n do
    local got = redis.call('HMGET', ns .. ':m', unpack(page(k)))
    for j = 1, #got do
      local v = got[j]
      if v ~= prev then
        for pat, w in pairs(active) do
          if not v or not string.find(v, pat, 1, true) then
            counts[w], active[pat], left = i, nil, left - 1
          end
        end
        prev = v
        if left == 0 then break end
      end
      i = i + 1
    end
    if left == 0 then break end
  end
  for _, w in pairs(active) do counts[w] = n end
end
for w, count in pairs(counts) do
  memory[#memory + 1] = w
  memory[#memory + 1] = count
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

    `clock` (monotonic seconds) only paces the reconnect backoff and `rng` draws
    its jitter; leases use the server clock. Thread-safe: redis-py's pool is, and counters are locked.
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
        rng: random.Random | None = None,
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
        self._rng = rng or random.Random()     # the backoff's jitter
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
            backoff = self._backoff_s * (0.5 + 0.5 * self._rng.random())     # equal jitter: [b/2, b)
            self._retry_at = self._clock() + backoff
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

    def _holder_keys(self) -> list[str]:
        """m (block -> its holders' tokens), t (worker -> token), tn (the token counter)."""
        return [f"{self._ns}:m", f"{self._ns}:t", f"{self._ns}:tn"]

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
        keys = [*self._lease_keys(worker_id), f"{self._ns}:holders", *self._holder_keys()]
        fields = _chain_fields(hashes)
        self._write("publish_memory", lambda: self._publish_memory_script(keys=keys, args=[worker_id, ttl_ms, fields, self._ns]))

    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        if hashes:
            keys, fields = [*self._lease_keys(worker_id), *self._holder_keys()[:2]], _chain_fields(hashes)
            self._write("remove_memory", lambda: self._remove_memory_script(keys=keys, args=[worker_id, fields]))

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
