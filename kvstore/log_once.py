"""Warn once per cause: the first failure of each kind is a warning that names its object, the
rest are debug lines (counters count them all), so a broken store, index or mount cannot flood
the log. The store, the write-behind, the Redis index and the prefix cache each keep one.

It imports nothing of kvmesh, so any package may use it (kvstore/ is the lowest that does)."""
from __future__ import annotations

import logging
import threading


class LogOnce:
    """The causes one owner has warned about. Thread-safe."""

    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, cause: str) -> bool:
        """Whether `cause` is new (it is seen from now on)."""
        with self._lock:
            new = cause not in self._seen
            self._seen.add(cause)
        return new

    def __call__(self, cause: str, msg: str, *args) -> None:
        """Log `msg % args` as a warning the first time `cause` is seen, at debug after that."""
        (self._log.warning if self.first(cause) else self._log.debug)(msg, *args, stacklevel=2)
