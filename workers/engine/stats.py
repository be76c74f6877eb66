"""EngineStats: one engine's load, memory and counters at one moment (`Engine.stats()`).

Typed records all the way to the exporter (vLLM v1 `metrics/stats.py`): `EngineCounters`,
`ReuseCounters` (prefix reuse) and `StoreCounters` (the shared store) travel inside
`EngineStats`, pickled across Ray, and data-parallel ranks add up with `summed`. The cluster
routes on it (running + waiting, free blocks and slots), the soak and disconnect tests check
it is idle, and `/metrics` exports `as_dict()`: every number in it becomes
`kvmesh_worker_<name>`, so the names below (a field's `metric` metadata, else the record's
prefix + its name) are part of the metrics surface.

`Histogram` is a cumulative latency histogram kept inside the engine (plain Python: no
Prometheus or Ray below cluster/); the ingress exports each worker's as a Prometheus histogram.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")


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
    handoff_draft_tokens: int = 0    # decode role: drafts that came with handoffs (the prefill engine's MTP
                                     # state), verified in the handed-off requests' first steps

    def speculation(self) -> dict[str, float]:
        """Derived speculation figures (0 before any draft): the fraction of drafts accepted,
        drafts per drafted sequence-step, and tokens emitted per drafted sequence-step
        (1 + accepted / steps: the step count is cut by this factor where drafts ran)."""
        steps = max(1, self.drafted_steps)
        return dict(spec_acceptance_rate=self.accepted_draft_tokens / max(1, self.draft_tokens),
                    spec_draft_tokens_per_step=self.draft_tokens / steps,
                    spec_tokens_per_step=1 + self.accepted_draft_tokens / steps if self.drafted_steps else 0.0)


@dataclass
class PlannerCounters:
    """Monotonic sums the P/D planner reads (cluster/serve/planner.py, through the pools'
    `record_autoscaling_stats`): prompt tokens computed and the seconds of the steps that computed
    them, sequence- and KV-token-seconds of the sequences decoding, and the decode-only steps'
    least-squares moments for step_s = a + b * sequences + c * KV tokens (planner.fit_moments)."""
    arrived_requests: int = 0
    prefill_tokens: int = 0
    prefill_step_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_kv_s: float = 0.0
    fit_n: float = 0.0
    fit_b: float = 0.0
    fit_k: float = 0.0
    fit_bb: float = 0.0
    fit_bk: float = 0.0
    fit_kk: float = 0.0
    fit_y: float = 0.0
    fit_yb: float = 0.0
    fit_yk: float = 0.0

    def step(self, step_s: float, prompt_tokens: int, seqs: int, kv_tokens: int) -> None:
        """One engine step: `prompt_tokens` computed, `seqs` sequences decoding with `kv_tokens` KV."""
        if prompt_tokens:
            self.prefill_tokens += prompt_tokens
            self.prefill_step_s += step_s
        self.decode_seq_s += seqs * step_s
        self.decode_kv_s += kv_tokens * step_s
        if seqs and not prompt_tokens:
            b, k = float(seqs), float(kv_tokens)
            self.fit_n += 1.0
            self.fit_b += b
            self.fit_k += k
            self.fit_bb += b * b
            self.fit_bk += b * k
            self.fit_kk += k * k
            self.fit_y += step_s
            self.fit_yb += step_s * b
            self.fit_yk += step_s * k


def _metric(name: str, shared: bool = False) -> dict:
    """A field's metadata: its /metrics name; `shared`: one value every rank sees (not summed)."""
    return {"metric": name, "shared": shared}


@dataclass(frozen=True)
class ReuseCounters:
    """Prefix reuse since start-up (the exported part of workers.reuse's ReuseStats; vLLM's
    PrefixCacheStats): exported as `prefix_query_tokens`, `prefix_hit_tokens` and `reuse_<name>`."""
    PREFIX = "reuse_"
    query_tokens: int = field(default=0, metadata=_metric("prefix_query_tokens"))   # prompt tokens looked up
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict,               # "device" | "host" | "store"
                                               metadata=_metric("prefix_hit_tokens"))
    hits: int = 0
    hit_tokens: int = 0
    bytes_loaded: int = 0
    blocks_from_store: int = 0
    blocks_from_memory: int = 0
    recomputed_tokens: int = 0
    errors: int = 0                 # restores / index calls that failed: served cold


@dataclass(frozen=True)
class StoreCounters:
    """The shared store as this engine sees it (kvstore.store.object_store.StoreStats' exported part):
    exported as `store_<name>`; `bytes` (the namespace's size) is shared by every rank."""
    PREFIX = "store_"
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    corrupt: int = 0
    bytes: int = field(default=0, metadata=_metric("store_bytes", shared=True))
    read_errors: int = 0
    timeouts: int = 0
    quarantined: int = 0
    scrub_objects: dict[str, int] = field(default_factory=dict,     # "ok" | "removed" | "quarantined"
                                          metadata=_metric("store_scrub_objects"))
    scrub_passes: int = 0
    scrub_last_pass_s: float = field(default=0.0, metadata=_metric("store_scrub_last_pass_s", shared=True))


@dataclass(frozen=True)
class GrammarCounters:
    """Guided decoding's grammar compiles (workers.sampling.grammar.GrammarStats, plus the
    requests parked for theirs): exported as `grammar_<name>`."""
    PREFIX = "grammar_"
    waiting: int = 0          # requests waiting outside the batch for their grammar
    processes: int = 0        # compiler processes up now
    running: int = 0          # compiles in a compiler process now
    queued: int = 0           # compiles waiting for a compiler process
    compiles: int = 0         # compiles ended since start
    cache_hits: int = 0       # requests whose grammar was compiled already
    coalesced: int = 0        # requests that joined an identical compile in progress
    budget_kills: int = 0     # compiles stopped at their time or memory budget
    refusals_remembered: int = 0    # requests refused at once: their grammar was refused before
    preempted: int = 0        # compiles stopped after their slice for a shorter one, and queued again


@dataclass(frozen=True)
class EplbCounters:
    """Expert-parallel load balancing (workers.parallel.expert_balance; every rank computes the
    same values, so ranks add up as the max): exported as `eplb_<name>`. `imbalance`: max / mean
    tokens per rank, averaged over the MoE layers, over the last window_size steps as placed;
    `imbalance_static`: the same picks under the split without EPLB (rank r: its block of experts)."""
    PREFIX = "eplb_"
    steps: int = field(default=0, metadata=_metric("eplb_steps", shared=True))
    rebalances: int = field(default=0, metadata=_metric("eplb_rebalances", shared=True))
    moved_experts: int = 0                    # experts this rank received in rebalances (summed: all moves)
    rebalance_s: float = field(default=0.0, metadata=_metric("eplb_rebalance_s", shared=True))
    imbalance: float = field(default=0.0, metadata=_metric("eplb_imbalance", shared=True))
    imbalance_static: float = field(default=0.0, metadata=_metric("eplb_imbalance_static", shared=True))


def exported(record: ReuseCounters | StoreCounters | GrammarCounters | EplbCounters) -> dict[str, Any]:
    """A record's fields under their /metrics names (maps copied)."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        out[f.metadata.get("metric", record.PREFIX + f.name)] = dict(value) if isinstance(value, dict) else value
    return out


def added(records: list[R]) -> R:
    """Records of one type field by field: numbers summed (a `shared` one: the max), maps key by key."""
    values = {}
    for f in dataclasses.fields(records[0]):
        got = [getattr(r, f.name) for r in records]
        if isinstance(got[0], dict):
            values[f.name] = {k: sum(m.get(k, 0) for m in got) for k in dict.fromkeys(k for m in got for k in m)}
        else:
            values[f.name] = max(got) if f.metadata.get("shared") else sum(got)
    return type(records[0])(**values)


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
    reuse: ReuseCounters = field(default_factory=ReuseCounters)
    store: StoreCounters | None = None      # None without a shared store
    grammar: GrammarCounters = field(default_factory=GrammarCounters)
    eplb: EplbCounters | None = None        # None without EPLB
    restoring: int = 0              # requests parked while their prefix hit's store reads run (prefetch)
    queued_prompt_tokens: int = 0   # prompt tokens waiting or running and not computed yet
    planner: PlannerCounters = field(default_factory=PlannerCounters)

    @property
    def load(self) -> int:
        """Requests running, waiting for admission, for their grammar, or for their prefix's reads."""
        return self.running + self.waiting + self.grammar.waiting + self.restoring

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
               if f.name not in ("counters", "reuse", "store", "grammar", "eplb")}
        store = exported(self.store) if self.store is not None else {}
        eplb = exported(self.eplb) if self.eplb is not None else {}
        return {**dataclasses.asdict(self.counters), **self.counters.speculation(), **out, **exported(self.reuse),
                **store, **exported(self.grammar), **eplb}


def summed(stats: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one (a data-parallel replica's ranks): loads, memory, counters,
    histograms and per-tier maps added up; `kv_cache_usage` the used fraction of all blocks."""
    if len(stats) == 1:
        return stats[0]
    counts = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
              if f.type in ("int", int)}
    q = [s.queue_time for s in stats]
    queue = {"buckets": [(b, sum(h["buckets"][i][1] for h in q)) for i, (b, _) in enumerate(q[0]["buckets"])],
             "sum": sum(h["sum"] for h in q), "count": sum(h["count"] for h in q)}
    usage = sum(s.kv_cache_usage * s.total_blocks for s in stats) / max(1, counts["total_blocks"])
    stores = [s.store for s in stats if s.store is not None]
    eplb = [s.eplb for s in stats if s.eplb is not None]
    return EngineStats(**counts, kv_cache_usage=usage, counters=added([s.counters for s in stats]),
                       queue_time=queue, reuse=added([s.reuse for s in stats]),
                       store=added(stores) if stores else None, grammar=added([s.grammar for s in stats]),
                       eplb=added(eplb) if eplb else None, planner=added([s.planner for s in stats]))


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
