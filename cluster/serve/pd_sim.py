"""P/D pools under a replayed trace, simulated: the planner against its baselines (issue 46 item 3).

A discrete-event simulation of one deployment: an ingress, a prefill pool and a decode pool
(disaggregated) or one colocated pool, each of simulated replicas whose step times come from a
`planner.Profile` (fitted from engine runs on the machine: bench/pd_profile.py). It replays requests
(arrival time, prompt tokens, prefix blocks, output tokens) open loop and runs a scaling policy every
interval on what the replicas report, the same `PoolObservation`s the service's replicas push:

  * ingress: a prefix hit is the longest run of the prompt's blocks that some earlier prefill finished
    (the shared store); the uncached part goes to the running prefill replica (colocated: the
    replica) with the fewest queued tokens; while none runs it waits at the ingress;
  * prefill replica: chunked prefill, first come first served, `max_batched_tokens` a step of
    prefill_step_s + n * prefill_token_s; the first token is sampled at the end of the last chunk
    (TTFT), the handoff takes `handoff_s`;
  * decode replica: continuous batching up to `max_num_seqs` sequences and `kv_tokens`; a step of
    decode_step_s + B * decode_seq_s + K * decode_kv_token_s gives every sequence one token;
  * colocated replica: both in one step (the decode batch plus a prefill chunk);
  * a new replica serves after `start_s`; a replica scaled down drains (takes no new work, finishes
    what it holds: no request fails) and is gone once empty. Replica-seconds count from a replica's
    start to its end, starting and draining included, between the first arrival and the last
    completion.

A request is good when its TTFT <= the TTFT target and its ITL (the p90 of its inter-token gaps, as
bench/goodput.py measures it) <= the ITL target; goodput per replica-second = good / replica-seconds.

Policies (each with `interval_s` and `decide(sim) -> {pool: replicas}`): `PlannerPolicy` (the service's
planner, cluster/serve/planner.py), `RayDefaultPolicy` (Ray Serve's per-deployment request-count policy
with kvmesh's Autoscaling defaults), `DynamoPolicy` (Dynamo Planner's throughput mode as its design doc
gives it), `StaticPolicy` (fixed sizes; `hill_static` searches them).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from itertools import count

from .planner import POOLS_BY_MODE, Decision, Planner, PlannerConfig, PoolObservation, Profile, fit_moments



@dataclass
class SimRequest:
    arrival: float
    prompt: int
    blocks: tuple[int, ...]
    output: int
    block_tokens: int
    uncached: int = 0
    first_t: float = -1.0           # first token (end of prefill)
    end_t: float = -1.0
    itl: float = 0.0                # p90 inter-token gap
    join: int = 0                   # the decode replica's step index when it joined the batch

    @property
    def ttft(self) -> float:
        return self.first_t - self.arrival


class Replica:
    __slots__ = ("pool", "born", "ready_at", "state", "gone", "queue", "queued_tokens", "busy", "batch", "kv",
                 "step", "ends", "finish", "waiting")

    def __init__(self, pool: str, now: float, ready_at: float):
        self.pool, self.born, self.ready_at, self.state, self.gone = pool, now, ready_at, "starting", None
        self.queue: deque[list] = deque()       # [request, prompt tokens left]
        self.queued_tokens = 0
        self.busy = False
        self.batch, self.kv, self.step = 0, 0, 0
        self.ends: list[float] = []             # end time of each decode step
        self.finish: dict[int, list[SimRequest]] = {}
        self.waiting: deque[SimRequest] = deque()

    def empty(self) -> bool:
        return not self.queue and not self.batch and not self.waiting


@dataclass
class Counters:
    arrived_tokens: int = 0
    arrived_requests: int = 0
    prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
    fit: list = field(default_factory=lambda: [0.0] * 9)     # decode-only steps' fit_moments, summed
    handoff_wait_s: float = 0.0
    handoffs: int = 0
    seq_s: float = 0.0                              # sequence-seconds in decode batches
    kv_s: float = 0.0                               # their KV token-seconds
    ended: list = field(default_factory=list)       # requests ended in the interval (Dynamo reads these)


class Simulation:
    def __init__(self, requests: list[SimRequest], profile: Profile, policy, mode: str = "disaggregated",
                 initial: dict[str, int] | None = None, warmup_s: float = 0.0):
        self.profile, self.policy, self.mode, self.warmup_s = profile, policy, mode, warmup_s
        self.pools = POOLS_BY_MODE[mode]
        self.first = "colocated" if mode == "colocated" else "prefill"
        self.requests = requests
        self.replicas: dict[str, list[Replica]] = {p: [] for p in self.pools}
        self.ingress: deque[SimRequest] = deque()
        self.handed: deque[SimRequest] = deque()        # prefilled, no decode replica running yet
        self.computed: set[tuple] = set()               # prefixes (as block tuples' ends) some prefill finished
        self.counters = {p: Counters() for p in self.pools}
        self.now = self._observed = 0.0
        self._events: list = []
        self._seq = count()
        self.timeline: list[tuple[float, dict[str, int], dict[str, str]]] = []    # (t, targets, reasons)
        self.done: list[SimRequest] = []
        for pool in self.pools:
            for _ in range((initial or {}).get(pool, 1)):
                r = Replica(pool, 0.0, 0.0)
                r.state = "running"
                self.replicas[pool].append(r)

    # ---- events ------------------------------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> "SimResult":
        for r in self.requests:
            self._at(r.arrival, self._arrive, r)
        start = self.requests[0].arrival if self.requests else 0.0
        self._at(start, self._tick)
        self._remaining = len(self.requests)
        while self._events and self._remaining:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        return self._result(start)

    def _tick(self) -> None:
        targets = self.policy.decide(self)
        if targets:
            for pool, n in targets.items():
                self._scale(pool, n)
        self._at(self.now + self.policy.interval_s, self._tick)

    # ---- ingress -------------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        hit = 0
        for i in range(len(req.blocks), 0, -1):
            if req.blocks[:i] in self.computed:
                hit = i
                break
        req.uncached = max(req.prompt - hit * req.block_tokens, 1)
        c = self.counters[self.first]
        c.arrived_tokens += req.uncached
        c.arrived_requests += 1
        self._route(req)

    def _live(self, pool: str) -> list[Replica]:
        return [r for r in self.replicas[pool] if r.state == "running"]

    def _route(self, req: SimRequest) -> None:
        live = self._live(self.first)
        if not live:
            self.ingress.append(req)
            return
        r = min(live, key=lambda x: x.queued_tokens + x.batch)
        r.queue.append([req, req.uncached])
        r.queued_tokens += req.uncached
        self._kick(r)

    def _handoff(self, req: SimRequest) -> None:
        live = self._live("decode")
        if not live:
            self.handed.append(req)
            return
        r = min(live, key=lambda x: x.batch + len(x.waiting))
        r.waiting.append(req)
        self._kick(r)

    # ---- replicas ------------------------------------------------------------------------------------
    def _kick(self, r: Replica) -> None:
        if not r.busy and not r.empty():
            self._start_step(r)

    def _start_step(self, r: Replica) -> None:
        p = self.profile
        chunk: list[tuple[list, int]] = []
        if r.pool == "decode" or r.pool == "colocated":
            self._admit(r)
        if r.pool != "decode":
            budget = p.max_batched_tokens - r.batch
            slots = p.max_num_seqs - r.batch
            for entry in r.queue:
                if budget <= 0 or slots <= 0:
                    break
                k = min(entry[1], budget)
                chunk.append((entry, k))
                budget -= k
                slots -= 1
        n = sum(k for _, k in chunk)
        if not n and not r.batch:
            r.busy = False
            return
        dur = p.decode_s(r.batch, r.kv) + (n * p.prefill_token_s + (0.0 if r.batch else p.prefill_step_s) if n else 0)
        if n:
            c = self.counters[r.pool]
            c.prefill_tokens += n
            c.prefill_busy_s += dur
        c = self.counters[r.pool]
        if not n:
            c.fit = [a + b for a, b in zip(c.fit, fit_moments(dur, r.batch, r.kv))]
        c.seq_s += r.batch * dur
        c.kv_s += r.kv * dur
        r.busy = True
        self._at(self.now + dur, self._end_step, r, chunk, r.batch > 0)

    def _admit(self, r: Replica) -> None:
        p = self.profile
        while r.waiting and r.batch < p.max_num_seqs and r.kv + r.waiting[0].prompt <= p.kv_tokens:
            req = r.waiting.popleft()
            c = self.counters[r.pool]
            c.handoff_wait_s += self.now - req.first_t
            c.handoffs += 1
            self._join(r, req)

    def _join(self, r: Replica, req: SimRequest) -> None:
        req.join = r.step
        r.batch += 1
        r.kv += req.prompt
        r.finish.setdefault(r.step + req.output - 1, []).append(req)

    def _end_step(self, r: Replica, chunk, decoded: bool) -> None:
        now = self.now
        if decoded:
            r.step += 1
            r.ends.append(now)
            r.kv += r.batch
            for req in r.finish.pop(r.step, ()):
                self._complete(r, req)
        for entry, k in chunk:
            entry[1] -= k
            r.queued_tokens -= k
            if entry[1] == 0:
                r.queue.remove(entry)
                req = entry[0]
                req.first_t = now
                self.computed.update(req.blocks[:i] for i in range(1, len(req.blocks) + 1))
                if req.output <= 1:
                    self._complete(None, req)
                elif r.pool == "colocated":
                    self._join(r, req)
                else:
                    self._at(now + self.profile.handoff_s, self._handoff, req)
        r.busy = False
        if r.state == "draining" and r.empty():
            self._retire(r)
        else:
            self._kick(r)

    def _complete(self, r: Replica | None, req: SimRequest) -> None:
        req.end_t = self.now
        if r is not None:
            ends = r.ends[req.join:r.step]
            gaps = [ends[0] - req.first_t] + [b - a for a, b in zip(ends, ends[1:])]
            gaps.sort()
            req.itl = gaps[min(len(gaps) - 1, int(round(0.9 * (len(gaps) - 1))))]
            r.batch -= 1
            r.kv -= req.prompt + req.output - 1
        self.done.append(req)
        self.counters[self.pools[-1]].ended.append(req)
        self._remaining -= 1

    # ---- scaling -------------------------------------------------------------------------------------
    def current(self, pool: str) -> tuple[int, int]:
        """(running, starting) replicas, draining ones left out."""
        rs = self.replicas[pool]
        return sum(r.state == "running" for r in rs), sum(r.state == "starting" for r in rs)

    def _scale(self, pool: str, n: int) -> None:
        running, starting = self.current(pool)
        have = running + starting
        for _ in range(n - have):
            r = Replica(pool, self.now, self.now + self.profile.start_s)
            self.replicas[pool].append(r)
            self._at(r.ready_at, self._ready, r)
        if n < have:
            cut = have - n
            for r in sorted((r for r in self.replicas[pool] if r.state == "starting"), key=lambda r: -r.born):
                if cut:
                    self._retire(r)
                    cut -= 1
            live = sorted(self._live(pool), key=lambda r: r.queued_tokens + r.batch + len(r.waiting))
            for r in live[:cut]:
                r.state = "draining"
                if r.empty() and not r.busy:
                    self._retire(r)

    def _ready(self, r: Replica) -> None:
        if r.state != "starting":
            return
        r.state = "running"
        if r.pool == self.first:
            while self.ingress:
                self._route(self.ingress.popleft())
        if r.pool == "decode":
            while self.handed:
                self._handoff(self.handed.popleft())

    def _retire(self, r: Replica) -> None:
        r.state, r.gone = "gone", self.now

    # ---- what the replicas report --------------------------------------------------------------------
    def observe(self) -> dict[str, PoolObservation]:
        """The pools' reports since the last call (the counters restart)."""
        out, span = {}, max(self.now - self._observed, 1e-9)
        self._observed = self.now
        for pool in self.pools:
            rs = [r for r in self.replicas[pool] if r.state != "gone"]
            c = self.counters[pool]
            running, starting = self.current(pool)
            out[pool] = PoolObservation(
                running=running, starting=starting, arrived_tokens=c.arrived_tokens,
                arrived_requests=c.arrived_requests,
                queued_tokens=sum(r.queued_tokens for r in rs) + (
                    sum(q.uncached for q in self.ingress) if pool == self.first else 0),
                prefill_tokens=c.prefill_tokens, prefill_busy_s=c.prefill_busy_s, decode_fit=tuple(c.fit),
                decoding=sum(r.batch for r in rs), decode_seqs=c.seq_s / span,
                decode_kv_mean=c.kv_s / span, decode_kv_tokens=sum(r.kv for r in rs),
                waiting=sum(len(r.waiting) for r in rs) + (len(self.handed) if pool == "decode" else 0),
                handoff_wait_s=c.handoff_wait_s / c.handoffs if c.handoffs else 0.0)
        self.counters = {p: Counters() for p in self.pools}
        return out

    def ongoing(self, pool: str) -> int:
        """Requests a pool holds (queued, in flight, waiting), as Serve's request-count metric sees them."""
        rs = [r for r in self.replicas[pool] if r.state != "gone"]
        n = sum(len(r.queue) + r.batch + len(r.waiting) for r in rs)
        if pool == self.first:
            n += len(self.ingress)
        if pool == "decode":
            n += len(self.handed)
        return n

    def _result(self, start: float) -> "SimResult":
        """Requests that arrived after the warm-up, and replica-seconds from its end to the last completion."""
        end = max((r.end_t for r in self.done), default=start)
        start += self.warmup_s
        replica_s = 0.0
        for rs in self.replicas.values():
            for r in rs:
                a, b = max(r.born, start), min(r.gone if r.gone is not None else end, end)
                replica_s += max(b - a, 0.0)
        scored = [r for r in self.done if r.arrival >= start]
        return SimResult(self.policy.name, scored, replica_s, max(end - start, 0.0), self.timeline)


@dataclass
class SimResult:
    policy: str
    requests: list[SimRequest]
    replica_s: float
    duration_s: float
    timeline: list

    def good(self, slo_ttft_s: float, slo_itl_s: float) -> int:
        return sum(1 for r in self.requests if r.ttft <= slo_ttft_s and r.itl <= slo_itl_s)

    def summary(self, slo_ttft_s: float, slo_itl_s: float) -> dict:
        good = self.good(slo_ttft_s, slo_itl_s)
        n = len(self.requests)
        return {"goodput_per_replica_s": good / self.replica_s if self.replica_s else 0.0,
                "attainment": good / n if n else 0.0, "requests": n, "replica_s": round(self.replica_s, 1),
                "mean_replicas": round(self.replica_s / self.duration_s, 2) if self.duration_s else 0.0}

    def flips(self, after: float = 0.0) -> dict[str, int]:
        """Per pool, how often the target count turned from rising to falling or back (decisions from
        `after` on)."""
        out = {}
        for pool in (self.timeline[0][1] if self.timeline else {}):
            seq = [t[pool] for when, t, _ in self.timeline if when >= after]
            moves = [b - a for a, b in zip(seq, seq[1:]) if b != a]
            out[pool] = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
        return out


# ---- policies ----------------------------------------------------------------------------------------
class PlannerPolicy:
    name = "planner"

    def __init__(self, planner: Planner):
        self.planner = planner
        self.interval_s = planner.config.interval_s
        self.decisions: list[Decision] = []

    def decide(self, sim: Simulation) -> dict[str, int]:
        d = self.planner.decide(sim.observe())
        self.decisions.append(d)
        sim.timeline.append((sim.now, dict(d.targets), dict(d.reasons)))
        return d.targets


class StaticPolicy:
    name = "static"

    def __init__(self, sizes: dict[str, int], interval_s: float = 10.0):
        self.sizes, self.interval_s = sizes, interval_s

    def decide(self, sim: Simulation) -> dict[str, int]:
        sim.observe()
        sim.timeline.append((sim.now, dict(self.sizes), {}))
        return self.sizes


class RayDefaultPolicy:
    """Ray Serve's default per-deployment policy: desired = ceil(average ongoing requests over the look-back
    window / target_ongoing_requests), applied once it has held upscale_delay_s (up) or downscale_delay_s
    (down), within [min, max]; sampled every metrics_interval_s. Defaults: kvmesh's `Autoscaling` defaults."""
    name = "ray_default"

    def __init__(self, max_replicas: dict[str, int], target_ongoing_requests: float = 2.0,
                 upscale_delay_s: float = 10.0, downscale_delay_s: float = 60.0, look_back_period_s: float = 10.0,
                 metrics_interval_s: float = 2.0):
        self.max_replicas, self.target = max_replicas, target_ongoing_requests
        self.up_s, self.down_s, self.look_back = upscale_delay_s, downscale_delay_s, look_back_period_s
        self.interval_s = metrics_interval_s
        self._hist: dict[str, deque] = {}
        self._since: dict[str, tuple[str, float]] = {}

    def decide(self, sim: Simulation) -> dict[str, int]:
        sim.observe()
        targets = {}
        for pool in sim.pools:
            h = self._hist.setdefault(pool, deque())
            h.append((sim.now, sim.ongoing(pool)))
            while h and h[0][0] < sim.now - self.look_back:
                h.popleft()
            avg = sum(n for _, n in h) / len(h)
            running, starting = sim.current(pool)
            have = running + starting
            desired = min(max(math.ceil(avg / self.target - 1e-9), 1), self.max_replicas.get(pool, 8))
            way = "up" if desired > have else "down" if desired < have else ""
            if pool not in self._since or way != self._since[pool][0]:
                self._since[pool] = (way, sim.now)
            held = sim.now - self._since[pool][1]
            if (way == "up" and held >= self.up_s) or (way == "down" and held >= self.down_s):
                targets[pool] = desired
                self._since[pool] = ("", sim.now)
            else:
                targets[pool] = have
        sim.timeline.append((sim.now, dict(targets), {}))
        return targets


class DynamoPolicy:
    """Dynamo Planner's throughput mode, as its design doc publishes it: every interval, the last interval's
    request count, mean ISL / OSL, mean TTFT / ITL (a constant predictor); correction factors observed /
    expected (the profile's TTFT at that ISL; its ITL at the observed batch per decode replica and context
    ISL + OSL / 2);
        prefill = ceil(requests * ISL / interval * min(1, prefill_correction) / prefill tokens/s per replica)
        decode  = ceil(requests * OSL / interval / decode tokens/s per replica at ITL target / decode_correction)
    at least one each, scaled down together to the replica budget."""
    name = "dynamo"

    def __init__(self, profile: Profile, slo_itl_s: float, interval_s: float, max_total: int):
        self.profile, self.slo_itl_s, self.interval_s, self.max_total = profile, slo_itl_s, interval_s, max_total
        self.p_corr = self.d_corr = 1.0

    def _ttft(self, isl: float) -> float:
        p, n = self.profile, int(isl)
        full, rest = divmod(n, p.max_batched_tokens)
        return full * p.prefill_s(p.max_batched_tokens) + p.prefill_s(rest)

    def _decode_tput(self, itl: float, context: float) -> float:
        p = self.profile
        best = 0.0
        for b in range(1, p.max_num_seqs + 1):
            step = p.decode_s(b, int(b * context))
            if step <= itl:
                best = max(best, b / step)
        return best or 1.0 / p.decode_s(1, int(context))

    def decide(self, sim: Simulation) -> dict[str, int]:
        done = sim.counters["decode"].ended             # requests that ended in the interval
        obs = sim.observe()
        running, starting = sim.current("decode")
        o_p, o_d = obs["prefill"], obs["decode"]
        n = o_p.arrived_requests
        if not n or not done:
            targets = {"prefill": sum(sim.current("prefill")), "decode": running + starting}
            sim.timeline.append((sim.now, dict(targets), {}))
            return targets
        isl = sum(r.prompt for r in done) / len(done)
        osl = sum(r.output for r in done) / len(done)
        ttft = sum(r.ttft for r in done) / len(done)
        itl = sum(r.itl for r in done) / len(done)
        self.p_corr = ttft / max(self._ttft(isl), 1e-9)
        per_replica = max(o_d.decoding / max(running, 1), 1.0)
        ctx = isl + osl / 2
        self.d_corr = itl / max(self.profile.decode_s(round(per_replica), int(per_replica * ctx)), 1e-9)
        p_tput = isl / self._ttft(isl)
        prefill = math.ceil(n * isl / self.interval_s * min(1.0, self.p_corr) / p_tput)
        decode = math.ceil(n * osl / self.interval_s / self._decode_tput(self.slo_itl_s / self.d_corr, ctx))
        prefill, decode = max(prefill, 1), max(decode, 1)
        if prefill + decode > self.max_total:
            f = self.max_total / (prefill + decode)
            prefill, decode = max(1, math.floor(prefill * f)), max(1, math.floor(decode * f))
        targets = {"prefill": prefill, "decode": decode}
        sim.timeline.append((sim.now, dict(targets), {}))
        return targets


# ---- scenarios ---------------------------------------------------------------------------------------
def overlaid(trace, block_tokens: int, max_tokens: int, copies: int, duration_s: float,
             extra: tuple[float, float, int] | None = None) -> list[SimRequest]:
    """`copies` tenants replaying the trace (TraceRequests, kvstore/policy/trace.py, lengths already scaled
    to block_tokens) at once for `duration_s`: a steady load `copies` times the trace's rate whose
    prefix structure is the trace's own. Copy j starts j / copies of the way into the trace (wrapping at
    its end) and has its own block ids, so tenants share no prefix. `extra` = (start s, length s, n): n
    more tenants arrive only between start and start + length (a step in the arrival rate)."""
    if not trace:
        return []
    t0 = trace[0].t
    span = trace[-1].t - t0 + 1e-3
    out = []

    def tenant(j: int, of: int, lo: float, hi: float) -> None:
        offset = (j * span / of) % span
        for r in trace:
            t = (r.t - t0 - offset) % span
            if lo <= t < hi:
                out.append(SimRequest(t, r.tokens, tuple((j, b) for b in r.blocks),
                                      max(1, min(r.output_tokens, max_tokens)), block_tokens))

    for j in range(copies):
        tenant(j, copies, 0.0, duration_s)
    if extra:
        start, length, n = extra
        for j in range(n):
            tenant(copies + j, n, start, start + length)
    out.sort(key=lambda r: r.arrival)
    return out


def simulate(requests, profile: Profile, policy, mode: str, initial: dict[str, int] | None = None,
             warmup_s: float = 0.0) -> SimResult:
    fresh = [SimRequest(r.arrival, r.prompt, r.blocks, r.output, r.block_tokens) for r in requests]
    return Simulation(fresh, profile, policy, mode, initial, warmup_s).run()


def hill_static(requests, profile: Profile, mode: str, slo_ttft_s: float, slo_itl_s: float,
                max_replicas: dict[str, int], max_total: int, start: dict[str, int], warmup_s: float = 0.0
                ) -> tuple[dict[str, int], SimResult]:
    """The best fixed sizes by hill climbing on goodput per replica-second from `start` (one replica more
    or fewer in one pool at a time, within the budgets, until no neighbour is better): a local optimum, in
    a dozen runs rather than the whole grid's."""
    seen: dict[tuple, tuple[float, SimResult]] = {}

    def score(sizes: dict[str, int]) -> float:
        key = tuple(sorted(sizes.items()))
        if key not in seen:
            res = simulate(requests, profile, StaticPolicy(sizes), mode, initial=sizes, warmup_s=warmup_s)
            seen[key] = (res.summary(slo_ttft_s, slo_itl_s)["goodput_per_replica_s"], res)
        return seen[key][0]

    cur = {p: min(max(n, 1), max_replicas.get(p, 8)) for p, n in start.items()}
    while True:
        best, best_g = cur, score(cur)
        for pool in cur:
            for step in (-1, 1):
                nxt = {**cur, pool: cur[pool] + step}
                if 1 <= nxt[pool] <= max_replicas.get(pool, 8) and sum(nxt.values()) <= max_total:
                    g = score(nxt)
                    if g > best_g:
                        best, best_g = nxt, g
        if best is cur:
            return cur, seen[tuple(sorted(cur.items()))][1]
        cur = best


@dataclass
class PdScenario:
    name: str
    requests: list[SimRequest]
    burst_at: float | None = None


def compare(trace, profile: Profile, *, mode: str = "disaggregated", slo_ttft_s: float, slo_itl_s: float,
            loads=(4, 8, 16), block_tokens: int = 32, max_tokens: int = 32, duration_s: float = 600.0,
            warmup_s: float = 120.0, interval_s: float = 10.0, max_replicas: dict[str, int] | None = None,
            max_total: int = 16, burst: tuple[int, float, int] = (1, 60.0, 10), steady_s: float = 3600.0,
            optimistic: float = 0.5) -> dict:
    """Every policy on every load (the trace at each time scale, repeated to `duration_s`) and on the
    bursty cut (the trace at burst[0] with arrivals burst[2] times as fast for burst[1] s from
    warmup_s + 2 intervals), all scored after `warmup_s`; then the planner's own checks: how many
    intervals after the burst its prefill target rose, how many intervals it takes with a profile
    `optimistic` times the real step times to fit speeds within 10 % of the real ones, and its targets'
    turns per hour on the middle load run for `steady_s` (after the warm-up: the cold start from one
    replica a pool is not a steady load)."""
    pools = POOLS_BY_MODE[mode]
    max_replicas = max_replicas or {p: 8 for p in pools}
    initial = {p: 1 for p in pools}
    cfg = PlannerConfig(slo_ttft_s, slo_itl_s, interval_s=interval_s, max_replicas=max_replicas,
                        max_total_replicas=max_total)
    scenarios = [PdScenario(f"x{load}", overlaid(trace, block_tokens, max_tokens, load, duration_s)) for load in loads]
    at = warmup_s + 2 * interval_s
    base, length, factor = burst
    scenarios.append(PdScenario(f"burst x{base}->x{base * factor}", overlaid(
        trace, block_tokens, max_tokens, base, duration_s, (at, length, base * (factor - 1))), at))
    out: dict = {"mode": mode, "slo_ttft_ms": slo_ttft_s * 1e3, "slo_itl_ms": slo_itl_s * 1e3,
                 "interval_s": interval_s, "warmup_s": warmup_s, "duration_s": duration_s, "loads": []}
    for sc in scenarios:
        row: dict = {"load": sc.name, "requests": len(sc.requests)}
        planner = PlannerPolicy(Planner(cfg, profile, mode))
        policies = [planner, RayDefaultPolicy(max_replicas, metrics_interval_s=2.0)]
        if mode == "disaggregated":
            policies.append(DynamoPolicy(profile, slo_itl_s, interval_s, max_total))
        results = {p.name: simulate(sc.requests, profile, p, mode, initial, warmup_s) for p in policies}
        mean = results["planner"].timeline
        start = {p: max(1, round(sum(t[p] for _, t, _ in mean) / len(mean))) for p in pools}
        sizes, results["best_static"] = hill_static(sc.requests, profile, mode, slo_ttft_s, slo_itl_s, max_replicas,
                                                    max_total, start, warmup_s)
        for name, res in results.items():
            row[name] = {k: round(v, 4) if isinstance(v, float) else v
                         for k, v in res.summary(slo_ttft_s, slo_itl_s).items()}
        row["best_static"]["sizes"] = sizes
        if sc.burst_at is not None:
            pool = pools[0]
            before = [t[pool] for when, t, _ in mean if when < sc.burst_at]
            after = [(when, t[pool]) for when, t, _ in mean if when >= sc.burst_at]
            rose = next((when for when, n in after if n > before[-1]), None)
            row["planner"]["intervals_to_grow"] = (
                math.ceil((rose - sc.burst_at) / interval_s - 1e-9) if rose is not None else None)
        out["loads"].append(row)
    mid = loads[len(loads) // 2]
    out["optimistic_profile"] = converge(overlaid(trace, block_tokens, max_tokens, mid, duration_s), profile, cfg,
                                         mode, optimistic)
    steady = PlannerPolicy(Planner(cfg, profile, mode))
    res = simulate(overlaid(trace, block_tokens, max_tokens, mid, warmup_s + steady_s), profile, steady, mode, initial,
                   warmup_s)
    hours = max(res.duration_s / 3600.0, 1e-9)
    out["steady_turns_per_hour"] = {p: round(n / hours, 2) for p, n in res.flips(after=warmup_s).items()}
    return out


def converge(requests, profile: Profile, cfg: PlannerConfig, mode: str, factor: float) -> dict:
    """The planner starting from a profile `factor` times the real step times: decisions until its fitted
    prefill tokens/s and decode step (at half a batch of 1,024-token sequences) are within 10 % of the
    real profile's, and stay there."""
    policy = PlannerPolicy(Planner(cfg, profile.scaled(factor), mode))
    simulate(requests, profile, policy, mode, {p: 1 for p in POOLS_BY_MODE[mode]})
    b = profile.max_num_seqs // 2
    true_step, true_tps = profile.decode_s(b, b * 1024), 1.0 / profile.prefill_token_s
    within = []
    for d in policy.decisions:
        f = d.fitted
        step = f["decode_step_s"] + b * f["decode_seq_s"] + b * 1024 * f["decode_kv_token_s"]
        within.append(abs(f["prefill_tokens_per_s"] / true_tps - 1) <= 0.1 and abs(step / true_step - 1) <= 0.1)
    k = len(within)
    while k > 0 and within[k - 1]:
        k -= 1
    return {"factor": factor, "intervals": k + 1 if k < len(within) else None, "decisions": len(within)}
