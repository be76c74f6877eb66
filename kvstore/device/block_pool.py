"""Block pool for the classical cache: free deque, refcounts, hash -> block.

Plain Python, no torch: block ids index the cache tensors elsewhere. A block whose
refcount drops to 0 keeps its hash (so a later request can revive it) until the
allocator needs it, least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict, deque


class OutOfBlocks(RuntimeError):
    """No free or evictable block; the caller should wait or preempt."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: deque[int] = deque(range(num_blocks))     # never hashed
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed, LRU order
        self.evicted_hashes: list[int] = []                  # drained by the owner (index cleanup)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= n

    def allocate(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            h = self.block_hash[b]
            del self.by_hash[h]
            self.block_hash[b] = None
            self.evicted_hashes.append(h)
        else:
            raise OutOfBlocks("classical KV cache is full")
        self.ref[b] = 1
        return b

    def release(self, b: int) -> None:
        assert self.ref[b] > 0, f"double free of block {b}"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.block_hash[b] is None:
                self.free.append(b)
            else:
                self.cached[b] = None

    def fork(self, b: int) -> int:
        """Share a referenced block with one more sequence (n > 1 forks): refcount + 1."""
        assert self.ref[b] > 0, f"fork of free block {b}"
        self.ref[b] += 1
        return b

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def set_hash(self, b: int, h: int) -> None:
        """Name a full block by its prefix hash; a block already holding `h` wins."""
        if h in self.by_hash or self.block_hash[b] is not None:
            return
        self.block_hash[b] = h
        self.by_hash[h] = b

    def lookup(self, h: int) -> int | None:
        return self.by_hash.get(h)

    def acquire(self, h: int) -> int | None:
        """Take a reference on the block holding `h`, reviving it if it was cached."""
        b = self.by_hash.get(h)
        return None if b is None else self.touch(b)

    def touch(self, b: int) -> int:
        """Take a reference on block `b`, reviving it if it was cached (refcount 0)."""
        if self.ref[b] == 0:
            assert b in self.cached, f"touch of free block {b}"
            del self.cached[b]
        self.ref[b] += 1
        return b
