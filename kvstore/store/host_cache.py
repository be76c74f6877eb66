"""Host-memory tier: recently written or read cache objects, LRU by bytes.

Holds what a restore needs besides device blocks (checkpoint states, and block objects
that were evicted from the device pool) so a hot prefix never touches the store.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from kvmesh.kvstore.store.tiers import CacheTier, Shapes, nbytes, shapes_of

Key = tuple[str, int]   # (kind, hash)


class HostCache(CacheTier):
    def __init__(self, capacity_bytes: int, track_evictions: bool = True):
        self.capacity = capacity_bytes
        self.used = 0
        self._items: OrderedDict[Key, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.track_evictions = track_evictions
        self.evicted: list[Key] = []        # dropped keys, drained by the owner (kv events); if tracked

    def contains(self, kind: str, h: int) -> bool:
        return (kind, h) in self._items

    def get_many(self, kind: str, hashes: Sequence[int], expect: Shapes | None = None
                 ) -> list[dict[str, torch.Tensor] | None]:
        return [self._get(kind, h, expect) for h in hashes]

    def _get(self, kind: str, h: int, expect: Shapes | None) -> dict[str, torch.Tensor] | None:
        with self._lock:
            item = self._items.get((kind, h))
            if item is None:
                return None
            if expect is not None and shapes_of(item) != expect:
                self.used -= nbytes(self._items.pop((kind, h)))
                if self.track_evictions:
                    self.evicted.append((kind, h))
                return None
            self._items.move_to_end((kind, h))
            return item

    def put(self, kind: str, h: int, parent: int | None, token_count: int,
            tensors: dict[str, torch.Tensor]) -> int:
        size = nbytes(tensors)
        if size > self.capacity:
            return 0
        with self._lock:
            old = self._items.pop((kind, h), None)
            if old is not None:
                self.used -= nbytes(old)
            self._items[(kind, h)] = tensors
            self.used += size
            while self.used > self.capacity:
                key, evicted = self._items.popitem(last=False)
                self.used -= nbytes(evicted)
                if self.track_evictions:
                    self.evicted.append(key)
        return size

    def discard(self, keys) -> None:
        """Drop these (kind, hash) keys, where held (no eviction is recorded: nothing was lost)."""
        with self._lock:
            for key in keys:
                item = self._items.pop(key, None)
                if item is not None:
                    self.used -= nbytes(item)

    def __contains__(self, key: Key) -> bool:
        return self.contains(*key)

    def __len__(self) -> int:
        return len(self._items)
