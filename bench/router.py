"""Routing at cluster scale: the real router and KV event index against simulated ranks.

    python bench/router.py [--trace ../shared/traces/conversation_trace.jsonl] [--ranks 16,64,256]
                           [--capacity-tokens 262144] [--prefill-tokens-per-s 20000] [--step-s 0.03]
                           [--utilization 0.8] [--limit N] [--json]

Each simulated rank is an engine (`SimRank`): a KV pool of `--capacity-tokens` (blocks of the
trace's 512 tokens; a running request's blocks pinned, the rest an LRU cache), a FIFO of prefill
work at `--prefill-tokens-per-s` (kvstore/policy/cost.py's `cold_ttft` of a prompt's computed tokens),
decoding each request's `output_length` at one token per `--step-s` (cost.py's step time) beside
it, and a real `KvEventPublisher` on a `LocalEventBus` (stored / removed as its pool changes, a
heartbeat every simulated second). Its load, pushed with every event as an engine's is
(`Engine.queued_tokens`), is its tokens left to prefill plus the context of every request it
has (waiting or running). The router is the ingress's: a `KvEventIndex` fed by a
`KvEventFollower`, the hint it gives (longest prefix per rank, pushed loads) and
`kvmesh.cluster.serve.routing.rank_replicas` over every rank;
it charges the chosen rank what the request adds to its load (`KvEventIndex.charge`) until that
rank's next event. The trace's `hash_ids` are the block hashes (they name prefixes already).
Requests arrive in the trace's order, its clock sped up so the cold prefill work offered is
`--utilization` of the ranks' capacity (one service's hour spread over 256 ranks would leave them
idle, and queues, not caches, make imbalance).

Reported per rank count: hit rate (prompt tokens found in the chosen rank's pool / prompt tokens),
the hit rate of an omniscient router under the same capacities (the same scoring, fed every
pool's true content and load at that instant instead of the events), the imbalance of a router
that balances alone (the same scoring and events, told no prefix: the baseline for imbalance, as
a ratio) and of one that balances alone on the true loads ("ideal": perfect information), the
decision time p50 / p99 (hint + ranking, wall clock; and the p99 of this thread's CPU time, which
a busy machine's preemption does not inflate), the load imbalance (mean over arrivals of max /
mean load over the ranks; "steady": the same without the first 10 % of arrivals, the ramp from
empty ranks, where the first arrival alone is max / mean = the rank count), the queue imbalance
(the same of the prefill queue alone: the measure before decode was modelled) and the work
imbalance (max / mean of the tokens each rank computed over the replay).
--json prints one JSON line per rank count.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import statistics
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvmesh.cluster.messages import RouteHint  # noqa: E402
from kvmesh.cluster.serve.routing import Candidate, rank_replicas  # noqa: E402
from kvmesh.kvstore.policy.cost import Hardware, cold_ttft  # noqa: E402
from kvmesh.kvstore.index.kv_events import KvEventFollower, KvEventIndex, KvEventPublisher, LocalEventBus  # noqa: E402
from kvmesh.kvstore.policy.trace import TRACE_BLOCK, TraceRequest, load_trace  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "traces",
                     "conversation_trace.jsonl")


class SimRank:
    """One engine rank: a KV pool of `capacity` blocks (the blocks of running requests pinned, the
    rest an LRU cache), a FIFO of prefill work, and the decoding requests; publishing KV events.

    A request is prefilled in arrival order at `prefill_tokens_per_s` (cost.py's `cold_ttft` of its
    computed tokens), then decodes its output at one token per `step_s` (cost.py's step time;
    decode steps run beside prefill, as a continuous batch mixes them). Its prompt's blocks are
    pinned from admission until its last token, then cached (most recent first out of the LRU)."""

    def __init__(self, name: str, capacity_blocks: int, hw: Hardware, bus: LocalEventBus):
        self.name, self.capacity, self.hw = name, capacity_blocks, hw
        self.cached: OrderedDict[int, None] = OrderedDict()     # unpinned blocks, least recent first
        self.pinned: dict[int, int] = {}                        # block -> running requests using it
        self.busy_until = 0.0           # when its queued prefill work is done (simulated seconds)
        self.now = 0.0
        self.context = 0                # prompt tokens of the requests admitted and not yet finished
        self._timeline: list[tuple[float, int, int, tuple[int, ...]]] = []   # (when, +/- tokens, order, blocks)
        self._order = 0
        self.events = KvEventPublisher(name, bus, load=self.load, epoch=name)

    def advance(self, now: float) -> None:
        """Finish the requests whose last token is due by `now` (their blocks become cache)."""
        self.now = now
        timeline = self._timeline
        while timeline and timeline[0][0] <= now:
            _, tokens, _, blocks = heapq.heappop(timeline)
            self.context -= tokens
            self._unpin(blocks)

    def queued_tokens(self) -> float:
        """Prefill tokens not yet run (the queue alone: the bench's first load measure)."""
        return max(0.0, self.busy_until - self.now) * self.hw.prefill_tokens_per_s

    def load(self) -> float:
        """What the rank pushes, as an engine does (`Engine.queued_tokens`): tokens left to prefill
        plus the context of every request admitted and not finished (the KV it holds or will, which
        each decode step reads)."""
        return self.queued_tokens() + self.context

    def held(self, blocks: tuple[int, ...]) -> int:
        return next((i for i, h in enumerate(blocks) if h not in self.cached and h not in self.pinned),
                    len(blocks))

    def run(self, req: TraceRequest, now: float) -> int:
        """Admit `req`: its hit tokens (leading whole blocks resident); queue the rest; pin its blocks."""
        self.advance(now)
        hit = max(0, min(self.held(req.blocks) * TRACE_BLOCK, req.tokens - 1)) if req.blocks else 0
        self.busy_until = max(self.busy_until, now) + cold_ttft(req.tokens - hit, self.hw)
        self.context += req.tokens
        heapq.heappush(self._timeline, (self.busy_until + req.output_tokens * self.hw.step_s, req.tokens,
                                        self._order, req.blocks))
        self._order += 1
        new = [h for h in req.blocks if h not in self.cached and h not in self.pinned]
        for h in req.blocks:
            self.cached.pop(h, None)
            self.pinned[h] = self.pinned.get(h, 0) + 1
        self.events.stored("device", new)
        self._evict()
        return hit

    def _unpin(self, blocks: tuple[int, ...]) -> None:
        for h in blocks:
            left = self.pinned[h] - 1
            if left:
                self.pinned[h] = left
            else:
                del self.pinned[h]
                self.cached[h] = None
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used cached blocks while the pool is over capacity (pinned blocks stay:
        a pool of running requests alone over capacity is let be, as a preempting engine would)."""
        dropped = []
        while self.cached and len(self.cached) + len(self.pinned) > self.capacity:
            dropped.append(self.cached.popitem(last=False)[0])
        self.events.removed("device", dropped)


def paced(requests: list[TraceRequest], n: int, hw: Hardware, utilization: float) -> list[TraceRequest]:
    """The requests with their clock sped up so their cold work is `utilization` of n ranks'."""
    work_s = sum(cold_ttft(r.tokens, hw) for r in requests)
    span_s = max(requests[-1].t - requests[0].t, 1e-9)
    stretch = work_s / (utilization * n * span_s)     # simulated seconds per trace second
    return [r._replace(t=(r.t - requests[0].t) * stretch) for r in requests]


def imbalance(values: list[float]) -> float | None:
    """max / mean (None when every value is 0)."""
    total = sum(values)
    return max(values) * len(values) / total if total else None


def replay(requests: list[TraceRequest], n: int, capacity_blocks: int, hw: Hardware, router: str = "events") -> dict:
    """One replay; `router`: "events" (the ingress's), "oracle" (the same scoring on the truth),
    "load" (the same scoring and events told no prefix: balance alone, the baseline for imbalance)
    or "ideal" (the same scoring on the true loads, told no prefix: a greedy balancer with perfect
    information, what routing on exact loads reaches on this workload)."""
    bus = LocalEventBus(maxlen=1 << 20)
    index = KvEventIndex(bus.request_snapshot)
    follow = KvEventFollower(bus, index, poll_s=0.0)
    ranks = [SimRank(f"sim/dp{i}", capacity_blocks, hw, bus) for i in range(n)]
    by_name = {r.name: r for r in ranks}
    hits = tokens = 0
    decisions, cpu, loads, queues = [], [], [], []
    work = dict.fromkeys(by_name, 0)     # tokens each rank computed
    next_beat = 0.0
    rows = [Candidate(r.name, 0.0, 1.0) for r in ranks]     # their routing stats: the sim keeps none
    for req in requests:
        for r in ranks:
            r.advance(req.t)
        if req.t >= next_beat:          # every rank beats once per simulated second
            for r in ranks:
                r.events.beat()
            next_beat = req.t + 1.0
        follow.pump()
        t0, c0 = time.perf_counter(), time.thread_time()
        if router == "oracle":          # the truth: every pool's content and load, now
            hint = RouteHint(prefix_blocks={r.name: r.held(req.blocks) for r in ranks},
                             loads={r.name: r.load() for r in ranks})
        elif router == "ideal":         # the true loads, no prefix: a balancer with perfect information
            hint = RouteHint(loads={r.name: r.load() for r in ranks})
        elif router == "load":
            hint = RouteHint(loads=index.loads())
        else:
            hint = RouteHint(prefix_blocks=index.longest_prefix(req.blocks), loads=index.loads())
        hint = dataclasses.replace(hint, prompt_blocks=len(req.blocks), block_tokens=TRACE_BLOCK)
        chosen = by_name[rank_replicas(rows, hint, 0.0)[0]]
        if router == "events":
            decisions.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.thread_time() - c0) * 1000)
        if router in ("events", "load"):
            lacking = hint.prompt_blocks - hint.prefix_blocks.get(chosen.name, 0)
            index.charge(chosen.name, lacking * TRACE_BLOCK + req.tokens)     # its prefill + its context
        for measure, out in ((SimRank.load, loads), (SimRank.queued_tokens, queues)):
            ratio = imbalance([measure(r) for r in ranks])
            if ratio is not None:
                out.append(ratio)
        hit = chosen.run(req, req.t)
        hits, tokens = hits + hit, tokens + req.tokens
        work[chosen.name] += req.tokens - hit
    warm = len(loads) // 10             # the ramp from empty ranks left out of "steady"
    out = {"ranks": n, "hit_rate": hits / tokens, "load_imbalance": statistics.fmean(loads or [1.0]),
           "steady_load_imbalance": statistics.fmean(loads[warm:] or [1.0]),
           "queue_imbalance": statistics.fmean(queues or [1.0]),
           "work_imbalance": max(work.values()) / statistics.fmean(work.values())}
    if decisions:
        q = statistics.quantiles(decisions, n=100)
        out.update(decision_ms_p50=statistics.median(decisions), decision_ms_p99=q[98],
                   decision_cpu_ms_p99=statistics.quantiles(cpu, n=100)[98])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--ranks", default="16,64,256")
    ap.add_argument("--capacity-tokens", type=int, default=256 * 1024, help="each rank's KV pool")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    ap.add_argument("--step-s", type=float, default=0.03, help="a decode step (one token per decoding request)")
    ap.add_argument("--utilization", type=float, default=0.8, help="cold prefill work / the ranks' capacity")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    requests = load_trace(a.trace, TRACE_BLOCK, limit=a.limit)
    hw = Hardware(prefill_tokens_per_s=a.prefill_tokens_per_s, store_read_bps=1e9, store_write_bps=1e9,
                  step_s=a.step_s)
    capacity = a.capacity_tokens // TRACE_BLOCK
    rows, load_at_start = [], os.getloadavg()[0]
    for n in (int(x) for x in a.ranks.split(",")):
        arrivals = paced(requests, n, hw, a.utilization)
        row = replay(arrivals, n, capacity, hw)
        row["oracle_hit_rate"] = replay(arrivals, n, capacity, hw, "oracle")["hit_rate"]
        balance = replay(arrivals, n, capacity, hw, "load")
        row.update(load_only_hit_rate=balance["hit_rate"], load_only_imbalance=balance["load_imbalance"])
        ideal = replay(arrivals, n, capacity, hw, "ideal")
        row.update(ideal_imbalance=ideal["load_imbalance"], ideal_steady_imbalance=ideal["steady_load_imbalance"])
        rows.append(row)
        if a.json:
            print(json.dumps({**row, "load_average": os.getloadavg()[0]}), flush=True)
    if not a.json:
        print(f"{len(requests)} requests, {a.capacity_tokens} tokens per rank, decode step {a.step_s} s, "
              f"utilization {a.utilization}, load average {load_at_start:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end")
        print(f"{'ranks':>6} {'hit rate':>9} {'oracle':>7} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7} {'cpu p99':>7} "
              f"{'imbalance':>9} {'load-only':>9} {'ratio':>6} {'ideal':>6} {'steady':>6} {'ideal':>6} "
              f"{'queue':>6} {'work':>5}")
        for r in rows:
            print(f"{r['ranks']:>6} {r['hit_rate']:>9.3f} {r['oracle_hit_rate']:>7.3f} "
                  f"{r['hit_rate'] / max(r['oracle_hit_rate'], 1e-9):>6.2f} {r['decision_ms_p50']:>7.3f} "
                  f"{r['decision_ms_p99']:>7.3f} {r['decision_cpu_ms_p99']:>7.3f} {r['load_imbalance']:>9.2f} "
                  f"{r['load_only_imbalance']:>9.2f} {r['load_imbalance'] / r['load_only_imbalance']:>6.2f} "
                  f"{r['ideal_imbalance']:>6.2f} {r['steady_load_imbalance']:>6.2f} "
                  f"{r['ideal_steady_imbalance']:>6.2f} {r['queue_imbalance']:>6.2f} {r['work_imbalance']:>5.2f}")

if __name__ == "__main__":
    main()
