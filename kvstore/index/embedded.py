"""The prefix index: which prefixes of a model are stored, checkpointed, or in memory.

The index is a *hint* (DESIGN §4). The object store is the truth: entries are
published only after an object is durable and removed when it is evicted, but
after a crash the two may disagree, so every hit is re-verified on read.

Three tiers of entries, all keyed by block chain hash (`kvmesh.kvstore.hashing`):

* **block** — the block object for the prefix ending at that hash is in the store;
* **checkpoint** — a state checkpoint at the end of that prefix is in the store
  (same hash value, separate namespace);
* **memory** — a worker holds the block in its device/host pool, under a lease
  that expires unless re-published.

Every index instance is bound to one model fingerprint and namespace; different
models, and stores of different keys, never see each other's entries. `make_index` builds one from a deployment spec.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from kvmesh.kvstore.index.base import (BLOCK, CHECKPOINT, IndexStats, LookupResult, ObjectListing, PrefixIndex, check_ttl,
                                empty_lookup, walk_memory)

__all__ = ["BLOCK", "CHECKPOINT", "EmbeddedIndex", "IndexStats", "LookupResult", "ObjectListing", "PrefixIndex",
           "check_ttl", "empty_lookup", "make_index", "walk_memory"]
_SWEEP_MIN_LEASES = 1024  # below this many leases an expiry sweep is not worth its cost


class EmbeddedIndex(PrefixIndex):
    """In-process index for a single node (a laptop, a test): dicts behind one lock.

    Leases are judged by `clock` (injectable for tests). Expired leases are
    dropped lazily on lookup and by an amortised sweep whenever the number of
    leases doubles since the last sweep, so dead workers cannot grow it forever.
    """

    def __init__(self, fingerprint: str, clock: Callable[[], float] = time.monotonic,
                 namespace: str | None = None) -> None:
        super().__init__(fingerprint, namespace)
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: set[int] = set()
        self._checkpoints: set[int] = set()
        self._memory: dict[int, dict[str, float]] = {}  # hash -> worker -> lease deadline
        self._leases = 0
        self._leases_after_sweep = 0
        self._counts = dict.fromkeys(("lookups", "hits", "hit_blocks", "writes"), 0)

    def lookup(self, hashes: Sequence[int]) -> LookupResult:
        with self._lock:
            stored = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                stored += 1
            checkpoints = tuple(i for i in range(stored) if hashes[i] in self._checkpoints)
            found = LookupResult(stored, checkpoints, self._memory_walk(hashes))
            if hashes:
                self._counts["lookups"] += 1
                self._counts["hits"] += bool(stored or found.memory)
                self._counts["hit_blocks"] += stored
            return found

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(**self._counts)

    def _memory_walk(self, hashes: Sequence[int]) -> dict[str, int]:
        now = self._clock()
        return walk_memory(
            {w for w, deadline in self._memory.get(h, {}).items() if deadline > now}
            for h in hashes
        )

    def publish_blocks(self, hashes: Sequence[int]) -> None:
        with self._lock:
            self._blocks.update(hashes)
            self._counts["writes"] += bool(hashes)

    def remove_blocks(self, hashes: Sequence[int]) -> None:
        with self._lock:
            self._blocks.difference_update(hashes)
            self._counts["writes"] += bool(hashes)

    def publish_checkpoint(self, h: int) -> None:
        with self._lock:
            self._checkpoints.add(h)
            self._counts["writes"] += 1

    def remove_checkpoint(self, h: int) -> None:
        with self._lock:
            self._checkpoints.discard(h)
            self._counts["writes"] += 1

    def publish_memory(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._lock:
            self._counts["writes"] += bool(hashes)
            deadline = self._clock() + ttl_s
            for h in hashes:
                holders = self._memory.setdefault(h, {})
                self._leases += worker_id not in holders
                holders[worker_id] = deadline
            if self._leases > 2 * max(self._leases_after_sweep, _SWEEP_MIN_LEASES):
                self._sweep_expired()

    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        with self._lock:
            self._counts["writes"] += bool(hashes)
            for h in hashes:
                holders = self._memory.get(h)
                if holders is not None and holders.pop(worker_id, None) is not None:
                    self._leases -= 1
                    if not holders:
                        del self._memory[h]

    def _sweep_expired(self) -> None:
        now = self._clock()
        for h in list(self._memory):
            holders = self._memory[h]
            for w in [w for w, deadline in holders.items() if deadline <= now]:
                del holders[w]
                self._leases -= 1
            if not holders:
                del self._memory[h]
        self._leases_after_sweep = self._leases

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._checkpoints.clear()
            self._memory.clear()
            self._leases = self._leases_after_sweep = 0
            self._counts["writes"] += 1

    def close(self) -> None:
        self.clear()

    def rebuild_from(self, store: ObjectListing) -> int:
        """Replace the store tier with exactly what `store` lists; leases are kept."""
        blocks, checkpoints = self._listing(store)
        with self._lock:
            self._blocks = set(blocks)
            self._checkpoints = set(checkpoints)
        return len(blocks) + len(checkpoints)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks) + len(self._checkpoints)


def make_index(spec: str, fingerprint: str, store: ObjectListing | None = None,
               namespace: str | None = None) -> PrefixIndex:
    """Build the index a deployment asks for.

    `"local"`: an EmbeddedIndex, rebuilt from `store` when one is given.
    `"redis://host:port/db"` (or `rediss://`, `unix://`): a RedisIndex.
    Anything else raises ValueError naming the spec. The caller still attaches
    the index to the store (`store.attach_index`) so puts publish to it. The
    namespace is `store`'s (else `namespace`, else the fingerprint's unkeyed one).
    """
    namespace = store.namespace if store is not None else namespace
    if spec == "local":
        index = EmbeddedIndex(fingerprint, namespace=namespace)
        if store is not None:
            index.rebuild_from(store)
        return index
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from kvmesh.kvstore.index.redis_index import RedisIndex  # lazy: embedded users need no redis

        return RedisIndex(spec, fingerprint, namespace=namespace)
    raise ValueError(
        f"unknown prefix index spec {spec!r}: expected 'local' or 'redis://host:port/db'"
    )
