"""Requests parked outside the batch until a future ends: their grammar's compile, or the
store reads of their prefix hit (workers/reuse/prefix_cache.py's prefetch).

A guided request whose grammar is not compiled yet (workers.sampling.grammar.GuideCompiler
compiles it in its pool) is parked here instead of the scheduler: it holds no batch slot, no
block and no state slot, and the engine keeps stepping the others. Each step the engine takes
the ones whose compile ended (`ready`) and queues them, or fails them with the compile's error.
A data-parallel rank parks its own requests the same way, so a compile never runs inside the
replica's lockstep step. A request whose hit needs store objects waits in a second `Parked`
for its reads, with a deadline: past it, `ready` gives it back all the same (it runs with what
arrived).
"""
from __future__ import annotations

import concurrent.futures
import math
import time

from kvmesh.workers.request import Sequence


class Parked:
    def __init__(self):
        self._parked: dict[str, tuple[Sequence, concurrent.futures.Future, float]] = {}

    def park(self, seq: Sequence, future: concurrent.futures.Future, deadline: float = math.inf) -> None:
        """Hold seq until `future` ends, or until time.monotonic() passes `deadline`."""
        self._parked[seq.request_id] = (seq, future, deadline)

    def drop(self, request_id: str) -> bool:
        """Forget a parked request (aborted); whether it was parked. Its future goes on (a
        compile is cached, reads land in the staged tier)."""
        return self._parked.pop(request_id, None) is not None

    def ready(self) -> list[tuple[Sequence, concurrent.futures.Future]]:
        """The parked requests whose future ended or whose deadline passed, taken out, in the
        order they arrived."""
        now = time.monotonic()
        done = [(seq, f) for seq, f, deadline in self._parked.values() if f.done() or now >= deadline]
        for seq, _ in done:
            del self._parked[seq.request_id]
        return done

    def futures(self) -> list[concurrent.futures.Future]:
        return [f for _, f, _ in self._parked.values()]

    def next_deadline(self) -> float:
        return min((d for _, _, d in self._parked.values()), default=math.inf)

    def wait(self, timeout_s: float) -> None:
        """Block until some parked future ends, at most `timeout_s` (an engine with nothing else to run)."""
        concurrent.futures.wait(self.futures(), timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self._parked)


GrammarWait = Parked        # the grammar's (its first use)
