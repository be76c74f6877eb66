"""Prefix reuse inside one engine: find a hit at admission, fill it in, name + persist
after each step.

Tiers, fastest first: the device block pool (blocks still resident, shared by refcount),
then the `kvmesh.kvstore.store.tiers.CacheTier`s: the host cache (recent objects), the objects
prefetched from the store, and the shared store (through the prefix index).

Prefetch (issue 45): a request whose hit needs store objects is not read in the engine step.
When it is queued the engine computes its hash chain and hands `prefetch` (on a loader thread)
the chain: the index lookup and the store reads run there, the objects land in `staged` (host
memory, LRU by bytes, `restore_prefetch_bytes`), and the request waits outside the scheduler
(engine/grammar_wait.py's `Parked`) until they are in or its deadline passes. Its `find` in the
step then reads no store and asks no index: it uses the prefetch's lookup and the objects that
arrived; one that did not (late, missing, corrupt) ends the hit there, and the rest is recomputed.

What is restored and what is recomputed is `kvmesh.kvstore.policy.planner.plan_restore`'s
decision. The prefix cache never allocates: it *finds* a hit (`find`, all reads and checks) and
*fills* the blocks and slot the KV-cache manager (`kvmesh.workers.engine.kv_manager`) gives the
request (`fill`, memory copies only).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.kvstore.device.block_pool import BlockPool
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.store.host_cache import HostCache
from kvmesh.kvstore.index.embedded import PrefixIndex
from kvmesh.kvstore.index.kv_events import KvEventPublisher
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.persist import PutJob, WriteBehind
from kvmesh.kvstore.store.scrub import ScrubSchedule
from kvmesh.kvstore.policy.planner import Availability, RestorePlan, SwaPolicy, branch_point, checkpoint_due, plan_restore
from kvmesh.kvstore.store.object_store import ObjectStore
from kvmesh.kvstore.store.tiers import CacheTier, Tensors, nbytes, packed_runs
from kvmesh.workers.request import Sequence

from .auto_policy import AutoPeriod

log = logging.getLogger(__name__)
MEMORY_LEASE_S = 60.0
PART_MIN_OBJECTS = 8        # a prefetch reads its blocks in parts of at least this many objects ...
SLOW_READ_S = 0.002         # ... once its first ones took longer than this an object


@dataclass
class ReuseStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0
    blocks_from_memory: int = 0          # device pool + host cache
    blocks_from_host: int = 0
    blocks_from_store: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    checkpoints_written: int = 0
    truncated_hits: int = 0
    query_tokens: int = 0           # prompt tokens looked up (vLLM's prefix_cache_queries)
    tier_hit_tokens: dict = field(default_factory=lambda: {"device": 0, "host": 0, "store": 0})
    errors: int = 0                            # restores / index calls that failed: served cold
    last: dict = field(default_factory=dict)   # the latest restore's breakdown


class Restore(NamedTuple):
    """A hit found across the tiers: read and verified, not yet in the cache."""
    plan: RestorePlan
    hashes: list[int]                    # prefix hash of each hit block
    resident: tuple[int | None, ...]     # per hit block: the device block holding it, or None (in `loaded`)
    loaded: dict[int, Tensors]           # hit block index -> its object from the host cache or the store
    tiers: tuple[str, ...]               # per hit block: "device" | "host" | "store"
    state: Tensors | None                # the checkpoint's state; None: rebuilt (full) or none
    read_s: float = 0.0                  # finding and reading it (fill adds the copy: stats.load_s)


class Prefetch:
    """One request's reads ahead of its admission: the index's answer once looked up (None: no
    index, or it failed; the objects themselves go to PrefixCache.staged). Written by the loader
    thread, read by the engine's once the request is released (done, or past its deadline), or
    once `decided` is set and `reads` is False (a miss, or a hit no store object of which is needed:
    nothing to wait for, so it need not wait for the next step)."""

    def __init__(self):
        self.looked = None          # the index lookup (IndexLookup) or None
        self.reads = False          # whether it reads store objects (set before `decided`)
        self.decided = threading.Event()


class PrefixCache:
    """Finds prefix hits, fills them in, names and persists what requests compute.

    `pool` is only read (the device tier: which block holds which hash) and named
    (`set_hash`); blocks are allocated and released by the KV-cache manager alone."""

    def __init__(self, cache: CacheTensors, pool: BlockPool, hasher: PrefixHasher, policy: SwaPolicy,
                 span: int, store: ObjectStore | None, index: PrefixIndex | None, host: HostCache,
                 worker_id: str, enabled: bool = True, auto: AutoPeriod | None = None,
                 scrub: ScrubSchedule | None = None, events: KvEventPublisher | None = None,
                 prefetch_bytes: int = 0, reads_in_flight: int = 1):
        self.cache, self.pool, self.hasher, self.policy, self.span = cache, pool, hasher, policy, span
        self.store, self.index, self.host, self.worker_id = store, index, host, worker_id
        self.enabled = enabled              # False: no restore, no persistence (baselines)
        self.events = events                # pushes what the device pool and host cache hold (routing)
        self.auto = auto                    # adaptive auto policy: chooses the checkpoint period
        self._last_observed: str | None = None
        self.bt = hasher.block_tokens
        self.writer = WriteBehind(store, scrub=scrub) if store is not None else None   # scrubs between puts
        self.stored: set[tuple[str, int]] = set()   # objects this process knows are durable
        self.stats = ReuseStats()
        self._last_renew = time.monotonic()
        self._reconnects = 0
        self._block_shapes = cache.block_shapes()
        self._slot_shapes = cache.slot_shapes()
        # objects read ahead from the store for queued requests (counted as store hits: they are)
        self.staged = (HostCache(prefetch_bytes, track_evictions=False)    # no one routes on what it holds
                       if store is not None and prefetch_bytes else None)
        staged = [("store", self.staged)] if self.staged is not None else []
        self.tiers: list[tuple[str, CacheTier]] = [("host", host)] + staged + ([("store", store)] if store else [])
        # a prefetch's block reads, split in parts read side by side (the store allows as many at once)
        self._parts = (ThreadPoolExecutor(reads_in_flight - 1, thread_name_prefix="kvmesh-prefetch-part")
                       if self.staged is not None and reads_in_flight > 1 else None)
        self.reads_in_flight = reads_in_flight
        self._warn = LogOnce(log)

    def _failed(self, what: str, error: BaseException) -> None:
        """A tier failed: count it, log each cause once (a broken store must not flood the log)."""
        self.stats.errors += 1
        self._warn(f"{what}:{type(error).__name__}", "prefix reuse: %s failed (%s: %s); served as a miss", what,
                   type(error).__name__, error)

    def _index_call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:      # the index is a hint: never fail a request over it
            self._failed(f"index {what}", e)
            return None

    # ---- hashing ------------------------------------------------------------------------------
    def chain(self, seq: Sequence, blocks: int) -> list[int]:
        """Prefix hashes of seq's first `blocks` full blocks (cached on the sequence)."""
        hashes = seq.chain
        while len(hashes) < blocks:
            i = len(hashes)
            block = seq.token_slice(i * self.bt, (i + 1) * self.bt)
            hashes.append(self.hasher.next_hash(hashes[-1] if hashes else None, block))
        return hashes[:blocks]

    def resident_prefix(self, seq: Sequence, blocks: int) -> list[int]:
        """The device blocks holding seq's first full blocks (at most `blocks`), up to the first one
        the pool lacks: what a handed-off request need not move (decode-side reuse)."""
        if not self.enabled:
            return []
        held = []
        for h in self.chain(seq, blocks):
            b = self.pool.lookup(h)
            if b is None:
                break
            held.append(b)
        return held

    # ---- admission: find a hit, fill it in -------------------------------------------------------------------
    def _reseed_after_outage(self) -> None:
        """A Redis that came back may have lost its entries: republish the store's objects."""
        reconnects = self.index.stats().reconnects
        if reconnects != self._reconnects and self.store is not None:
            self._reconnects = reconnects
            self.index.rebuild_from(self.store)

    def availability(self, hashes: list[int], prefetched: Prefetch | None = None) -> Availability:
        """How much of `hashes` some tier holds; `prefetched`: the index's answer comes from
        there (looked up off the step), none is asked here."""
        if prefetched is not None:
            looked = prefetched.looked
        else:
            if self.index is not None:
                self._index_call("reseed", self._reseed_after_outage)
            looked = self._lookup(hashes)
        stored = looked.stored if looked else 0
        ckpts = set(looked.checkpoints) if looked else set()
        n = 0
        for i, h in enumerate(hashes):
            if i < stored or self.pool.lookup(h) is not None or self.host.contains("block", h):
                n += 1
            else:
                break
        if self.policy.checkpoints:
            ckpts |= {i for i, h in enumerate(hashes[:n]) if self.host.contains("checkpoint", h)}
        return Availability(n, frozenset(c for c in ckpts if c < n))

    def _lookup(self, hashes: list[int]):
        return (self._index_call("lookup", self.index.lookup, hashes)
                if self.index is not None and self.store is not None else None)

    # ---- prefetch: the store's part of a hit, read before the request is scheduled ----------------
    def wants_prefetch(self, seq: Sequence) -> bool:
        """Whether seq's hit may need store reads worth doing off the step (no handoff, a whole block)."""
        return (self.staged is not None and self.enabled and seq.resume is None
                and seq.params.prompt_logprobs is None and len(seq.prompt) > self.bt)

    def prefetch_chain(self, seq: Sequence) -> list[int]:
        """seq's hash chain as `find` uses it (on the engine thread: the loader never touches seq)."""
        return self.chain(seq, (len(seq.prompt) - 1) // self.bt)

    def prefetch(self, hashes: list[int], prompt_tokens: int, job: Prefetch) -> Prefetch:
        """On a loader thread: the index lookup, then the store objects the planned hit needs
        and no faster tier holds, read (verified by the store) into `staged`. Any failure is a
        shorter hit later, never an error."""
        try:
            job.looked = self._lookup(hashes)
            avail = self.availability(hashes, job)
            plan = plan_restore(prompt_tokens, self.bt, avail, self.policy, self.span)
            if plan.is_miss:
                return job
            want = [("block", h) for h in hashes[:plan.load_blocks]
                    if self.pool.lookup(h) is None and not self.host.contains("block", h)]
            if plan.checkpoint is not None and not self.host.contains("checkpoint", hashes[plan.checkpoint]):
                want.append(("checkpoint", hashes[plan.checkpoint]))
            job.reads = any(not self.staged.contains(k, h) for k, h in want)
            job.decided.set()
            for kind in ("block", "checkpoint"):
                keys = [h for k, h in want if k == kind and not self.staged.contains(k, h)]
                if not keys:
                    continue
                shapes = self._block_shapes if kind == "block" else self._slot_shapes
                for h, obj in zip(keys, self._read_parts(kind, keys, shapes)):
                    if obj is None:         # missing or corrupt: the hit ends there
                        break
                    self.staged.put(kind, h, None, 0, obj)
        except Exception as e:
            self._failed("prefetch", e)
        finally:
            job.decided.set()
        return job

    def _read_parts(self, kind: str, keys: list[int], shapes) -> list:
        """store.get_many(kind, keys) in own buffers. The first PART_MIN_OBJECTS are read alone;
        when they took over SLOW_READ_S an object (a network mount, an object store), the rest is
        read as up to `reads_in_flight` contiguous parts side by side (this thread reads the first),
        else in one call (from local files or the page cache, parts only add verifying threads
        that share the GIL: +13 ms on an 8K-token hit here). In keys' order; a part that failed is
        all None (the hit ends at its first object)."""
        if self._parts is None or len(keys) < 2 * PART_MIN_OBJECTS:
            return self.store.get_many(kind, keys, shapes, own=True)
        t0 = time.perf_counter()
        out = list(self.store.get_many(kind, keys[:PART_MIN_OBJECTS], shapes, own=True))
        rest = keys[PART_MIN_OBJECTS:]
        n = min(self.reads_in_flight, len(rest) // PART_MIN_OBJECTS)
        if (time.perf_counter() - t0) / PART_MIN_OBJECTS < SLOW_READ_S or n <= 1 or None in out:
            return out + list(self.store.get_many(kind, rest, shapes, own=True))
        size = -(-len(rest) // n)
        parts = [rest[i:i + size] for i in range(0, len(rest), size)]
        later = [self._parts.submit(self.store.get_many, kind, part, shapes, True) for part in parts[1:]]
        out += self.store.get_many(kind, parts[0], shapes, own=True)
        for part, future in zip(parts[1:], later):
            try:
                out += future.result()
            except Exception as e:          # a hung or failed part: the hit ends at its first object
                self._failed("prefetch", e)
                out += [None] * len(part)
        return out

    def find(self, seq: Sequence) -> Restore | None:
        """The longest usable prefix of seq's prompt across the tiers, read and verified
        (None: a miss). Allocates nothing and changes no cache memory; sets seq.branch_at
        (auto: where to checkpoint). Any failure of a tier (I/O, index, an object that does
        not fit) is a miss; a missing or corrupt object makes the hit shorter."""
        if not self.enabled or seq.params.prompt_logprobs is not None:   # every position computed
            return None
        try:
            return self._find(seq)
        except Exception as e:
            self._failed("restore", e)
            return None

    def _find(self, seq: Sequence) -> Restore | None:
        self.stats.lookups += 1
        self.stats.query_tokens += len(seq.prompt)
        if self.auto is not None and seq.request_id != self._last_observed:
            self._last_observed = seq.request_id
            self._feed_auto(seq)
        hashes = self.chain(seq, (len(seq.prompt) - 1) // self.bt)
        if not hashes:
            return None
        avail = self.availability(hashes, seq.prefetched)
        t0 = time.perf_counter()
        while True:
            plan = plan_restore(len(seq.prompt), self.bt, avail, self.policy, self.span)
            seq.branch_at = branch_point(plan, avail, self.bt, self.policy) or 0
            if plan.is_miss:
                return None
            found = self._read(hashes, plan, avail, store=seq.prefetched is None)
            if isinstance(found, Restore) and seq.prefetched is not None:    # staged for it: taken now
                self.staged.discard([("block", h) for h in found.hashes] + (
                    [("checkpoint", hashes[plan.checkpoint])] if plan.checkpoint is not None else []))
            if isinstance(found, Restore):
                return found._replace(read_s=time.perf_counter() - t0)
            self.stats.truncated_hits += 1
            avail = found

    def _feed_auto(self, seq: Sequence) -> None:
        """Measured store bandwidth and this request's chain, for auto's period choice."""
        w = self.writer.stats if self.writer is not None else {"bytes": 0, "write_s": 0.0}
        self.auto.observe_store((self.stats.bytes_loaded, self.stats.load_s), (w["bytes"], w["write_s"]))
        self.auto.observe_request(self.chain(seq, len(seq.prompt) // self.bt), len(seq.prompt))

    def _read(self, chain: list[int], plan: RestorePlan, avail: Availability, store: bool = True
              ) -> Restore | Availability:
        """Find plan's blocks (device pool, then each tier) and its checkpoint state. Returns
        the Restore, or a reduced Availability when something is missing. `store` False (a
        prefetched request): the store itself is not read; what was not staged is missing."""
        tiers_read = self.tiers if store else [(n, t) for n, t in self.tiers if t is not self.store]
        def shorter(blocks: int, drop: int | None = None) -> Availability:
            return Availability(blocks, frozenset(c for c in avail.checkpoints if c < blocks and c != drop))

        hashes = chain[:plan.load_blocks]
        resident = tuple(self.pool.lookup(h) for h in hashes)
        tiers = ["device" if b is not None else "" for b in resident]
        loaded: dict[int, Tensors] = {}
        missing = [i for i, b in enumerate(resident) if b is None]
        for name, tier in tiers_read:
            if not missing:
                break
            got = tier.get_many("block", [hashes[i] for i in missing], self._block_shapes)
            for i, obj in zip(missing, got):
                if obj is not None:
                    loaded[i], tiers[i] = obj, name
            missing = [i for i, obj in zip(missing, got) if obj is None]
        if missing:
            if self.store is not None and store:       # the store lacks what the index named
                self._forget("block", hashes[missing[0]])
            return shorter(missing[0])
        from_store = [("block", hashes[i]) for i, t in enumerate(tiers) if t == "store"]
        self.stats.bytes_loaded += sum(nbytes(loaded[i]) for i, t in enumerate(tiers) if t == "store")
        self.stored.update(from_store)
        state = None
        if plan.checkpoint is not None:
            state = self._fetch("checkpoint", chain[plan.checkpoint], tiers_read, forget=store)
            if state is None:
                return shorter(avail.blocks, drop=plan.checkpoint)
        return Restore(plan, hashes, resident, loaded, tuple(tiers), state)

    def _forget(self, kind: str, h: int) -> None:
        """The index pointed at an object the store does not have (or had corrupt): drop it."""
        if self.index is not None:
            if kind == "block":
                self._index_call("remove", self.index.remove_blocks, [h])
            else:
                self._index_call("remove", self.index.remove_checkpoint, h)

    def _fetch(self, kind: str, h: int, tiers: list[tuple[str, CacheTier]] | None = None,
               forget: bool = True) -> Tensors | None:
        """One object from the first tier that has it whole (checkpoints: checked against the slot)."""
        expect = self._slot_shapes if kind == "checkpoint" else self._block_shapes
        for name, tier in tiers or self.tiers:
            tensors = tier.get_many(kind, [h], expect)[0]
            if tensors is not None:
                if name == "store":
                    self.stats.bytes_loaded += nbytes(tensors)
                    self.stored.add((kind, h))
                return tensors
        if self.store is not None and forget:
            self._forget(kind, h)
        return None

    def fill(self, seq: Sequence, found: Restore) -> bool:
        """Write a found hit into the blocks and slot the KV-cache manager gave seq
        (seq.blocks[i] is hit block i; resident ones already hold their data) and set where
        seq's computation resumes. Mutates those blocks, their names in the pool, seq's
        slot and restore fields, and the stats. False: it could not be written (logged,
        counted); the caller serves seq cold."""
        t0 = time.perf_counter()
        try:
            self.write(found, seq.blocks, seq.slot)
        except Exception as e:
            self.failed_restore(e)
            return False
        self.publish(seq, found, time.perf_counter() - t0)
        return True

    @staticmethod
    def copies(found: Restore) -> bool:
        """Whether writing `found` copies anything (objects from the host cache or the store, a
        checkpoint's state): a hit all in device blocks (`full`: and its slot rebuilt) does not."""
        return bool(found.loaded) or found.state is not None

    def write(self, found: Restore, blocks: list[int], slot: int, cache=None) -> None:
        """The memory copies of a fill alone — the hit's objects into `blocks` (blocks[i] is hit
        block i) and its state into `slot` of `cache` (default: this cache) — touching nothing
        else, so it may run on another thread while the engine steps (the KV-cache manager's
        restores off the step); `publish` then names the blocks, on the engine's thread."""
        cache = self.cache if cache is None else cache
        host = [i for i, t in enumerate(found.tiers) if t == "host"]
        store = [i for i, t in enumerate(found.tiers) if t == "store"]
        cache.load_blocks([blocks[i] for i in host], [found.loaded[i] for i in host])
        if store:
            ids, objs = [blocks[i] for i in store], [found.loaded[i] for i in store]
            for start, stop, packed in packed_runs(objs):
                if packed is not None:
                    cache.load_packed(ids[start:stop], *packed)
                else:
                    cache.load_blocks(ids[start:stop], objs[start:stop])
        if found.state is not None:
            cache.load_slot(slot, found.plan.keep_tokens, found.state)
        elif self.policy.kind == "full":
            cache.rebuild_slot(slot, found.plan.keep_tokens, blocks)

    def failed_restore(self, error: BaseException) -> None:
        self._failed("restore", error)

    def publish(self, seq: Sequence, found: Restore, seconds: float) -> None:
        """After `write`: name the written blocks in the pool, tell the routers, count it and set
        where seq's computation resumes (engine thread)."""
        host = [i for i, t in enumerate(found.tiers) if t == "host"]
        store = [i for i, t in enumerate(found.tiers) if t == "store"]
        for i in host + store:
            self.pool.set_hash(seq.blocks[i], found.hashes[i])
        if self.events is not None:
            self.events.stored("device", [found.hashes[i] for i in host + store])
        self.stats.blocks_from_store += len(store)
        self.stats.blocks_from_memory += len(found.hashes) - len(store)
        self.stats.blocks_from_host += len(host)
        self._apply(seq, found, found.read_s + seconds)

    def _apply(self, seq: Sequence, found: Restore, load_s: float) -> None:
        plan = found.plan
        seq.num_computed = plan.recompute_from
        seq.ring_from = plan.recompute_from if self.policy.kind == "zero" else 0
        seq.keep_tokens = plan.keep_tokens
        seq.cached_tokens = plan.hit_tokens
        seq.hashed_blocks = plan.load_blocks
        s = self.stats
        s.hits += 1
        s.hit_tokens += plan.hit_tokens
        left = plan.hit_tokens                # hit tokens by the tier their block came from, in order
        for tier in found.tiers:
            s.tier_hit_tokens[tier] += min(left, self.bt)
            left -= min(left, self.bt)
        s.tier_hit_tokens[found.tiers[-1] if found.tiers else "store"] += left
        s.recomputed_tokens += plan.recompute_tokens
        s.load_s += load_s
        s.last = {"hit_tokens": plan.hit_tokens, "blocks": plan.load_blocks, "recompute": plan.recompute_tokens,
                  "load_s": load_s, "checkpoint": plan.checkpoint}

    # ---- after a step: name, persist, checkpoint ------------------------------------------------
    def cut(self, seq: Sequence, start: int) -> int | None:
        """Where a prefill chunk starting at `start` must end so a checkpoint can be taken."""
        if not self.policy.checkpoints or not self.enabled:
            return None
        period = self.period
        prompt_end = len(seq.prompt) // self.bt * self.bt
        cuts = [c for c in (prompt_end, seq.branch_at) if c > start]
        if period:
            cuts.append((start // period + 1) * period)
        return min(cuts, default=None)

    @property
    def period(self) -> int:
        """Tokens between periodic checkpoints (auto: as chosen so far; 0 = none)."""
        return self.auto.period if self.auto is not None else self.policy.period

    def after_step(self, seq: Sequence) -> None:
        if not self.enabled:
            return
        full = min(seq.num_computed, seq.length) // self.bt
        if full > seq.hashed_blocks:
            hashes = self.chain(seq, full)
            for i in range(seq.hashed_blocks, full):
                self.pool.set_hash(seq.blocks[i], hashes[i])
                self._persist_block(seq.blocks[i], hashes, i)
            if self.index is not None:
                self._index_call("publish", self.index.publish_memory, self.worker_id,
                                 hashes[seq.hashed_blocks:full], MEMORY_LEASE_S)
            if self.events is not None:
                self.events.stored("device", hashes[seq.hashed_blocks:full])
            seq.hashed_blocks = full
        if self.policy.checkpoints and seq.num_computed and seq.num_computed % self.bt == 0:
            pos = seq.num_computed
            if pos <= len(seq.prompt):
                if checkpoint_due(pos, len(seq.prompt), self.bt, self.period) or pos == seq.branch_at:
                    self._checkpoint(seq, pos)
            else:
                seq.end_state = (pos, self.cache.slot_state(seq.slot, pos))
        self._renew_leases()

    def on_finish(self, seq: Sequence) -> None:
        """Checkpoint the end of the output (its last block boundary) for the next turn."""
        end, seq.end_state = seq.end_state, None
        if end is not None and self.policy.checkpoints:
            pos, state = end
            self._put("checkpoint", self.chain(seq, pos // self.bt)[-1], pos, state)

    def _checkpoint(self, seq: Sequence, pos: int) -> None:
        h = self.chain(seq, pos // self.bt)[-1]
        if ("checkpoint", h) not in self.stored:
            self._put("checkpoint", h, pos, self.cache.slot_state(seq.slot, pos))
            self.stats.checkpoints_written += 1

    def _persist_block(self, block: int, hashes: list[int], i: int) -> None:
        h = hashes[i]
        if ("block", h) in self.stored:
            return
        self._put("block", h, (i + 1) * self.bt, self.cache.block_state(block), parent=hashes[i - 1] if i else None)

    def _put(self, kind: str, h: int, tokens: int, tensors, parent: int | None = None) -> None:
        if self.host.put(kind, h, parent, tokens, tensors) and kind == "block" and self.events is not None:
            self.events.stored("host", [h])
        if self.writer is not None:
            self.writer.submit(PutJob(kind, h, parent, tokens, tensors))
            self.stored.add((kind, h))

    def _renew_leases(self) -> None:
        evicted, self.pool.evicted_hashes = self.pool.evicted_hashes, []
        left_host, self.host.evicted = self.host.evicted, []
        if self.events is not None:
            self.events.removed("device", evicted)
            self.events.removed("host", [h for kind, h in left_host if kind == "block"])
        if self.index is None:
            return
        if evicted:
            self._index_call("remove", self.index.remove_memory, self.worker_id, evicted)
        now = time.monotonic()
        if now - self._last_renew > MEMORY_LEASE_S / 2:
            self._last_renew = now
            self._index_call("publish", self.index.publish_memory, self.worker_id, list(self.pool.by_hash),
                             MEMORY_LEASE_S)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self._parts is not None:
            self._parts.shutdown(wait=False)
        if self.events is not None:
            self.events.close()
        if self.writer is not None:
            self.writer.close()
        if self.index is not None:
            self.index.close()
