"""EngineStats: one engine's load, memory and counters at one moment (`Engine.stats()`).

The cluster routes on it (running + waiting, free blocks and slots), the soak and
disconnect tests check it is idle, and `/metrics` exports `as_dict()`: every number in it
becomes `kvmesh_worker_<name>`, so the names below are part of the metrics surface.

`Histogram` is a cumulative latency histogram kept inside the engine (plain Python: no
Prometheus or Ray below cluster/); the ingress exports each worker's as a Prometheus histogram.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineCounters:
    """Monotonic counters the engine bumps as it works."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    steps: int = 0
    forward_s: float = 0.0
    restore_s: float = 0.0
    draft_tokens: int = 0            # speculative decoding: tokens drafted and verified
    accepted_draft_tokens: int = 0   # ... of which accepted
    drafted_steps: int = 0           # sequence-steps that verified drafts (one per sequence per step)

    def speculation(self) -> dict[str, float]:
        """Derived speculation figures (0 before any draft): the fraction of drafts accepted,
        drafts per drafted sequence-step, and tokens emitted per drafted sequence-step
        (1 + accepted / steps: the step count is cut by this factor where drafts ran)."""
        steps = max(1, self.drafted_steps)
        return dict(spec_acceptance_rate=self.accepted_draft_tokens / max(1, self.draft_tokens),
                    spec_draft_tokens_per_step=self.draft_tokens / steps,
                    spec_tokens_per_step=1 + self.accepted_draft_tokens / steps if self.drafted_steps else 0.0)


@dataclass(frozen=True)
class EngineStats:
    running: int                    # sequences in the running batch
    waiting: int                    # sequences waiting for admission
    held: int                       # prefilled requests whose cache waits for a handoff
    free_blocks: int
    total_blocks: int
    free_slots: int
    total_slots: int
    preemptions: int
    kv_cache_usage: float           # fraction of blocks in use
    counters: EngineCounters
    queue_time: dict                # Histogram.snapshot() of arrival -> first scheduled
    reuse: dict[str, Any] = field(default_factory=dict)   # prefix reuse counters, by exported name
    store: dict[str, Any] = field(default_factory=dict)   # shared store counters (empty without a store)

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def free_kv(self) -> float:
        """The scarcer of free blocks and free slots, as a fraction (what routing compares)."""
        return min(self.free_blocks / max(1, self.total_blocks), self.free_slots / max(1, self.total_slots))

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or held, and every block and slot free."""
        return (self.load == 0 and self.held == 0 and self.free_blocks == self.total_blocks
                and self.free_slots == self.total_slots)

    def as_dict(self) -> dict[str, Any]:
        """One flat map (the WorkerStats message and the /metrics names)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("counters", "reuse", "store")}
        return {**dataclasses.asdict(self.counters), **self.counters.speculation(), **out, **self.reuse, **self.store}


SHARED_GAUGES = ("store_bytes",)     # one shared store seen by every rank: its size is not summed


def summed(stats: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one (a data-parallel replica's ranks): loads, memory, counters,
    histograms and per-tier maps added up; `kv_cache_usage` the used fraction of all blocks."""
    if len(stats) == 1:
        return stats[0]
    counts = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
              if f.type in ("int", int)}
    counters = EngineCounters(**{f.name: sum(getattr(s.counters, f.name) for s in stats)
                                 for f in dataclasses.fields(EngineCounters)})
    q = [s.queue_time for s in stats]
    queue = {"buckets": [(b, sum(h["buckets"][i][1] for h in q)) for i, (b, _) in enumerate(q[0]["buckets"])],
             "sum": sum(h["sum"] for h in q), "count": sum(h["count"] for h in q)}
    usage = sum(s.kv_cache_usage * s.total_blocks for s in stats) / max(1, counts["total_blocks"])
    return EngineStats(**counts, kv_cache_usage=usage,
                       counters=counters, queue_time=queue, reuse=_added([s.reuse for s in stats]),
                       store=_added([s.store for s in stats]))


def _added(maps: list[dict]) -> dict:
    """Key by key (the union of keys); nested maps (hits by tier) the same way."""
    out: dict = {}
    for key in dict.fromkeys(k for m in maps for k in m):
        values = [m[key] for m in maps if key in m]
        if isinstance(values[0], dict):
            out[key] = _added(values)
        else:
            out[key] = max(values) if key in SHARED_GAUGES else sum(values)
    return out


QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = QUEUE_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count)...], "sum", "count"} (Prometheus' shape)."""
        cum, rows = 0, []
        for bound, n in zip(list(self.bounds) + [float("inf")], self.counts):
            cum += n
            rows.append((bound, cum))
        return {"buckets": rows, "sum": self.sum, "count": cum}
