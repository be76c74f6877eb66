"""The P/D planner: one decision sizes the prefill and decode pools (or the colocated pool) together,
from TTFT / ITL targets and what the replicas report (DESIGN.md §12; issue 46 item 2).

Every `interval_s` the planner gets one `PoolObservation` per pool and returns a `Decision`: a target
replica count and a reason code per pool. It reads

  * arrival-side demand: uncached prompt tokens that *arrived* in the interval (not completions, which
    stall under backpressure) and the prompt tokens queued or in flight now;
  * prefill speed, measured: step seconds spent per prompt token computed, blended with the start-up
    profile by how many tokens were measured (the profile's weight decays each interval);
  * decode step time against the batch: step_s = a + b * sequences + c * KV tokens, fitted online by
    ridge-regularised least squares toward the profile (old samples decay);
  * decode concurrency: sequences in a batch on time average, and handoffs waiting for a slot (with how
    long they waited).

Sizing, per pool:

  * prefill: the fewest replicas that start `attainment` of the prompts within the TTFT target (an M/M/c
    queue: the arrival-side token rate on the measured speed, `replicas_for`), or enough to drain the
    queued tokens within the target plus two start-ups while serving arrivals, whichever is more;
  * decode: the interval's mean batch (plus the handoffs waiting, once they wait as long as a TTFT
    target) over the largest batch whose fitted step stays within `itl_margin` of the ITL target (and
    within the replica's KV tokens and max_num_seqs); it at most doubles (+1) a decision;
  * colocated: the sum of both on one pool.

Scaling up is immediate. Scaling down needs `down_intervals` decisions in a row (`down_intervals_fast`
for a cut to half or fewer) whose sizing for a `down_strict` share of the misses (and `down_band` of a
batch) fits on fewer replicas, goes to the largest of those, and never below what the queue needs. A pool
stays in [min_replicas, max_replicas], all pools within `max_total_replicas`. The same class sizes a
running deployment as Serve's application-level autoscaling policy (cluster/serve/autoscale.py) and
runs against its baselines in `kvmesh simulate --pd` (cluster/serve/pd_sim.py).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

POOLS_BY_MODE = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated",)}
BURST = 2.5         # an interval's arrivals this many times the smoothed rate: a burst, scaled for at once

# Reason codes: every decision gives one per pool.
REASONS = ("up_queue", "up_demand", "up_itl", "up_kv", "up_slots", "up_handoff_wait", "down_idle", "hold", "hold_cooldown", "min_replicas",
           "budget_pool", "budget_total")


@dataclass(frozen=True)
class Profile:
    """One replica's step timing (fitted by bench/pd_profile.py) and capacity."""
    prefill_step_s: float           # fixed cost of a step that computes prompt tokens
    prefill_token_s: float          # per prompt token computed
    decode_step_s: float            # fixed cost of a decode step
    decode_seq_s: float             # per sequence in the batch
    decode_kv_token_s: float        # per KV token the batch holds
    max_batched_tokens: int = 512
    max_num_seqs: int = 8
    kv_tokens: int = 1 << 20        # KV tokens a replica holds
    handoff_s: float = 0.01         # prefill -> decode handoff
    start_s: float = 20.0           # a replica's start-up

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_step_s + tokens * self.prefill_token_s if tokens else 0.0

    def decode_s(self, seqs: int, kv_tokens: int) -> float:
        return self.decode_step_s + seqs * self.decode_seq_s + kv_tokens * self.decode_kv_token_s if seqs else 0.0

    def scaled(self, factor: float) -> "Profile":
        """Every step `factor` times as long (0.5: a profile 2x too optimistic about the real one)."""
        return replace(self, prefill_step_s=self.prefill_step_s * factor, prefill_token_s=self.prefill_token_s * factor,
                       decode_step_s=self.decode_step_s * factor, decode_seq_s=self.decode_seq_s * factor,
                       decode_kv_token_s=self.decode_kv_token_s * factor)

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**data)


# bench/pd_profile.py on this project's 2-core CPU machine (the built-in model, small_config's pools),
# with the KV budget of small_config (16 MiB) and the start-up of a pool replica measured by Serve.
BUILTIN_CPU_PROFILE = Profile(prefill_step_s=0.003059, prefill_token_s=0.000170491, decode_step_s=0.006406,
                              decode_seq_s=0.0005, decode_kv_token_s=6.273e-07, max_batched_tokens=512, max_num_seqs=8,
                              kv_tokens=12_288, handoff_s=0.02, start_s=8.0)


FIT_FIELDS = ("n", "b", "k", "bb", "bk", "kk", "y", "yb", "yk")


def fit_moments(step_s: float, seqs: int, kv_tokens: int) -> tuple[float, ...]:
    """One decode step's share of the least-squares sums for step_s = a + b * seqs + c * KV tokens
    (summed over steps, then over replicas, they are all the fit needs)."""
    b, k = float(seqs), float(kv_tokens)
    return (1.0, b, k, b * b, b * k, k * k, step_s, step_s * b, step_s * k)


@dataclass
class PoolObservation:
    """What one pool's replicas reported over the last interval (sums over its replicas)."""
    running: int = 0                    # replicas serving
    starting: int = 0                   # replicas starting (they count against the budget)
    arrived_tokens: int = 0             # uncached prompt tokens that arrived at the pool in the interval
    arrived_requests: int = 0
    queued_tokens: int = 0              # prompt tokens arrived and not yet computed (queued + in flight), now
    prefill_tokens: int = 0             # prompt tokens computed in the interval
    prefill_busy_s: float = 0.0         # step seconds spent computing them
    decode_fit: tuple[float, ...] = ()  # decode steps' moments (fit_moments), summed over the interval
    decoding: int = 0                   # sequences in a batch now
    decode_seqs: float = -1.0           # sequences in a batch on time average over the interval (-1: unknown)
    decode_kv_mean: float = -1.0        # KV tokens those held on time average (-1: unknown)
    decode_kv_tokens: int = 0           # KV tokens those hold
    waiting: int = 0                    # requests handed off (or prefilled) waiting for a batch slot
    handoff_wait_s: float = 0.0         # mean wait of a handoff in the interval


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float
    slo_itl_s: float
    interval_s: float = 10.0
    min_replicas: dict[str, int] = field(default_factory=dict)      # per pool (default 1)
    max_replicas: dict[str, int] = field(default_factory=dict)      # per pool (default 8)
    max_total_replicas: int = 16
    attainment: float = 0.9             # the share of requests sized to meet the TTFT target
    max_utilization: float = 0.95       # the busiest a replica is ever sized for
    down_strict: float = 0.25           # fewer replicas must miss only this share of that to scale down
    down_band: float = 0.85             # ... and a decode batch stay under this share of its largest
    itl_margin: float = 0.8             # a decode batch's fitted step stays within this share of the ITL target
    up_intervals: int = 2               # decisions in a row that must want one replica more for demand (not for
                                        # the queue, a jump in arrivals, or two or more at once: those act at once)
    down_intervals: int = 6             # decisions in a row that must agree before a scale-down
    down_intervals_fast: int = 2        # ... before a scale-down to half or fewer
    decode_growth: float = 2.0          # a decode pool grows to at most this many times its size (+1) a decision
    prior_tokens: float = 2048.0        # the profile's weight, in measured prompt tokens
    prior_steps: float = 32.0           # the profile's weight, in measured decode steps
    decay: float = 0.5                  # what an interval's measurements still weigh one interval later

    def bounds(self, pool: str) -> tuple[int, int]:
        return self.min_replicas.get(pool, 1), self.max_replicas.get(pool, 8)


@dataclass
class Decision:
    targets: dict[str, int]
    reasons: dict[str, str]
    needs: dict[str, float]             # the replicas the load needs, before hysteresis and budgets
    fitted: dict[str, float]            # what the planner believes now (tokens/s, decode coefficients)


class Planner:
    def __init__(self, config: PlannerConfig, profile: Profile, mode: str = "disaggregated"):
        if mode not in POOLS_BY_MODE:
            raise ValueError(f"planner: mode {mode!r} is not one of {sorted(POOLS_BY_MODE)}")
        if config.slo_ttft_s <= 0 or config.slo_itl_s <= 0:
            raise ValueError("planner: the TTFT and ITL targets must be positive")
        self.config, self.profile, self.mode = config, profile, mode
        self.pools = POOLS_BY_MODE[mode]
        # prefill: seconds per token, weighted
        self._pre_w, self._pre_s = config.prior_tokens, config.prior_tokens * profile.prefill_token_s
        # decode: ridge toward the profile, on decayed sufficient statistics
        self._theta0 = np.array([profile.decode_step_s, profile.decode_seq_s, profile.decode_kv_token_s])
        self._xtx, self._xty = np.zeros((3, 3)), np.zeros(3)
        self._rate: dict[str, float] = {}       # smoothed arrival rate (tokens/s) per pool
        self._jumped: dict[str, bool] = {}      # the last interval's arrivals were a burst
        self._waited = 0                        # decisions in a row whose handoffs waited past the TTFT target
        self._down: dict[str, deque[int]] = {p: deque(maxlen=config.down_intervals) for p in self.pools}
        self._up: dict[str, int] = {}            # decisions in a row that wanted one replica more

    # ---- what the planner has measured -----------------------------------------------------------
    def prefill_token_s(self) -> float:
        return self._pre_s / self._pre_w

    def decode_coefficients(self) -> np.ndarray:
        w = self.config.prior_steps
        # scale the ridge per coefficient by the typical size of its feature so the prior weighs like w steps
        scale = np.array([1.0, self.profile.max_num_seqs / 2, self.profile.max_num_seqs * 256.0]) ** 2
        a = self._xtx + w * np.diag(scale)
        b = self._xty + w * scale * self._theta0
        theta = np.linalg.solve(a, b)
        return np.maximum(theta, 0.0)

    def _learn(self, obs: dict[str, PoolObservation]) -> None:
        d = self.config.decay
        floor = self.config.prior_tokens * (1 - d)      # the profile keeps prior_tokens of weight at most
        self._pre_w = self._pre_w * d + floor
        self._pre_s = self._pre_s * d + floor * self.profile.prefill_token_s
        self._xtx *= d
        self._xty *= d
        for o in obs.values():
            if o.prefill_tokens > 0 and o.prefill_busy_s > 0:
                self._pre_w += o.prefill_tokens
                self._pre_s += o.prefill_busy_s
            if o.decode_fit:
                n, b, k, bb, bk, kk, y, yb, yk = o.decode_fit
                self._xtx += np.array([[n, b, k], [b, bb, bk], [k, bk, kk]])
                self._xty += np.array([y, yb, yk])

    # ---- what the load needs -------------------------------------------------------------------
    def _update_rates(self, obs: dict[str, PoolObservation], elapsed_s: float) -> None:
        for pool, o in obs.items():
            now = o.arrived_tokens / elapsed_s
            prev = self._rate.get(pool, now)
            # smoothed, but a jump is taken at once; a burst (BURST times the smoothed rate) is acted on at once
            self._jumped[pool] = now > BURST * prev
            self._rate[pool] = now if now > 1.5 * prev else 0.5 * prev + 0.5 * now

    def replicas_for(self, load: float, service_s: float, miss: float) -> int:
        """The fewest replicas that start all but `miss` of the requests within the TTFT target: `load`
        replicas' worth of work arriving at random, each request taking `service_s`, routed to the least
        loaded replica (an M/M/c queue: P(wait > T - S) = ErlangC(c, load) * exp(-(c - load)(T - S) / S)),
        and never busier than max_utilization."""
        slack = (self.config.slo_ttft_s - service_s) / max(service_s, 1e-6)
        n = max(1, math.ceil(load / self.config.max_utilization - 1e-9))
        if load <= 0:
            return n
        while n < 4096:
            b = 1.0                                         # Erlang B by recursion, then Erlang C
            for k in range(1, n + 1):
                b = load * b / (k + load * b)
            wait = n * b / (n - load * (1 - b)) if n > load else 1.0
            if slack > 0 and wait * math.exp(-(n - load) * slack) <= miss:
                return n
            if slack <= 0 and load / n <= 0.5:             # the target is below one prompt's own prefill
                return n
            n += 1
        return n

    def _prefill_need(self, pool: str, o: PoolObservation, strict: float) -> tuple[float, str]:
        token_s = self.prefill_token_s()
        rate = self._rate.get(pool, 0.0)
        per_request = o.arrived_tokens / o.arrived_requests if o.arrived_requests else self.profile.max_batched_tokens
        service = per_request * token_s + self.profile.prefill_step_s * math.ceil(
            per_request / self.profile.max_batched_tokens)
        demand = self.replicas_for(rate * token_s, service, (1.0 - self.config.attainment) * strict)
        # the queue gone within the target once replicas asked for now have started
        queue = (rate + o.queued_tokens / (self.config.slo_ttft_s + 2 * self.profile.start_s)) * token_s
        return max(demand, queue), ("up_queue" if queue > demand else "up_demand")

    def max_batch(self, context: float) -> tuple[int, str]:
        """The largest batch whose fitted step stays within itl_margin of the ITL target, with `context` KV
        tokens each (and within the replica's KV tokens and max_num_seqs)."""
        a, b, c = self.decode_coefficients()
        budget = self.config.itl_margin * self.config.slo_itl_s - a
        per_seq = b + c * context
        by_itl = int(budget / per_seq) if per_seq > 0 else self.profile.max_num_seqs
        by_kv = int(self.profile.kv_tokens / max(context, 1.0))
        batch = min(by_itl, by_kv, self.profile.max_num_seqs)
        reason = ("up_itl" if by_itl <= min(by_kv, self.profile.max_num_seqs) else
                  "up_kv" if by_kv <= self.profile.max_num_seqs else "up_slots")
        return max(batch, 1), reason

    def _decode_need(self, o: PoolObservation, strict: float) -> tuple[float, str]:
        # concurrency: the pool's sequences in a batch on time average over the interval (now, when not
        # reported), plus those handed off and waiting for a slot now once handoffs have waited as long as
        # a TTFT target two intervals running (a shorter wait is one long gap among a request's many: its
        # p90 gap hardly moves; one such interval is a passing surge more often than a lasting one)
        seqs = o.decode_seqs if o.decode_seqs >= 0 else o.decoding
        self._waited = self._waited + 1 if o.handoff_wait_s > self.config.slo_ttft_s else 0
        if o.decode_seqs > 0 and o.decode_kv_mean >= 0:
            context = o.decode_kv_mean / o.decode_seqs
        elif o.decoding:
            context = o.decode_kv_tokens / o.decoding
        else:
            context = o.arrived_tokens / o.arrived_requests if o.arrived_requests else 1024.0
        batch, reason = self.max_batch(context)
        if self._waited >= 2 and o.waiting:
            seqs += o.waiting
            reason = "up_handoff_wait"
        return seqs / (batch * self.config.max_utilization * (1.0 if strict == 1.0 else self.config.down_band)), reason

    def needs(self, obs: dict[str, PoolObservation], strict: float = 1.0) -> dict[str, tuple[float, str]]:
        """Replicas each pool needs and why; `strict` < 1 sizes for that share of the misses (and decode for
        down_band of the batch): what fewer replicas must manage before a scale-down."""
        if self.mode == "colocated":
            o = obs["colocated"]
            pre, pre_reason = self._prefill_need("colocated", o, strict)
            dec, dec_reason = self._decode_need(o, strict)
            return {"colocated": (pre + dec, pre_reason if pre >= dec else dec_reason)}
        p, d = obs["prefill"], obs["decode"]
        return {"prefill": self._prefill_need("prefill", p, strict), "decode": self._decode_need(d, strict)}

    # ---- one decision ----------------------------------------------------------------------------
    def decide(self, obs: dict[str, PoolObservation], elapsed_s: float | None = None) -> Decision:
        """One decision on what the pools reported over the last `elapsed_s` (default interval_s)."""
        missing = [p for p in self.pools if p not in obs]
        if missing:
            raise ValueError(f"planner: no observation for pool(s) {missing}")
        self._learn(obs)
        self._update_rates(obs, elapsed_s or self.config.interval_s)
        up = self.needs(obs)
        down = self.needs(obs, self.config.down_strict)
        targets, reasons, needs = {}, {}, {}
        burst = self._jumped.get(self.pools[0], False)     # in the arrivals at the first pool
        for pool in self.pools:
            o = obs[pool]
            current = o.running + o.starting
            lo, hi = self.config.bounds(pool)
            need_up, reason = up[pool]
            want = math.ceil(need_up - 1e-9)
            needs[pool] = need_up
            small = want == current + 1 and reason != "up_queue" and not burst
            if want > current and small and self._up.get(pool, 0) + 1 < self.config.up_intervals:
                # one replica more for demand alone, with no jump in the arrivals: only once `up_intervals`
                # decisions in a row want it
                self._up[pool] = self._up.get(pool, 0) + 1
                self._down[pool].clear()
                target, reason = current, "hold_cooldown"
            elif want > current:
                self._up[pool] = 0
                self._down[pool].clear()
                target = want
                if pool == "decode":    # its waiting handoffs overstate a flood that new replicas arrive after
                    target = min(target, int(current * self.config.decode_growth) + 1)
            else:
                self._up[pool] = 0
                # the count fewer replicas would need at the lower utilization (never below the queue's)
                want_down = max(math.ceil(down[pool][0] - 1e-9), want, lo)
                self._down[pool].append(want_down)
                window = list(self._down[pool])
                # a small cut waits down_intervals agreeing decisions, a cut to half or less (after a burst)
                # down_intervals_fast of them
                fast = window[-self.config.down_intervals_fast:]
                if want_down < current and len(window) == self.config.down_intervals and max(window) < current:
                    target, reason = max(window), "down_idle"
                    self._down[pool].clear()
                elif len(fast) == self.config.down_intervals_fast and 2 * max(fast) <= current:
                    target, reason = max(fast), "down_idle"
                    self._down[pool].clear()
                else:
                    target, reason = current, ("hold_cooldown" if want_down < current else "hold")
            if target < lo:
                target, reason = lo, "min_replicas"
            elif target > hi:
                target, reason = hi, "budget_pool"
            targets[pool], reasons[pool] = target, reason
        over = sum(targets.values()) - self.config.max_total_replicas
        while over > 0:
            # take from the pool with the most replicas above its need (ties: the larger pool)
            pool = max(self.pools, key=lambda p: (targets[p] - needs[p], targets[p]))
            if targets[pool] <= self.config.bounds(pool)[0]:
                break
            targets[pool] -= 1
            reasons[pool] = "budget_total"
            over -= 1
        a, b, c = self.decode_coefficients()
        fitted = {"prefill_tokens_per_s": 1.0 / self.prefill_token_s(), "decode_step_s": float(a),
                  "decode_seq_s": float(b), "decode_kv_token_s": float(c)}
        return Decision(targets, reasons, needs, fitted)
