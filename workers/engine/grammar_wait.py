"""Requests waiting for their grammar, outside the batch.

A guided request whose grammar is not compiled yet (workers.sampling.grammar.GuideCompiler
compiles it in its pool) is parked here instead of the scheduler: it holds no batch slot, no
block and no state slot, and the engine keeps stepping the others. Each step the engine takes
the ones whose compile ended (`ready`) and queues them, or fails them with the compile's error.
A data-parallel rank parks its own requests the same way, so a compile never runs inside the
replica's lockstep step.
"""
from __future__ import annotations

import concurrent.futures

from kvmesh.workers.request import Sequence


class GrammarWait:
    def __init__(self):
        self._parked: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}

    def park(self, seq: Sequence, future: concurrent.futures.Future) -> None:
        self._parked[seq.request_id] = (seq, future)

    def drop(self, request_id: str) -> bool:
        """Forget a parked request (aborted); whether it was parked. Its compile goes on (cached)."""
        return self._parked.pop(request_id, None) is not None

    def ready(self) -> list[tuple[Sequence, concurrent.futures.Future]]:
        """The parked requests whose compile ended, taken out, in the order they arrived."""
        done = [(seq, f) for seq, f in self._parked.values() if f.done()]
        for seq, _ in done:
            del self._parked[seq.request_id]
        return done

    def wait(self, timeout_s: float) -> None:
        """Block until some parked compile ends, at most `timeout_s` (an engine with nothing else to run)."""
        concurrent.futures.wait([f for _, f in self._parked.values()], timeout_s,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self._parked)
