"""The P/D planner's decisions, its online fit, the P/D simulation and `kvmesh simulate --pd` (issue 46
items 2-3): states and counts, no timing."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.cluster.cli import main
from kvmesh.cluster.serve.pd_sim import (
    PlannerPolicy,
    SimRequest,
    Simulation,
    StaticPolicy,
    overlaid,
    simulate,
)
from kvmesh.cluster.serve.planner import (
    BUILTIN_CPU_PROFILE,
    REASONS,
    Planner,
    PlannerConfig,
    PoolObservation,
    Profile,
    fit_moments,
)
from kvmesh.kvstore.policy.trace import load_trace

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_excerpt.jsonl"
PROF = replace(BUILTIN_CPU_PROFILE, start_s=5.0)


def obs(running=1, **kw) -> PoolObservation:
    return PoolObservation(running=running, **kw)


def steady(planner: Planner, prefill: PoolObservation, decode: PoolObservation, n: int):
    return [planner.decide({"prefill": prefill, "decode": decode}) for _ in range(n)]


def test_a_queue_scales_prefill_up_at_once_and_decode_stays():
    p = Planner(PlannerConfig(2.0, 0.2), PROF)
    tps = 1 / PROF.prefill_token_s
    d = p.decide({"prefill": obs(queued_tokens=int(tps * 40), arrived_tokens=int(tps * 10), arrived_requests=20),
                  "decode": obs(decode_seqs=2.0, decoding=2, decode_kv_tokens=800)})
    assert d.targets["prefill"] > 1 and d.reasons["prefill"] == "up_queue"
    assert d.targets["decode"] == 1 and d.reasons["decode"] in ("hold", "hold_cooldown")


def test_scale_down_waits_for_agreeing_decisions_and_says_why():
    cfg = PlannerConfig(2.0, 0.2, down_intervals=3, down_intervals_fast=2)
    p = Planner(cfg, PROF)
    idle_p = obs(running=3, arrived_tokens=2000, arrived_requests=4)
    idle_d = obs(running=2, decode_seqs=1.0, decoding=1, decode_kv_tokens=300)
    ds = steady(p, idle_p, idle_d, 3)
    # three replicas for a trickle: a cut to half or fewer after two decisions, the first one holds
    assert [d.reasons["prefill"] for d in ds[:2]] == ["hold_cooldown", "down_idle"]
    assert ds[1].targets["prefill"] == 1
    # decode 2 -> 1 is a cut to half: also fast
    assert ds[1].targets["decode"] == 1
    # a small cut (4 -> 3) needs all down_intervals decisions to agree
    p = Planner(cfg, PROF)
    tps = 1 / PROF.prefill_token_s
    busy = obs(running=4, arrived_tokens=int(tps * 10 * 2.2), arrived_requests=400)
    ds = steady(p, busy, idle_d, 3)
    assert [d.reasons["prefill"] for d in ds] == ["hold_cooldown", "hold_cooldown", "down_idle"]
    assert ds[-1].targets["prefill"] == 3


def test_budgets_bound_the_pools_and_total():
    cfg = PlannerConfig(2.0, 0.2, max_replicas={"prefill": 5, "decode": 8}, max_total_replicas=6)
    p = Planner(cfg, PROF)
    tps = 1 / PROF.prefill_token_s
    d = p.decide({"prefill": obs(queued_tokens=int(tps * 500), arrived_tokens=int(tps * 100), arrived_requests=50),
                  "decode": obs(decode_seqs=30.0, decoding=8, decode_kv_tokens=8 * 300, waiting=20,
                                handoff_wait_s=5.0)})
    assert d.targets["prefill"] <= 5 and sum(d.targets.values()) == 6
    assert "budget_total" in d.reasons.values()
    d = Planner(PlannerConfig(2.0, 0.2, min_replicas={"prefill": 2}), PROF).decide(
        {"prefill": obs(), "decode": obs()})
    assert d.targets["prefill"] == 2 and d.reasons["prefill"] == "min_replicas"


def test_replicas_for_grows_with_load_and_with_a_tighter_target():
    p = Planner(PlannerConfig(2.0, 0.2), PROF)
    ns = [p.replicas_for(load, 0.1, 0.1) for load in (0.5, 1.5, 3.0, 6.0)]
    assert ns == sorted(ns) and ns[0] == 1 and ns[-1] >= 7
    tight = Planner(PlannerConfig(0.15, 0.2), PROF)
    assert tight.replicas_for(3.0, 0.1, 0.1) > p.replicas_for(3.0, 0.1, 0.1)
    assert p.replicas_for(3.0, 0.1, 0.01) >= p.replicas_for(3.0, 0.1, 0.1)


def test_the_fit_leaves_a_wrong_profile_for_what_replicas_measure():
    truth = PROF
    p = Planner(PlannerConfig(2.0, 0.2), truth.scaled(0.5))      # the profile says twice as fast
    fit = [0.0] * 9
    for b in (1, 2, 4, 8):
        for k in (100, 500, 1000):
            fit = [x + 5 * y for x, y in zip(fit, fit_moments(truth.decode_s(b, b * k), b, b * k))]
    tokens = 50_000
    for _ in range(2):
        p.decide({"prefill": obs(prefill_tokens=tokens, prefill_busy_s=tokens * truth.prefill_token_s),
                  "decode": obs(decode_fit=tuple(fit))})
    assert p.prefill_token_s() == pytest.approx(truth.prefill_token_s, rel=0.1)
    a, b, c = p.decode_coefficients()
    assert a + 4 * b + 2000 * c == pytest.approx(truth.decode_s(4, 2000), rel=0.1)


def test_bad_planner_and_profile_settings_are_named():
    with pytest.raises(ValueError, match="mode 'nope'"):
        Planner(PlannerConfig(2.0, 0.2), PROF, "nope")
    with pytest.raises(ValueError, match="must be positive"):
        Planner(PlannerConfig(0.0, 0.2), PROF)
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        Profile.from_json({**PROF.__dict__, "bogus": 1})
    with pytest.raises(ValueError, match="no observation"):
        Planner(PlannerConfig(2.0, 0.2), PROF).decide({"prefill": obs()})


# ---- the simulation ----------------------------------------------------------------------------------
def test_one_request_takes_exactly_its_profiled_steps():
    prof = replace(PROF, handoff_s=0.5)
    req = SimRequest(1.0, 1200, (1, 2, 3), 4, 400)
    res = simulate([req], prof, StaticPolicy({"prefill": 1, "decode": 1}), "disaggregated",
                   initial={"prefill": 1, "decode": 1})
    (r,) = res.requests
    assert r.ttft == pytest.approx(2 * prof.prefill_s(512) + prof.prefill_s(176))
    # three decode steps after the handoff; its first gap waits for the handoff
    steps = [prof.decode_s(1, 1200 + i) for i in range(3)]
    assert r.end_t == pytest.approx(r.first_t + 0.5 + sum(steps))
    assert r.itl == pytest.approx(0.5 + steps[0])
    assert res.replica_s == pytest.approx(2 * (r.end_t - 1.0))


def test_a_repeated_prefix_is_a_hit_and_colocated_serves_both_phases():
    a = SimRequest(0.0, 400, (7, 8), 3, 200)
    b = SimRequest(5.0, 600, (7, 8, 9), 3, 200)
    res = simulate([a, b], PROF, StaticPolicy({"colocated": 1}), "colocated", initial={"colocated": 1})
    first, second = sorted(res.requests, key=lambda r: r.arrival)
    assert first.uncached == 400 and second.uncached == 200
    assert second.ttft == pytest.approx(PROF.prefill_s(200))


class Shrink:
    """Three prefill and three decode replicas, cut to one of each at the second decision."""
    name, interval_s = "shrink", 1.0

    def __init__(self):
        self.calls = 0

    def decide(self, sim):
        sim.observe()
        self.calls += 1
        sizes = {"prefill": 3, "decode": 3} if self.calls == 1 else {"prefill": 1, "decode": 1}
        sim.timeline.append((sim.now, sizes, {}))
        return sizes


def test_a_scale_down_drains_every_request_it_held():
    reqs = [SimRequest(0.01 * i, 900, (i,), 20, 300) for i in range(60)]
    sim = Simulation(reqs, PROF, Shrink(), "disaggregated", initial={"prefill": 3, "decode": 3})
    res = sim.run()
    assert len(res.requests) == 60 and all(r.end_t > 0 and r.first_t > 0 for r in res.requests)
    gone = [r for rs in sim.replicas.values() for r in rs if r.state == "gone"]
    assert len(gone) == 4 and all(r.empty() for r in gone)


def test_the_planner_in_the_simulation_grows_with_a_burst():
    trace = [r._replace(t=r.t / 30) for r in load_trace(EXCERPT, 32)]     # 300 requests in 108 s
    reqs = overlaid(trace, 32, 32, 2, 100.0, (40.0, 30.0, 20))
    policy = PlannerPolicy(Planner(PlannerConfig(2.0, 0.2, interval_s=5.0), PROF))
    res = simulate(reqs, PROF, policy, "disaggregated", {"prefill": 1, "decode": 1})
    assert len(res.requests) == len(reqs)
    before = max(t["prefill"] for when, t, _ in res.timeline if when < 40)
    after = [(when, t["prefill"]) for when, t, _ in res.timeline if when >= 40]
    assert next(when for when, n in after if n > before) <= 40 + 2 * 5.0
    assert {r for _, _, rs in res.timeline for r in rs.values()} <= set(REASONS)


def test_simulate_pd_cli_prints_every_policy_per_load(capsys):
    assert main(["simulate", "--pd", "--trace", str(EXCERPT), "--loads", "1,2", "--duration-s", "60",
                 "--warmup-s", "10", "--steady-s", "120", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["load"] for r in out["loads"]] == ["x1", "x2", "burst x1->x10"]
    for row in out["loads"]:
        for name in ("planner", "ray_default", "dynamo", "best_static"):
            assert {"goodput_per_replica_s", "attainment"} <= set(row[name])
    assert out["optimistic_profile"]["factor"] == 0.5 and "steady_turns_per_hour" in out
    assert main(["simulate", "--pd", "--trace", str(EXCERPT), "--loads", "1", "--duration-s", "40",
                 "--warmup-s", "5", "--steady-s", "60", "--mode", "colocated"]) == 0
    assert "dynamo" not in capsys.readouterr().out


def test_simulate_pd_cli_bad_arguments(capsys, tmp_path):
    assert main(["simulate", "--pd", "--trace", str(EXCERPT), "--config", "V4-Pro"]) == 2
    assert "--profile" in capsys.readouterr().err
    assert main(["simulate", "--pd", "--trace", str(EXCERPT), "--loads", "0"]) == 2
    bad = tmp_path / "fit.json"
    bad.write_text('{"prefill_token_s": 1e-4, "nope": 1}')
    assert main(["simulate", "--pd", "--trace", str(EXCERPT), "--profile", str(bad)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(EXCERPT)]) == 2
    assert "--config is required" in capsys.readouterr().err


# ---- the Ray Serve application policy ------------------------------------------------------------------
def contexts(reports: dict[str, dict[str, dict]], running: dict[str, int], target: dict[str, int]) -> dict:
    """AutoscalingContexts as Serve's controller builds them: {deployment: {replica: its latest report}}."""
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingContext
    out = {}
    for name, replicas in reports.items():
        dep = DeploymentID(name, "app")
        ids = {r: ReplicaID(r, dep) for r in replicas}
        raw: dict = {}
        for r, report in replicas.items():
            for metric, value in report.items():
                raw.setdefault(metric, {})[ids[r]] = [TimeStampedValue(0.0, float(value))]
        out[dep] = AutoscalingContext(
            deployment_id=dep, deployment_name=name, app_name="app", current_num_replicas=running[name],
            target_num_replicas=target[name], running_replicas=list(ids.values()), total_num_requests=0.0,
            total_queued_requests=0.0, aggregated_metrics={}, raw_metrics=raw, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=4, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=None, config=None)
    return out


def test_the_serve_policy_decides_each_interval_from_replica_sums(monkeypatch):
    from kvmesh.cluster.serve import autoscale
    clock = [100.0]
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: clock[0])
    published = []
    monkeypatch.setattr(autoscale.PoolPlanner, "_publish", lambda self, d, o: published.append(self.snapshot(d, o)))
    policy = autoscale.PoolPlanner("app", "disaggregated", False, 2.0, 0.2, 10.0, 8, {"prefill": 1, "decode": 1},
                                   {"prefill": 4, "decode": 4}, PROF.__dict__)
    tps = 1 / PROF.prefill_token_s
    quiet = {"Prefill": {"p1": {"prompt_tokens": 0}}, "Decode": {"d1": {"prompt_tokens": 0}}}
    ones = {"Prefill": 1, "Decode": 1}
    out, _ = policy(contexts(quiet, ones, ones))
    assert sorted(out.values()) == [1, 1] and not published        # the first call only remembers the sums
    clock[0] += 10
    busy = {"Prefill": {"p1": {"prompt_tokens": tps * 30, "arrived_requests": 100, "queued_prompt_tokens": tps * 20,
                               "prefill_tokens": tps * 9, "prefill_step_s": 9.0}},
            "Decode": {"d1": {"prompt_tokens": 0}}}
    out, _ = policy(contexts(busy, ones, ones))
    by_name = {dep.name: n for dep, n in out.items()}
    assert by_name["Prefill"] == 4 and by_name["Decode"] == 1
    assert published[-1]["reasons"]["prefill"] in ({"up_queue": 1}, {"up_demand": 1}, {"budget_pool": 1})
    clock[0] += 3               # within the interval: the targets it set, no decision
    out, _ = policy(contexts(busy, ones, {"Prefill": 4, "Decode": 1}))
    assert {dep.name: n for dep, n in out.items()} == by_name and len(published) == 1
    # a replica restarted (its sums start again from 0) counts from 0, not as a negative change
    clock[0] += 10
    again = {"Prefill": {"p1": {"prompt_tokens": 10.0, "arrived_requests": 1}}, "Decode": {"d1": {"prompt_tokens": 0}}}
    policy(contexts(again, {"Prefill": 4, "Decode": 1}, {"Prefill": 4, "Decode": 1}))
    assert published[-1]["running"] == {"prefill": 4, "decode": 1}


def test_the_serve_policy_in_dry_run_keeps_serves_targets(monkeypatch):
    from kvmesh.cluster.serve import autoscale
    clock = [0.0]
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: clock[0])
    published = []
    monkeypatch.setattr(autoscale.PoolPlanner, "_publish", lambda self, d, o: published.append(self.snapshot(d, o)))
    policy = autoscale.PoolPlanner("app", "colocated", True, 2.0, 0.2, 1.0, 8, {"colocated": 1}, {"colocated": 3},
                                   PROF.__dict__)
    tps = 1 / PROF.prefill_token_s
    policy(contexts({"Colocated": {"c": {}}}, {"Colocated": 1}, {"Colocated": 1}))
    clock[0] += 1
    out, _ = policy(contexts({"Colocated": {"c": {"prompt_tokens": tps * 10, "queued_prompt_tokens": tps * 10,
                                                  "arrived_requests": 50}}}, {"Colocated": 1}, {"Colocated": 1}))
    assert list(out.values()) == [1]
    assert published[-1]["dry_run"] and published[-1]["targets"] == {"colocated": 3}


def test_a_planner_config_needs_autoscaling_bounds_and_known_profile_keys():
    from pydantic import ValidationError

    from kvmesh.cluster.config import ServeConfig
    with pytest.raises(ValidationError, match="set prefill.autoscaling, decode.autoscaling"):
        ServeConfig.model_validate({"planner": {"policy": "planner"}})
    from kvmesh.cluster.serve.autoscale import policy_spec, profile_of
    with pytest.raises(ValueError, match="planner.profile: unknown keys \\['bogus'\\]"):
        profile_of(ServeConfig.model_validate({"planner": {"profile": {"bogus": 1.0}}}))
    ok = ServeConfig.model_validate({"mode": "colocated", "planner": {"policy": "dry-run"},
                                     "colocated": {"autoscaling": {"min_replicas": 1, "max_replicas": 3}}})
    spec = policy_spec(ok, "kvmesh")
    assert spec["policy_kwargs"]["dry_run"] and spec["policy_kwargs"]["max_replicas"] == {"colocated": 3}


def test_the_engine_counts_what_the_planner_reads():
    from kvmesh.workers.checkpoint.default_model import ensure_default_model
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.engine_config import EngineConfig
    from kvmesh.workers.sampling.params import SamplingParams
    e = Engine(EngineConfig(model=str(ensure_default_model()), max_batched_tokens=256, max_num_seqs=4,
                            kv_cache_bytes=32 << 20, store=None, speculative_tokens=0))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i, n in enumerate((300, 40, 90)):
        e.add_request(f"r{i}", [3 + (i * 31 + j) % 900 for j in range(n)], params)
    assert e.stats().queued_prompt_tokens == 430 and e.stats().planner.arrived_requests == 3
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
    c = e.stats().planner
    assert c.prefill_tokens == 430 and e.stats().queued_prompt_tokens == 0
    assert 0 < c.fit_n < steps and c.prefill_step_s > 0 and c.fit_y > 0
    # every decode-only step had one to three sequences, each holding its prompt and what it generated
    assert c.fit_n <= c.fit_b <= 3 * c.fit_n and c.fit_k > 40 * c.fit_n


def test_one_replica_more_for_demand_waits_for_a_second_decision_and_a_jump_does_not():
    tps = 1 / PROF.prefill_token_s
    p = Planner(PlannerConfig(2.0, 0.2), PROF)
    more = obs(running=2, arrived_tokens=int(tps * 10 * 2.2), arrived_requests=400)     # needs 3 replicas
    decode = obs(decode_seqs=1.0, decoding=1, decode_kv_tokens=300)
    first, second = steady(p, more, decode, 2)
    assert (first.targets["prefill"], first.reasons["prefill"]) == (2, "hold_cooldown")
    assert second.targets["prefill"] == 3 and second.reasons["prefill"] == "up_demand"
    # a jump of several replicas (a burst) is taken at once
    p = Planner(PlannerConfig(2.0, 0.2), PROF)
    jump = obs(running=1, arrived_tokens=int(tps * 10 * 3), arrived_requests=400)
    d = p.decide({"prefill": jump, "decode": decode})
    assert d.targets["prefill"] >= 3 and d.reasons["prefill"] == "up_demand"
