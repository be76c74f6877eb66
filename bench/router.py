"""Routing at cluster scale: the real router and KV event index against simulated ranks.

    python bench/router.py [--trace ../shared/traces/conversation_trace.jsonl] [--ranks 16,64,256]
                           [--capacity-tokens 262144] [--utilization 0.8] [--limit N] [--json]

Each simulated rank is an engine's cache and queue: an LRU device pool of `--capacity-tokens`
(blocks of the trace's 512 tokens), a FIFO of prefill work drained at `--prefill-tokens-per-s`
(kvstore/cost.py's `cold_ttft` times a prompt's computed tokens), and a real `KvEventPublisher`
on a `LocalEventBus` (stored / removed as its pool changes, its queued tokens as its load,
a heartbeat every simulated second). The router is the ingress's: a `KvEventIndex` fed by a
`KvEventFollower`, the hint it gives (longest prefix per rank, pushed loads) and
`cluster.serve.routing.rank_replicas` over every rank; it charges the chosen rank the tokens it
sent there (`KvEventIndex.charge`) until that rank's next event. The trace's `hash_ids` are the block hashes
(they name prefixes already). Requests arrive in the trace's order, its clock sped up so the
cold prefill work offered is `--utilization` of the ranks' capacity (one service's hour spread
over 256 ranks would leave them idle, and queues, not caches, make imbalance).

Reported per rank count: hit rate (prompt tokens found in the chosen rank's pool / prompt tokens),
the hit rate of an omniscient router under the same capacities (the same scoring, fed every
pool's true content and queue at that instant instead of the events), the decision time p50 /
p99 (hint + ranking, wall clock; and the p99 of this thread's CPU time, which a busy machine's
preemption does not inflate), the load imbalance (mean over arrivals of max / mean queued
tokens, over arrivals where some rank is queued) and the work imbalance (max / mean of the tokens
each rank computed over the replay). --json prints one JSON line per rank count.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.messages import RouteHint  # noqa: E402
from cluster.serve.routing import Candidate, rank_replicas  # noqa: E402
from kvstore.cost import Hardware, cold_ttft  # noqa: E402
from kvstore.kv_events import KvEventFollower, KvEventIndex, KvEventPublisher, LocalEventBus  # noqa: E402
from kvstore.trace import TRACE_BLOCK, TraceRequest, load_trace  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "traces",
                     "conversation_trace.jsonl")


class SimRank:
    """One engine rank: an LRU pool of block hashes and a prefill queue, publishing KV events."""

    def __init__(self, name: str, capacity_blocks: int, hw: Hardware, bus: LocalEventBus):
        self.name, self.capacity, self.hw = name, capacity_blocks, hw
        self.pool: OrderedDict[int, None] = OrderedDict()
        self.busy_until = 0.0           # when its queued prefill work is done (simulated seconds)
        self.now = 0.0
        self.events = KvEventPublisher(name, bus, load=self.queued_tokens, epoch=name)

    def queued_tokens(self) -> float:
        return max(0.0, self.busy_until - self.now) * self.hw.prefill_tokens_per_s

    def held(self, blocks: tuple[int, ...]) -> int:
        return next((i for i, h in enumerate(blocks) if h not in self.pool), len(blocks))

    def run(self, req: TraceRequest, now: float) -> int:
        """Admit `req`: its hit tokens (leading whole blocks resident); queue the rest; cache it."""
        self.now = now
        hit = min(self.held(req.blocks) * TRACE_BLOCK, req.tokens - 1) if len(req.blocks) else 0
        hit = max(0, hit)
        self.busy_until = max(self.busy_until, now) + cold_ttft(req.tokens - hit, self.hw)
        for h in req.blocks:
            self.pool[h] = None
            self.pool.move_to_end(h)
        dropped = []
        while len(self.pool) > self.capacity:
            dropped.append(self.pool.popitem(last=False)[0])
        self.events.stored("device", req.blocks)
        self.events.removed("device", dropped)
        return hit


def paced(requests: list[TraceRequest], n: int, hw: Hardware, utilization: float) -> list[TraceRequest]:
    """The requests with their clock sped up so their cold work is `utilization` of n ranks'."""
    work_s = sum(cold_ttft(r.tokens, hw) for r in requests)
    span_s = max(requests[-1].t - requests[0].t, 1e-9)
    stretch = work_s / (utilization * n * span_s)     # simulated seconds per trace second
    return [r._replace(t=(r.t - requests[0].t) * stretch) for r in requests]


def replay(requests: list[TraceRequest], n: int, capacity_blocks: int, hw: Hardware, oracle: bool) -> dict:
    bus = LocalEventBus(maxlen=1 << 20)
    index = KvEventIndex(bus.request_snapshot)
    follow = KvEventFollower(bus, index, poll_s=0.0)
    ranks = [SimRank(f"sim/dp{i}", capacity_blocks, hw, bus) for i in range(n)]
    by_name = {r.name: r for r in ranks}
    hits = tokens = 0
    decisions, cpu, imbalance = [], [], []
    work = dict.fromkeys(by_name, 0)     # tokens each rank computed
    next_beat = 0.0
    for req in requests:
        for r in ranks:
            r.now = req.t
        if req.t >= next_beat:          # every rank beats once per simulated second
            for r in ranks:
                r.events.beat()
            next_beat = req.t + 1.0
        follow.pump()
        t0, c0 = time.perf_counter(), time.thread_time()
        if oracle:                      # the truth: every pool's content and queue, now
            hint = RouteHint(prefix_blocks={r.name: r.held(req.blocks) for r in ranks},
                             loads={r.name: r.queued_tokens() for r in ranks})
        else:
            hint = RouteHint(prefix_blocks=index.longest_prefix(req.blocks), loads=index.loads())
        hint = dataclasses.replace(hint, prompt_blocks=len(req.blocks), block_tokens=TRACE_BLOCK)
        rows = [Candidate(r.name, 0.0, 1.0) for r in ranks]
        chosen = by_name[rank_replicas(rows, hint, 0.0)[0]]
        if not oracle:
            decisions.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.thread_time() - c0) * 1000)
            index.charge(chosen.name, (hint.prompt_blocks - hint.prefix_blocks.get(chosen.name, 0)) * TRACE_BLOCK)
        queued = [r.queued_tokens() for r in ranks]
        if any(queued):
            imbalance.append(max(queued) / statistics.fmean(queued))
        hit = chosen.run(req, req.t)
        hits, tokens = hits + hit, tokens + req.tokens
        work[chosen.name] += req.tokens - hit
    out = {"ranks": n, "hit_rate": hits / tokens, "load_imbalance": statistics.fmean(imbalance or [1.0]),
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
    ap.add_argument("--utilization", type=float, default=0.8, help="cold prefill work / the ranks' capacity")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    requests = load_trace(a.trace, TRACE_BLOCK, limit=a.limit)
    hw = Hardware(prefill_tokens_per_s=a.prefill_tokens_per_s, store_read_bps=1e9, store_write_bps=1e9)
    capacity = a.capacity_tokens // TRACE_BLOCK
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        arrivals = paced(requests, n, hw, a.utilization)
        row = replay(arrivals, n, capacity, hw, oracle=False)
        row["oracle_hit_rate"] = replay(arrivals, n, capacity, hw, oracle=True)["hit_rate"]
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
    if not a.json:
        print(f"{len(requests)} requests, {a.capacity_tokens} tokens per rank, utilization {a.utilization}, load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'ranks':>6} {'hit rate':>9} {'oracle':>7} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7} {'cpu p99':>7} "
              f"{'imbalance':>9} {'work':>5}")
        for r in rows:
            print(f"{r['ranks']:>6} {r['hit_rate']:>9.3f} {r['oracle_hit_rate']:>7.3f} "
                  f"{r['hit_rate'] / max(r['oracle_hit_rate'], 1e-9):>6.2f} {r['decision_ms_p50']:>7.3f} "
                  f"{r['decision_ms_p99']:>7.3f} {r['decision_cpu_ms_p99']:>7.3f} {r['load_imbalance']:>9.2f} "
                  f"{r['work_imbalance']:>5.2f}")


if __name__ == "__main__":
    main()
