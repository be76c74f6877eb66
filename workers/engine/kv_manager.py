"""The KV-cache manager: the only allocator of cache blocks and state slots.

    hit = kv.get_computed_blocks(seq)             # what seq can start from; allocates nothing
    if kv.allocate_slots(seq, n, hit): ...        # seq owns a slot and blocks for n more tokens,
                                                  # with the hit written into them
    kv.allocate_slots(seq, 1)                     # a running sequence grows (False: out of blocks)
    kv.fork(parent, child)                        # n > 1: share full blocks, copy the rest
    kv.free(seq)
    kv.reap_landing()                             # each step: memory of abandoned transfers comes back
    kv.loaded()                                   # handoff loads that ended off the step (loads_in_flight)

The scheduler sees only this (vLLM v1's `get_computed_blocks` + `allocate_slots`). Where a
hit comes from is the prefix cache's business: it *finds* one across its tiers (device pool,
host cache, store) and *fills* the blocks given here. A cache handed off by a prefill engine
(decode role) is a hit too: it covers the whole prompt and its `Resume.load` fills it, all but
the leading full blocks this engine's device pool already holds (the same prefix hashes: shared
by refcount like any resident hit, and not moved).

With `loads_in_flight` > 0 a handed-off cache is read off the engine step: admission reserves
the request's blocks and slot, starts `Resume.load` on a loader thread and reports the request as
loading (`is_loading`); the scheduler keeps it out of the batch until `loaded()` says its load
ended (written: it joins; failed: it fails alone). At most `loads_in_flight` loads hold memory at
once (admission waits past that), so parked reservations stay bounded; a request aborted while its
load runs gives its memory back only once the load is over (`reap_landing`).

A prefix hit found in host memory or read from the store (issue 45) is written the same way when
others are running (`allocate_slots(..., off_step=True)`): its copies into the reserved blocks and
slot run on a loader thread (`PrefixCache.write`), the request loading meanwhile; once they are in
it is named and joins (`PrefixCache.publish`), and a copy that failed makes it recompute, never
fail. With no loader free, or nobody running, the copy is made in the step as before.

What mutates: `allocate_slots`, `fork` and `free` change the pools (refcounts, free lists) and
the sequence's `blocks`, `slot` and restore fields (`num_computed`, `cached_tokens`,
`hashed_blocks`, `ring_from`, `keep_tokens`); on admission the slot is reset and the hit is
written into the cache. `get_computed_blocks` reads the tiers (and sets `seq.branch_at`) but
holds nothing: nothing else may allocate between it and the `allocate_slots` it feeds.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, NamedTuple

from kvmesh.kvstore.device.block_pool import BlockPool
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.transfer.kv_transport import TransferInFlight
from kvmesh.kvstore.device.state_slots import SlotPool
from kvmesh.workers.request import Resume, Sequence
from kvmesh.workers.reuse.prefix_cache import PrefixCache, Restore


class KVLoadError(RuntimeError):
    """A handed-off cache could not be loaded into the blocks given to it: its request cannot
    start (the transfer's own error is the cause)."""


class ComputedBlocks(NamedTuple):
    """What a waiting request can start from."""
    num_tokens: int = 0                      # computation starts at this position (0: from scratch)
    resident: tuple[int | None, ...] = ()    # per block the hit covers: a device block already holding
                                             # it (shared, refcount + 1), or None: a fresh block, filled
    restore: Restore | None = None           # prefix cache: what fills the fresh blocks and the slot
    handoff: Resume | None = None            # decode role: a cache prefilled by another engine


NO_HIT = ComputedBlocks()


class KVCacheManager:
    def __init__(self, cache: CacheTensors, blocks: BlockPool, slots: SlotPool, prefix: PrefixCache,
                 loads_in_flight: int = 0):
        self.cache, self.blocks, self.slots, self.prefix = cache, blocks, slots, prefix
        self.block_tokens = cache.layout.block_tokens
        # (blocks, slot, settled) of loads given up while a transfer may still write them
        self._landing: list[tuple[list[int], int, Callable[[], bool]]] = []
        self.loads_in_flight = loads_in_flight
        self._loader = (concurrent.futures.ThreadPoolExecutor(loads_in_flight, thread_name_prefix="kvmesh-cache-load")
                        if loads_in_flight else None)
        # id(seq) -> (seq, hit, the load's future): handed-off caches read, restores written, off the step
        self._loads: dict[int, tuple[Sequence, ComputedBlocks, concurrent.futures.Future]] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    @property
    def can_admit(self) -> bool:
        """A state slot is free (blocks are checked by allocate_slots)."""
        return self.slots.num_free > 0

    def reserve_scratch(self) -> tuple[int, int]:
        """(slot, block) taken for good: where padding rows of a fixed-shape decode step write."""
        return self.slots.allocate(), self.blocks.allocate()

    def cut(self, seq: Sequence, start: int) -> int | None:
        """Where a prefill chunk starting at `start` must end so a checkpoint can be taken."""
        return self.prefix.cut(seq, start)

    # ---- admission ------------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """The longest prefix of a waiting seq whose cache need not be computed."""
        if seq.resume is not None:
            n = len(seq.prompt)
            held = self.prefix.resident_prefix(seq, n // self.block_tokens)
            return ComputedBlocks(n, (*held, *(None,) * (self.blocks_for(n) - len(held))), handoff=seq.resume)
        found = self.prefix.find(seq)
        if found is None:
            return NO_HIT
        return ComputedBlocks(found.plan.recompute_from, found.resident, restore=found)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: ComputedBlocks | None = None,
                       off_step: bool = False) -> bool:
        """Memory for seq's next `num_new_tokens` tokens. A running seq (`hit` None) gets the
        blocks it lacks; a waiting one (`hit` from get_computed_blocks) gets a slot and the
        hit's blocks as well, all or nothing, and the hit is written into them. False: not
        enough free memory, nothing changed. Raises KVLoadError when a handed-off cache fails
        to load (seq then holds nothing). `off_step` (others are running, whom a copy in the
        step would stall): a restore that copies objects is written on a loader thread, seq
        loading (`is_loading`) until it is in."""
        if hit is None:
            return self._grow(seq, seq.num_computed + num_new_tokens)
        return self._admit(seq, num_new_tokens, hit, off_step)

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.blocks_for(upto_tokens) - len(seq.blocks)
        if need > 0 and not self.blocks.can_allocate(need):
            return False
        seq.blocks += [self.blocks.allocate() for _ in range(need)]
        return True

    def _admit(self, seq: Sequence, num_new_tokens: int, hit: ComputedBlocks, off_step: bool = False) -> bool:
        if hit.handoff is not None and self._loader is not None and len(self._loads) >= self.loads_in_flight:
            return False              # as many loads hold memory as may: this one waits for one to end
        total = max(len(hit.resident), self.blocks_for(hit.num_tokens + num_new_tokens))
        fresh = total - sum(b is not None for b in hit.resident)
        revived = sum(1 for b in hit.resident if b is not None and self.blocks.ref[b] == 0)  # leave the free count
        if not self.can_admit or not self.blocks.can_allocate(fresh + revived):
            return False
        seq.slot = self.slots.allocate()
        self.cache.reset_slot(seq.slot)
        seq.ring_from = seq.keep_tokens = 0
        # revive resident blocks before allocating, so allocation cannot evict one of them
        held = [self.blocks.touch(b) if b is not None else None for b in hit.resident]
        seq.blocks = [b if b is not None else self.blocks.allocate() for b in held]
        seq.blocks += [self.blocks.allocate() for _ in range(total - len(held))]
        if hit.handoff is not None and self._loader is not None:
            blocks, reused = self._handoff_target(seq, hit)
            self._loads[id(seq)] = (seq, hit, self._loader.submit(hit.handoff.load, self.cache.real, blocks,
                                                                  seq.slot, reused))
        elif hit.handoff is not None:
            self._load_handoff(seq, hit)
        elif (hit.restore is not None and off_step and self._loader is not None
              and len(self._loads) < self.loads_in_flight and self.prefix.copies(hit.restore)):
            self._loads[id(seq)] = (seq, hit, self._loader.submit(self._write_restore, hit.restore, list(seq.blocks),
                                                                  seq.slot))
        elif hit.restore is not None and not self.prefix.fill(seq, hit.restore):
            self._go_cold(seq, hit.num_tokens + num_new_tokens)
        return seq.slot is not None

    def _write_restore(self, found: Restore, blocks: list[int], slot: int) -> float:
        """On a loader thread: a restore's copies into the real cache (under TP, `_restored`
        sends the bytes to the other ranks); returns the seconds it took."""
        t0 = time.perf_counter()
        self.prefix.write(found, blocks, slot, self.cache.real)
        return time.perf_counter() - t0

    def _restored(self, seq: Sequence, hit: ComputedBlocks, future: concurrent.futures.Future) -> None:
        """A restore written off the step: named and counted, seq resumes after it; or, when its
        copy failed, seq recomputes from scratch in blocks of its own (it keeps its slot; the
        running requests' loop gives it blocks as it computes) — never a failure of the request."""
        error = future.exception()
        if error is None:
            found = hit.restore
            written = [b for b, tier in zip(seq.blocks, found.tiers) if tier != "device"]
            self.cache.resync(written, seq.slot)
            self.prefix.publish(seq, found, future.result())
            return
        self.prefix.failed_restore(error)
        self._go_cold(seq)

    @staticmethod
    def _handoff_target(seq: Sequence, hit: ComputedBlocks) -> tuple[list[int], int]:
        """The blocks a handed-off cache fills and how many leading ones this pool held already."""
        reused = next((i for i, b in enumerate(hit.resident) if b is None), len(hit.resident))
        return seq.blocks[:len(hit.resident)], reused

    def _load_handoff(self, seq: Sequence, hit: ComputedBlocks) -> None:
        blocks, reused = self._handoff_target(seq, hit)
        try:
            hit.handoff.load(self.cache.real, blocks, seq.slot, reused)
        except Exception as e:     # the transfer's failure, whatever its type, ends only this request
            raise self._load_failed(seq, e) from e
        self._loaded(seq, hit)

    def _loaded(self, seq: Sequence, hit: ComputedBlocks) -> None:
        blocks, reused = self._handoff_target(seq, hit)
        # a NIXL READ writes rank 0's memory only: under TP the other ranks get the bytes
        self.cache.resync(blocks[reused:], seq.slot)
        seq.num_computed, seq.hashed_blocks = hit.num_tokens, reused

    def _load_failed(self, seq: Sequence, e: BaseException) -> KVLoadError:
        """seq holds nothing after it (memory a transfer may still write waits in `_landing`)."""
        if isinstance(e, TransferInFlight):
            self._landing.append((seq.blocks, seq.slot, e.settled))
            seq.blocks, seq.slot, seq.hashed_blocks = [], None, 0
        else:
            self.free(seq)
        return KVLoadError(f"the handed-off cache could not be loaded: {type(e).__name__}: {e}")

    # ---- handed-off caches and restores written off the step (loads_in_flight > 0) --------------
    def is_loading(self, seq: Sequence) -> bool:
        return id(seq) in self._loads

    @property
    def loading(self) -> int:
        """Requests whose handed-off cache is being read, or whose restore written, off the step."""
        return len(self._loads)

    def load_futures(self) -> list[concurrent.futures.Future]:
        return [f for _, _, f in self._loads.values()]

    def loaded(self) -> list[tuple[Sequence, KVLoadError | None]]:
        """The loads that ended since the last call, in the order they started: (seq, None) when
        its cache is in (it may run), (seq, KVLoadError) when it failed (seq holds nothing)."""
        out = []
        for key, (seq, hit, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[key]
            if hit.restore is not None:
                self._restored(seq, hit, future)
                out.append((seq, None))
                continue
            error = future.exception()
            if error is None:
                self._loaded(seq, hit)
                out.append((seq, None))
            else:
                out.append((seq, self._load_failed(seq, error)))
        return out

    def abandon(self, seq: Sequence) -> None:
        """seq ended while its load runs: its memory comes back once the load is over."""
        _, _, future = self._loads.pop(id(seq))

        def settled() -> bool:      # a READ that timed out may still write until its own `settled`
            if not future.done():
                return False
            error = future.exception()
            return not isinstance(error, TransferInFlight) or error.settled()
        self._landing.append((seq.blocks, seq.slot, settled))
        seq.blocks, seq.slot, seq.hashed_blocks = [], None, 0

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    @property
    def landing(self) -> int:
        """Loads given up whose transfer may still write their blocks (see reap_landing)."""
        return len(self._landing)

    def reap_landing(self) -> None:
        """Give back the blocks and slot of each load that gave up while its bytes could still
        land in them (TransferInFlight), once they cannot: until then nothing else may use them."""
        landing, self._landing = self._landing, []
        for blocks, slot, settled in landing:
            if not settled():
                self._landing.append((blocks, slot, settled))
                continue
            for b in blocks:
                self.blocks.release(b)
            self.slots.release(slot)

    def _go_cold(self, seq: Sequence, upto_tokens: int = 0) -> None:
        """The hit could not be written: seq starts from scratch, in fresh blocks (shared
        ones must not be written) for `upto_tokens`, or waits when they are not there (0: it
        keeps only its slot; a running request gets its blocks as it computes)."""
        self._release_blocks(seq)
        self.cache.reset_slot(seq.slot)
        seq.num_computed = seq.cached_tokens = seq.ring_from = seq.keep_tokens = 0
        if not self._grow(seq, upto_tokens):
            self.free(seq)

    # ---- n > 1 and freeing ----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` parent's cache: full blocks shared (refcount + 1), the partly written last
        block and the state slot copied. False: no free slot or block, nothing changed."""
        full, partial = divmod(parent.num_computed, self.block_tokens)
        if not self.can_admit or (partial and not self.blocks.can_allocate(1)):
            return False
        child.slot = self.slots.allocate()
        self.cache.copy_slot(parent.slot, child.slot)
        child.blocks = [self.blocks.fork(b) for b in parent.blocks[:full]]
        if partial:
            child.blocks.append(self.blocks.allocate())
            self.cache.copy_block(parent.blocks[full], child.blocks[-1])
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (a named one stays revivable until evicted) and its slot."""
        self._release_blocks(seq)
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None

    def _release_blocks(self, seq: Sequence) -> None:
        for b in seq.blocks:
            self.blocks.release(b)
        seq.blocks = []
        seq.hashed_blocks = 0
