"""The prefix index's contract and the types every implementation shares.

`PrefixIndex` (the interface), `LookupResult`, `IndexStats`, the entry kinds and small helpers live
here, apart from the implementations (`kvmesh.kvstore.index.embedded.EmbeddedIndex`,
`kvmesh.kvstore.index.redis_index.RedisIndex`) and the factory (`kvmesh.kvstore.index.embedded.make_index`), so
each implementation imports this module and none imports another.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol, Sequence

from kvmesh.kvstore.hashing import NAMESPACE_RE, check_fingerprint, store_namespace

BLOCK = "block"
CHECKPOINT = "checkpoint"


class LookupResult(NamedTuple):
    """What the index knows about a chain of block hashes.

    stored:      number of leading hashes whose block object is in the store
                 (the walk stops at the first miss).
    checkpoints: ascending indices `i < stored` with a stored checkpoint for the
                 prefix ending at block `i`.
    memory:      worker_id -> number of leading hashes that worker holds in memory
                 under an unexpired lease (workers holding none are omitted).
    """

    stored: int
    checkpoints: tuple[int, ...]
    memory: dict[str, int]


@dataclass(frozen=True)
class IndexStats:
    """An index's counters since construction, and whether its backend answers now.

    A caller that sees `reconnects` grow re-seeds the index from the store (a server that
    came back may have lost its entries). An index with nothing to lose (embedded) never
    errs, skips or reconnects."""

    lookups: int = 0        # lookups of a non-empty chain
    hits: int = 0           # ... that found stored blocks or a memory lease
    hit_blocks: int = 0     # stored blocks those lookups found
    writes: int = 0         # publishes, removes and clears attempted
    errors: int = 0         # calls that failed: a miss, or a dropped write
    skipped: int = 0        # calls not attempted while backing off after a fault
    reconnects: int = 0     # outages that ended
    healthy: bool = True


def walk_memory(holders: Iterable[set[str]]) -> dict[str, int]:
    """Per worker, the length of the leading run of blocks it holds.

    `holders` yields, block by block, the workers with a live lease on that
    block; the walk stops as soon as no worker holds every block so far.
    """
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    for here in holders:
        alive = here if alive is None else alive & here
        if not alive:
            break
        for w in alive:
            counts[w] = counts.get(w, 0) + 1
    return counts


def empty_lookup() -> LookupResult:
    """A lookup that found nothing (a fresh dict each call)."""
    return LookupResult(0, (), {})


class ObjectListing(Protocol):
    """The part of an object store that an index can be rebuilt from."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    def list(self, kind: str) -> list[int]: ...


class PrefixIndex(abc.ABC):
    """Interface of every prefix index (embedded and Redis share one conformance suite).

    Contract:
    * An instance is bound to `fingerprint` and a namespace at construction (default
      `fingerprint[:16]`; a keyed store's, kvstore.hashing.store_namespace, when it
      indexes one); all reads and writes touch only that namespace.
    * Methods are thread-safe.
    * Publishing is idempotent; removing something absent is a no-op.
    * Store-tier entries (blocks, checkpoints) never expire; callers publish
      them only after the object is durable and remove them when it is evicted.
    * Memory-tier entries are leases of `ttl_s` seconds; publishing again renews.
    * `stats()` is cheap and never raises (the prefix cache reads it before every lookup).
    """

    def __init__(self, fingerprint: str, namespace: str | None = None) -> None:
        self._fingerprint = check_fingerprint(fingerprint)
        self._namespace = namespace or store_namespace(fingerprint)
        if not NAMESPACE_RE.match(self._namespace) or not self._namespace.startswith(store_namespace(fingerprint)):
            raise ValueError(f"index namespace {self._namespace!r} is not one of fingerprint {fingerprint[:16]}")

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def namespace(self) -> str:
        return self._namespace

    @abc.abstractmethod
    def lookup(self, hashes: Sequence[int]) -> LookupResult:
        """Walk `hashes` (a block hash chain, first block first); see LookupResult."""

    @abc.abstractmethod
    def publish_blocks(self, hashes: Sequence[int]) -> None:
        """Record that the block objects for `hashes` are durable in the store."""

    @abc.abstractmethod
    def remove_blocks(self, hashes: Sequence[int]) -> None:
        """Forget store-tier block entries (the objects were evicted or are corrupt)."""

    @abc.abstractmethod
    def publish_checkpoint(self, h: int) -> None:
        """Record that a checkpoint for the prefix ending at `h` is durable."""

    @abc.abstractmethod
    def remove_checkpoint(self, h: int) -> None:
        """Forget the checkpoint entry for `h`."""

    @abc.abstractmethod
    def publish_memory(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Lease: `worker_id` holds `hashes` in memory for the next `ttl_s` seconds."""

    @abc.abstractmethod
    def remove_memory(self, worker_id: str, hashes: Sequence[int]) -> None:
        """End `worker_id`'s leases on `hashes` (it evicted them)."""

    @abc.abstractmethod
    def stats(self) -> IndexStats:
        """Counters since construction (see IndexStats)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every entry of this fingerprint's namespace (and nothing else)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; the instance must not be used afterwards."""

    def rebuild_from(self, store: ObjectListing) -> int:
        """Publish every object listed by `store`; return how many were published.

        Additive: entries for objects missing from the store are left alone (they
        are misses on read). EmbeddedIndex overrides this to replace its store tier.
        """
        blocks, checkpoints = self._listing(store)
        self.publish_blocks(blocks)
        for h in checkpoints:
            self.publish_checkpoint(h)
        return len(blocks) + len(checkpoints)

    def _listing(self, store: ObjectListing) -> tuple[list[int], list[int]]:
        if (store.fingerprint, store.namespace) != (self._fingerprint, self._namespace):
            raise ValueError(
                f"store namespace {store.namespace} (fingerprint {store.fingerprint[:16]}) does not match "
                f"index namespace {self._namespace}"
            )
        return store.list(BLOCK), store.list(CHECKPOINT)

    def __enter__(self) -> "PrefixIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_ttl(ttl_s: float) -> None:
    """Raise ValueError unless a lease length is positive."""
    if not ttl_s > 0:
        raise ValueError(f"lease ttl_s must be positive, got {ttl_s}")
