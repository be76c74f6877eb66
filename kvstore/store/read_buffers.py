"""Host memory for store reads that outlive the call (a prefetch's objects), reused once freed.

A restore's reads land in fresh host memory when they are not read into the store's one staging
buffer: a prefetch keeps its objects until the request is admitted, so each read needs memory of
its own. Fresh memory is faulted in page by page as the read writes it — on the 2-core VM here
27–39 ms for 9 MB, against 0.4 ms to write memory already touched, more than the read itself — so
a buffer whose objects are all gone goes back here and the next read of about its size reuses it.

    buffers = ReadBuffers(keep_bytes=512 << 20)
    rows = buffers.take(n * size).view(n, size)   # a uint8 tensor; back here once no view of it is left

A buffer returns when its memory is no longer referenced by any tensor (the numpy array the tensor
was made from is finalized with its storage), so a buffer still read by anyone is never reused.
At most `keep_bytes` of free buffers are kept; beyond that a freed one is released to the system.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

ROUND = 64 << 10         # buffers are allocated in 64 KiB multiples (a read takes the smallest free one that holds it)


class ReadBuffers:
    def __init__(self, keep_bytes: int):
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []       # whole buffers nobody views
        self._lock = threading.RLock()          # RLock: a buffer may come back while take() holds it
        self.taken = self.reused = 0

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of `nbytes` bytes: the smallest free buffer that holds it, else a new one."""
        with self._lock:
            self.taken += 1
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
            if base is not None:
                self.reused += 1
        if base is None:
            base = np.empty(-(-max(nbytes, 1) // ROUND) * ROUND, dtype=np.uint8)
        view = base[:nbytes]                 # the tensor holds this array; it dies with the tensor's storage
        if self.keep_bytes:
            weakref.finalize(view, self._give_back, base)
        return torch.from_numpy(view)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if sum(b.nbytes for b in self._free) + base.nbytes <= self.keep_bytes:
                self._free.append(base)
