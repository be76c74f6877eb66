"""The P/D planner as Ray Serve's application-level autoscaling policy (issue 46 item 2).

`planner.policy: planner` (or `dry-run`) deploys the app with

    autoscaling_policy: {policy_function: "kvmesh.cluster.serve.autoscale:PoolPlanner", policy_kwargs: {...}}

Serve's controller builds one `PoolPlanner` and calls it on every control-loop tick with one
AutoscalingContext per pool deployment. Each pool replica pushes `record_autoscaling_stats`
(cluster/serve/pools.py): the engine's `PlannerCounters` (monotonic sums) and its gauges. Every
`interval_s` the policy turns the change of each replica's latest sums since the last decision into one
`PoolObservation` per pool, asks `Planner.decide`, logs the decision with its reasons, publishes it in
Ray's internal KV (`planner_key(app)`: the ingress exports it on /metrics as
`kvmesh_planner_decisions_total{pool,reason}` and `kvmesh_planner_target_replicas{pool}`) and returns the
targets; between decisions it keeps the targets it set. `dry-run` returns Serve's current targets, so
nothing moves. A scale-down is Serve's graceful one: a replica leaves the routing first, then finishes
what it holds (the prefill pool also waits for its held handoffs: pools.Prefill.__del__).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from .planner import BUILTIN_CPU_PROFILE, FIT_FIELDS, POOLS_BY_MODE, Planner, PlannerConfig, PoolObservation, Profile

log = logging.getLogger("ray.serve")

DEPLOYMENT_POOLS = {"Prefill": "prefill", "Decode": "decode", "Colocated": "colocated"}
COUNTERS = ("prompt_tokens", "cached_tokens", "arrived_requests", "prefill_tokens", "prefill_step_s", "decode_seq_s",
            "decode_kv_s", "queue_time_sum", "queue_time_count") + tuple("fit_" + f for f in FIT_FIELDS)
GAUGES = ("queued_prompt_tokens", "running", "waiting")


def planner_key(app: str) -> str:
    return f"kvmesh:planner:{app}"


def profile_of(config) -> Profile:
    """The planner's start-up profile: the built-in model's, updated by `planner.profile` (ValueError
    naming an unknown key)."""
    try:
        return Profile.from_json({**BUILTIN_CPU_PROFILE.__dict__, **(config.planner.profile or {})})
    except ValueError as e:
        raise ValueError(f"planner.{e}") from None


def policy_spec(config, app: str) -> dict:
    """The application's `autoscaling_policy` for a ServeConfig whose planner.policy is not "ray"."""
    pools = POOLS_BY_MODE[config.mode]
    p = config.planner
    return {"policy_function": "kvmesh.cluster.serve.autoscale:PoolPlanner", "policy_kwargs": {
        "app": app, "mode": config.mode, "dry_run": p.policy == "dry-run", "slo_ttft_s": p.slo_ttft_ms / 1e3,
        "slo_itl_s": p.slo_itl_ms / 1e3, "interval_s": p.interval_s, "max_total_replicas": p.max_total_replicas,
        "min_replicas": {q: getattr(config, q).autoscaling.min_replicas for q in pools},
        "max_replicas": {q: getattr(config, q).autoscaling.max_replicas for q in pools},
        "profile": profile_of(config).__dict__}}


class PoolPlanner:
    """Class-callable application policy: Serve builds it once with `policy_kwargs` (JSON)."""

    def __init__(self, app: str, mode: str, dry_run: bool, slo_ttft_s: float, slo_itl_s: float, interval_s: float,
                 max_total_replicas: int, min_replicas: dict, max_replicas: dict, profile: dict):
        cfg = PlannerConfig(slo_ttft_s, slo_itl_s, interval_s=interval_s, min_replicas=min_replicas,
                            max_replicas=max_replicas, max_total_replicas=max_total_replicas)
        self.app, self.dry_run = app, dry_run
        self.planner = Planner(cfg, Profile.from_json(profile), mode)
        self.last: float | None = None
        self.seen: dict[tuple[str, str], dict[str, float]] = {}     # (pool, replica) -> its sums at the last decision
        self.targets: dict[str, int] = {}
        self.counts: dict[str, dict[str, int]] = {}                 # pool -> reason -> decisions
        self.decisions = 0

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        pools = {DEPLOYMENT_POOLS[ctx.deployment_name]: (dep, ctx) for dep, ctx in contexts.items()
                 if ctx.deployment_name in DEPLOYMENT_POOLS}
        now = time.monotonic()
        if self.last is None:           # the first call: remember every replica's sums, decide from the next
            self.last = now
            self._observe(pools, 1.0)
            return {dep: ctx.target_num_replicas for dep, ctx in pools.values()}, {}
        if now - self.last < self.planner.config.interval_s or set(pools) != set(self.planner.pools):
            return {dep: self.targets.get(pool, ctx.target_num_replicas) if not self.dry_run
                    else ctx.target_num_replicas for pool, (dep, ctx) in pools.items()}, {}
        elapsed, self.last = now - self.last, now
        try:
            obs = self._observe(pools, elapsed)
            decision = self.planner.decide(obs, elapsed)
        except Exception:       # a bad report never takes the app's scaling down: keep what is set
            log.exception("kvmesh planner: no decision this interval")
            return {dep: ctx.target_num_replicas for dep, ctx in pools.values()}, {}
        self.decisions += 1
        for pool, reason in decision.reasons.items():
            self.counts.setdefault(pool, {}).setdefault(reason, 0)
            self.counts[pool][reason] += 1
        self.targets = dict(decision.targets)
        log.info("kvmesh planner%s: %s", " (dry-run)" if self.dry_run else "", ", ".join(
            f"{pool} {obs[pool].running}+{obs[pool].starting} -> {decision.targets[pool]} ({decision.reasons[pool]}, "
            f"needs {decision.needs[pool]:.2f})" for pool in self.planner.pools))
        self._publish(decision, obs)
        if self.dry_run:
            return {dep: ctx.target_num_replicas for dep, ctx in pools.values()}, {}
        return {dep: decision.targets[pool] for pool, (dep, ctx) in pools.items()}, {}

    def _observe(self, pools: dict, elapsed: float) -> dict[str, PoolObservation]:
        out = {}
        for pool, (_, ctx) in pools.items():
            raw = ctx.raw_metrics or {}
            delta = dict.fromkeys(COUNTERS, 0.0)
            gauges = dict.fromkeys(GAUGES, 0.0)
            replicas = set()
            for rid in ctx.running_replicas:
                key = (pool, getattr(rid, "unique_id", str(rid)))
                latest = {name: series[rid][-1].value for name, series in raw.items()
                          if rid in series and series[rid]}
                if not latest:
                    continue
                replicas.add(key)
                before = self.seen.get(key, {})
                for name in COUNTERS:
                    now_v, was = latest.get(name, 0.0), before.get(name, 0.0)
                    delta[name] += now_v - was if now_v >= was else now_v      # a restarted replica starts at 0
                for name in GAUGES:
                    gauges[name] += latest.get(name, 0.0)
                self.seen[key] = latest
            for key in [k for k in self.seen if k[0] == pool and k not in replicas]:
                del self.seen[key]
            waits = delta["queue_time_count"]
            out[pool] = PoolObservation(
                running=ctx.current_num_replicas, starting=max(0, ctx.target_num_replicas - ctx.current_num_replicas),
                arrived_tokens=int(max(0.0, delta["prompt_tokens"] - delta["cached_tokens"])),
                arrived_requests=int(delta["arrived_requests"]), queued_tokens=int(gauges["queued_prompt_tokens"]),
                prefill_tokens=int(delta["prefill_tokens"]), prefill_busy_s=delta["prefill_step_s"],
                decode_fit=tuple(delta["fit_" + f] for f in FIT_FIELDS), decoding=int(gauges["running"]),
                decode_seqs=delta["decode_seq_s"] / elapsed, decode_kv_mean=delta["decode_kv_s"] / elapsed,
                waiting=int(gauges["waiting"]),
                handoff_wait_s=delta["queue_time_sum"] / waits if waits else 0.0)
        return out

    def _publish(self, decision, obs) -> None:
        try:
            from ray.experimental.internal_kv import _internal_kv_put
            _internal_kv_put(planner_key(self.app), json.dumps(self.snapshot(decision, obs)).encode(), overwrite=True)
        except Exception:
            log.exception("kvmesh planner: could not publish its decision")

    def snapshot(self, decision, obs) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "decisions": self.decisions, "reasons": self.counts,
                "targets": decision.targets, "needs": decision.needs, "fitted": decision.fitted,
                "running": {p: o.running for p, o in obs.items()}, "at": time.time()}
