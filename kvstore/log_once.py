"""Warn once per cause: the first failure of each kind is a warning that names its object, the
rest are debug lines (counters count them all), so a broken store, index or mount cannot flood
the log. The store, the write-behind, the Redis index and the prefix cache each keep one.
`RateLimit` is the same idea for what recurs by the request (a refusal, a cancel): one line per
cause per period, with a count of the ones held back.

It imports nothing of kvmesh, so any package may use it (kvstore/ is the lowest that does)."""
from __future__ import annotations

import logging
import threading
import time


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


class RateLimit:
    """At most one line per cause every `every_s` seconds, for what keeps happening by the
    request (a refused request, a client's cancel): the first of a cause is logged, the next one
    `every_s` later says how many were held back meanwhile, the ones between are counted only.
    Causes are few and bounded (an error's kind and field, never a request's text); the table
    keeps the newest `max_causes`. Thread-safe."""

    def __init__(self, every_s: float = 60.0, max_causes: int = 1024, clock=time.monotonic):
        self.every_s, self.max_causes = every_s, max_causes
        self._clock = clock
        self._causes: dict[str, list] = {}       # cause -> [time of the last line, held back since]
        self._lock = threading.Lock()

    def allow(self, cause: str) -> int | None:
        """None when this occurrence of `cause` is held back (counted); else how many were held
        back since the cause's last line (0 for its first), and the line is to be logged now."""
        now = self._clock()
        with self._lock:
            entry = self._causes.get(cause)
            if entry is not None and now - entry[0] < self.every_s:
                entry[1] += 1
                return None
            held = entry[1] if entry is not None else 0
            self._causes.pop(cause, None)
            self._causes[cause] = [now, 0]
            while len(self._causes) > self.max_causes:
                del self._causes[next(iter(self._causes))]
            return held

    def suffix(self, held: int) -> str:
        """What a line adds for the occurrences held back before it."""
        return f" ({held} more like it since the last such line, not logged)" if held else ""
