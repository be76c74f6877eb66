"""Prefix reuse inside one engine: restore at admission, name + persist after each step.

Tiers, fastest first: the device block pool (blocks still resident, shared by refcount),
the host cache (recent objects), the shared store (through the prefix index). What is
restored and what is recomputed is `kvstore.planner.plan_restore`'s decision.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvstore.block_pool import BlockPool, OutOfBlocks
from kvstore.cache_tensors import CacheTensors
from kvstore.hashing import PrefixHasher
from kvstore.host_cache import HostCache
from kvstore.index import PrefixIndex
from kvstore.objects import CorruptObjectError
from kvstore.persist import PutJob, WriteBehind
from kvstore.planner import (Availability, RestorePlan, SwaPolicy, branch_point, checkpoint_due,
                             plan_restore)
from kvstore.store import ObjectStore
from kvstore.timed_io import IoTimeoutError

from .auto_policy import AutoPeriod
from .sequence import Sequence

log = logging.getLogger(__name__)
MEMORY_LEASE_S = 60.0


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


class PrefixCache:
    def __init__(self, cache: CacheTensors, pool: BlockPool, hasher: PrefixHasher, policy: SwaPolicy,
                 span: int, store: ObjectStore | None, index: PrefixIndex | None, host: HostCache,
                 worker_id: str, staging_bytes: int = 32 << 20, enabled: bool = True,
                 auto: AutoPeriod | None = None):
        self.cache, self.pool, self.hasher, self.policy, self.span = cache, pool, hasher, policy, span
        self.store, self.index, self.host, self.worker_id = store, index, host, worker_id
        self.enabled = enabled              # False: no restore, no persistence (baselines)
        self.auto = auto                    # adaptive auto policy: chooses the checkpoint period
        self._last_observed: str | None = None
        self.bt = hasher.block_tokens
        self.writer = WriteBehind(store) if store is not None else None
        self.stored: set[tuple[str, int]] = set()   # objects this process knows are durable
        self.stats = ReuseStats()
        self._last_renew = time.monotonic()
        self._reconnects = 0
        self._block_shapes = cache.block_shapes()
        self._slot_shapes = cache.slot_shapes()
        self._table_ok: tuple = ()
        self._tiers: list[str] = []             # the tier of each block of the restore in progress
        self._logged: set[str] = set()
        # Reads from the store land here first; touched once now so a restore never
        # page-faults its way through fresh memory.
        self._staging = torch.zeros(staging_bytes if store is not None else 0, dtype=torch.uint8)

    def _failed(self, what: str, error: BaseException) -> None:
        """A tier failed: count it, log each cause once (a broken store must not flood the log)."""
        self.stats.errors += 1
        cause = f"{what}:{type(error).__name__}"
        first = cause not in self._logged
        self._logged.add(cause)
        (log.warning if first else log.debug)("prefix reuse: %s failed (%s: %s); served as a miss", what,
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

    # ---- admission: restore -------------------------------------------------------------------
    def _reseed_after_outage(self) -> None:
        """A Redis that came back may have lost its entries: republish the store's objects."""
        stats = getattr(self.index, "stats", None)
        reconnects = stats().get("reconnects", 0) if callable(stats) else 0
        if reconnects != self._reconnects and self.store is not None:
            self._reconnects = reconnects
            self.index.rebuild_from(self.store)

    def availability(self, hashes: list[int]) -> Availability:
        if self.index is not None:
            self._index_call("reseed", self._reseed_after_outage)
        looked = (self._index_call("lookup", self.index.lookup, hashes)
                  if self.index is not None and self.store is not None else None)
        stored = looked.stored if looked else 0
        ckpts = set(looked.checkpoints) if looked else set()
        n = 0
        for i, h in enumerate(hashes):
            if i < stored or self.pool.lookup(h) is not None or ("block", h) in self.host:
                n += 1
            else:
                break
        if self.policy.checkpoints:
            ckpts |= {i for i, h in enumerate(hashes[:n]) if ("checkpoint", h) in self.host}
        return Availability(n, frozenset(c for c in ckpts if c < n))

    def restore(self, seq: Sequence) -> bool:
        """Restore the longest usable prefix into seq (blocks + slot). False = out of memory.
        Any failure of a tier (I/O, index, an object that does not fit) leaves seq cold."""
        if not self.enabled:
            return True
        try:
            return self._restore(seq)
        except Exception as e:
            if isinstance(e, IoTimeoutError):   # a hung read may still write into the old buffer
                self._staging = torch.zeros_like(self._staging)
            self._failed("restore", e)
            self._release(seq)
            self.cache.reset_slot(seq.slot)
            seq.num_computed = seq.cached_tokens = seq.hashed_blocks = 0
            seq.ring_from = seq.keep_tokens = 0
            return True

    def _restore(self, seq: Sequence) -> bool:
        self.stats.lookups += 1
        self.stats.query_tokens += len(seq.prompt)
        if self.auto is not None and seq.request_id != self._last_observed:
            self._last_observed = seq.request_id
            self._feed_auto(seq)
        hashes = self.chain(seq, (len(seq.prompt) - 1) // self.bt)
        if not hashes:
            return True
        avail = self.availability(hashes)
        t0 = time.perf_counter()
        while True:
            plan = plan_restore(len(seq.prompt), self.bt, avail, self.policy, self.span)
            seq.branch_at = branch_point(plan, avail, self.bt, self.policy) or 0
            if plan.is_miss:
                return True
            try:
                failed = self._load(seq, hashes, plan, avail)
            except OutOfBlocks:
                self._release(seq)
                return False
            if failed is None:
                break
            self._release(seq)
            self.stats.truncated_hits += 1
            avail = failed
        self._apply(seq, plan, time.perf_counter() - t0)
        return True

    def _feed_auto(self, seq: Sequence) -> None:
        """Measured store bandwidth and this request's chain, for auto's period choice."""
        w = self.writer.stats if self.writer is not None else {"bytes": 0, "write_s": 0.0}
        self.auto.observe_store((self.stats.bytes_loaded, self.stats.load_s), (w["bytes"], w["write_s"]))
        self.auto.observe_request(self.chain(seq, len(seq.prompt) // self.bt), len(seq.prompt))

    def _load(self, seq: Sequence, hashes: list[int], plan: RestorePlan, avail: Availability
              ) -> Availability | None:
        """Acquire/load plan's blocks and state. Returns a reduced Availability on a miss."""
        def shorter(blocks: int, drop: int | None = None) -> Availability:
            return Availability(blocks, frozenset(c for c in avail.checkpoints if c < blocks and c != drop))

        from_host: list[tuple[int, dict]] = []
        from_store: list[int] = []
        self._tiers = []
        for i in range(plan.load_blocks):
            b = self.pool.acquire(hashes[i])
            self._tiers.append("device" if b is not None else "host" if ("block", hashes[i]) in self.host
                               else "store")
            if b is not None:
                seq.blocks.append(b)
                continue
            tensors = self.host.get("block", hashes[i])
            if tensors is not None:
                from_host.append((i, tensors))
            elif self.store is not None:
                from_store.append(i)
            else:
                return shorter(i)
            seq.blocks.append(-1)                      # allocated below, once everything is fetched
        rows, data_start, table, missing = self._fetch_blocks([hashes[i] for i in from_store])
        if missing is not None:
            seq.blocks = [b for b in seq.blocks if b >= 0]
            return shorter(from_store[missing])
        for i in range(plan.load_blocks):
            if seq.blocks[i] < 0:
                seq.blocks[i] = self.pool.allocate()
        self.cache.load_blocks([seq.blocks[i] for i, _ in from_host], [t for _, t in from_host])
        if from_store:
            self.cache.load_packed([seq.blocks[i] for i in from_store], rows, data_start, table)
        for i in [i for i, _ in from_host] + from_store:
            self.pool.set_hash(seq.blocks[i], hashes[i])
        self.stats.blocks_from_store += len(from_store)
        self.stats.blocks_from_memory += plan.load_blocks - len(from_store)
        self.stats.blocks_from_host += len(from_host)
        if plan.checkpoint is not None:
            state = self._fetch("checkpoint", hashes[plan.checkpoint])
            if state is None:
                return shorter(avail.blocks, drop=plan.checkpoint)
            self.cache.load_slot(seq.slot, plan.keep_tokens, state)
        elif self.policy.kind == "full":
            self.cache.rebuild_slot(seq.slot, plan.keep_tokens, seq.blocks)
        return None

    def _fetch_blocks(self, hashes: list[int]):
        """Read block objects from the store in one pass. Returns (rows, data_start, table,
        missing): rows[i, data_start:] is block i's tensor data laid out by `table`, or
        `missing` = the index of the first block that is absent, corrupt or of another layout."""
        if not hashes:
            return None, 0, (), None
        rows, objs = self.store.get_rows("block", hashes, self._staging)
        for i, (h, obj) in enumerate(zip(hashes, objs)):
            if obj is None:
                self._forget("block", h)
                return None, 0, (), i
            if obj.table != self._table_ok:
                have = {name: (shape, dtype) for name, dtype, shape, _, _ in obj.table}
                if have != self._block_shapes or (i and obj.table != objs[0].table):
                    self.store.reject("block", h, CorruptObjectError(
                        "its tensors do not fit this cache layout (missing, extra or reshaped)"))
                    return None, 0, (), i
                self._table_ok = obj.table
        starts = {o.data_start for o in objs}
        if rows is None or len(starts) != 1:   # objects of different sizes: pack their data rows
            rows = torch.stack([torch.frombuffer(o.data, dtype=torch.uint8) for o in objs])
            starts = {0}
        self.stats.bytes_loaded += sum(len(o.data) for o in objs)
        self.stored.update(("block", h) for h in hashes)
        return rows, starts.pop(), objs[0].table, None

    def _forget(self, kind: str, h: int) -> None:
        """The index pointed at an object the store does not have (or had corrupt): drop it."""
        if self.index is not None:
            if kind == "block":
                self._index_call("remove", self.index.remove_blocks, [h])
            else:
                self._index_call("remove", self.index.remove_checkpoint, h)

    def _fetch(self, kind: str, h: int):
        tensors = self.host.get(kind, h)
        if tensors is not None or self.store is None:
            return tensors
        obj = self.store.get(kind, h)
        if obj is None:
            self._forget(kind, h)
            return None
        have = {name: (tuple(t.shape), t.dtype) for name, t in obj.tensors.items()}
        if kind == "checkpoint" and have != self._slot_shapes:
            self.store.reject(kind, h, CorruptObjectError(
                "its tensors do not fit this cache layout (missing, extra or reshaped)"))
            return None
        self.stats.bytes_loaded += sum(t.numel() * t.element_size() for t in obj.tensors.values())
        self.stored.add((kind, h))
        return obj.tensors

    def _release(self, seq: Sequence) -> None:
        for b in seq.blocks:
            if b >= 0:                                 # -1: a placeholder never allocated
                self.pool.release(b)
        seq.blocks = []

    def _apply(self, seq: Sequence, plan: RestorePlan, load_s: float) -> None:
        seq.num_computed = plan.recompute_from
        seq.ring_from = plan.recompute_from if self.policy.kind == "zero" else 0
        seq.keep_tokens = plan.keep_tokens
        seq.cached_tokens = plan.hit_tokens
        seq.hashed_blocks = plan.load_blocks
        s = self.stats
        s.hits += 1
        s.hit_tokens += plan.hit_tokens
        left = plan.hit_tokens                # hit tokens by the tier their block came from, in order
        for tier in self._tiers:
            s.tier_hit_tokens[tier] += min(left, self.bt)
            left -= min(left, self.bt)
        s.tier_hit_tokens[self._tiers[-1] if self._tiers else "store"] += left
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
        self.host.put(kind, h, tensors)
        if self.writer is not None:
            self.writer.submit(PutJob(kind, h, parent, tokens, tensors))
            self.stored.add((kind, h))

    def _renew_leases(self) -> None:
        evicted, self.pool.evicted_hashes = self.pool.evicted_hashes, []
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
        if self.writer is not None:
            self.writer.close()
        if self.index is not None:
            self.index.close()
