"""Blocking calls with a deadline: a read that hangs (a FIFO, a hung NFS mount) must not
hang the engine. The call runs on a daemon worker thread; past the deadline the caller
gets `IoTimeoutError` and the worker is abandoned (a thread stuck in the kernel cannot
be interrupted; it exits on its own if the call ever returns), and a fresh one serves
the next call.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
# a store read slower than this is a miss (the engine's `store_read_timeout_s` default)
DEFAULT_READ_TIMEOUT_S = 10.0


class IoTimeoutError(TimeoutError):
    """A store read did not finish within its deadline."""


class _Worker:
    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            if fn is None:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)


class TimedRunner:
    """Runs blocking calls with a deadline (None: inline, no deadline), at most `parallel` at once
    (each on a worker of its own; the others wait for one to free)."""

    def __init__(self, timeout_s: float | None, name: str = "kvmesh-io", parallel: int = 1):
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.timeout_s, self.name = timeout_s, name
        self._slots = threading.BoundedSemaphore(parallel)
        self._free: queue.SimpleQueue = queue.SimpleQueue()     # idle workers
        self._lock = threading.Lock()
        self.abandoned = 0          # workers left behind in a hung call

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on a worker, waited for until the deadline."""
        if self.timeout_s is None:
            return fn()
        with self._slots:
            try:
                worker = self._free.get_nowait()
            except queue.Empty:
                worker = _Worker(self.name)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            worker.jobs.put((fn, fut))
            try:
                out = fut.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                worker.jobs.put((None, None))     # it exits once the hung call returns
                with self._lock:
                    self.abandoned += 1
                raise IoTimeoutError(f"no answer within {self.timeout_s:g} s") from None
            except BaseException:
                if fut.done():
                    self._free.put(worker)
                else:                               # interrupted with fn still running: let it go
                    worker.jobs.put((None, None))
                raise
            self._free.put(worker)
            return out
