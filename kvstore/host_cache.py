"""Host-memory tier: recently written or read cache objects, LRU by bytes.

Holds what a restore needs besides device blocks (checkpoint states, and block objects
that were evicted from the device pool) so a hot prefix never touches the store.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

Key = tuple[str, int]   # (kind, hash)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HostCache:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self._items: OrderedDict[Key, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, h: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            item = self._items.get((kind, h))
            if item is not None:
                self._items.move_to_end((kind, h))
            return item

    def put(self, kind: str, h: int, tensors: dict[str, torch.Tensor]) -> None:
        size = nbytes(tensors)
        if size > self.capacity:
            return
        with self._lock:
            old = self._items.pop((kind, h), None)
            if old is not None:
                self.used -= nbytes(old)
            self._items[(kind, h)] = tensors
            self.used += size
            while self.used > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self.used -= nbytes(evicted)

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
