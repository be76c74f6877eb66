"""Write-behind persistence: store puts run on a background thread, off the request path.

The caller hands over CPU copies; `ObjectStore.put` publishes each object to the index
only once it is durable. Failures are logged and counted, never raised into serving.
The same thread runs the background scrub (`kvmesh.kvstore.store.scrub.ScrubSchedule`) when one is due,
between puts: the store's IO is never scrubbed and written at once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

import torch

from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.scrub import ScrubSchedule
from kvmesh.kvstore.store.object_store import ObjectStore

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 60.0


class PutJob(NamedTuple):
    kind: str
    hash: int
    parent: int | None
    token_count: int
    tensors: dict[str, torch.Tensor]


class WriteBehind:
    def __init__(self, store: ObjectStore, max_pending: int = 4096, scrub: ScrubSchedule | None = None):
        self.store = store
        self.scrub = scrub
        self._closing = threading.Event()     # stops a scrub pass in progress
        self._q: queue.Queue[PutJob | None] = queue.Queue(max_pending)
        self.stats = {"queued": 0, "written": 0, "bytes": 0, "errors": 0, "dropped": 0, "write_s": 0.0}
        self._warn = LogOnce(log)      # a broken store must not flood the log
        self._thread = threading.Thread(target=self._run, name="kvmesh-persist", daemon=True)
        self._thread.start()

    def submit(self, job: PutJob) -> None:
        try:
            self._q.put_nowait(job)
            self.stats["queued"] += 1
        except queue.Full:  # the store is slower than serving: skip rather than stall requests
            self.stats["dropped"] += 1

    def _run(self) -> None:
        while True:
            if self.scrub is not None:
                self.scrub.run_if_due(self._closing)
            try:
                idle = self.scrub is None or self._closing.is_set()     # closing: no more passes
                job = self._q.get(timeout=None if idle else self.scrub.wait_s())
            except queue.Empty:     # a scrub is due
                continue
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                self.stats["bytes"] += self.store.put(job.kind, job.hash, job.parent, job.token_count, job.tensors)
                self.stats["write_s"] += time.perf_counter() - t0
                self.stats["written"] += 1
            except Exception as e:
                self.stats["errors"] += 1
                cause = type(e).__name__
                self._warn(cause, "persisting %s %x failed (%s: %s); it stays uncached", job.kind if job else "?",
                           job.hash if job else 0, cause, e)
            finally:
                self._q.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted object is durable (or failed); False if `timeout_s`
        passed first (a hung store must not hang shutdown)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._q.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._closing.set()
        if not self.flush(timeout_s):
            log.warning("store writes still pending after %.0f s at close: abandoned (they stay uncached)",
                        timeout_s)
            return
        self._q.put(None)
        self._thread.join(timeout=10)
