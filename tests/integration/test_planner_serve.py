"""The P/D planner sizing a running deployment (issue 46 items 2 and 4), over HTTP, on the session's
Ray + Serve: a disaggregated and a colocated app deployed through Serve's config path with the
application-level policy (cluster/serve/autoscale.py), decisions every second, each pool 1..2 replicas.

* `planner`: a burst of long prompts makes it add a prefill replica (reason in /metrics); every
  request of the burst succeeds; once the burst is over it scales the prefill pool back down by
  draining (a Serve graceful stop): no request failed and no prefill replica holds a cache after.
* `dry-run`: the same burst is decided on and counted in /metrics, and no replica count moves.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.chaos_cluster import scrape
from tests.local_serve import small_config

pytestmark = pytest.mark.slow     # two Serve apps

BOUNDS = {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}
PLANNER = {"interval_s": 1.0, "slo_ttft_ms": 300.0, "slo_itl_ms": 200.0}
BURST = 48


@pytest.fixture(scope="module")
def urls(local_serve):
    apps = {"planned": (small_config("disaggregated", planner={**PLANNER, "policy": "planner"}, prefill=BOUNDS,
                                     decode=BOUNDS), "/planned"),
            "dry": (small_config("colocated", planner={**PLANNER, "policy": "dry-run"}, colocated=BOUNDS), "/dry")}
    return local_serve.deploy_many(apps)


def burst(url: str, n: int = BURST) -> list[int]:
    """n requests at once, each a long prompt of its own (no prefix shared); their status codes."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:
            async def one(i):
                prompt = [3 + (i * 7 + j) % 1500 for j in range(600)]
                r = await c.post(f"{url}/v1/completions",
                                 json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
                return r.status_code
            return await asyncio.gather(*[one(i) for i in range(n)])
    return asyncio.run(run())


def replicas(m: dict, pool: str, state: str = "RUNNING") -> float:
    return m.get(("kvmesh_pool_replicas", (("pool", pool), ("state", state))), 0.0)


def decisions(m: dict, pool: str) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in m.items()
            if name == "kvmesh_planner_decisions_total" and dict(labels)["pool"] == pool}


def wait_for(check, within_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s:g} s")
        time.sleep(every_s)


def test_a_burst_adds_a_prefill_replica_and_the_drain_after_it_fails_nothing(urls):
    url = urls["planned"]
    assert replicas(scrape(url), "prefill") == 1
    assert burst(url) == [200] * BURST
    m = scrape(url)
    up = {r: n for r, n in decisions(m, "prefill").items() if r.startswith("up_") or r == "budget_pool"}
    assert up, decisions(m, "prefill")
    # the replica it asked for starts, then (the burst over) the pool drains back to one
    wait_for(lambda: replicas(scrape(url), "prefill") + replicas(scrape(url), "prefill", "STARTING") >= 2, 30,
             "a second prefill replica")
    m = wait_for(lambda: (lambda m: m if decisions(m, "prefill").get("down_idle") and replicas(m, "prefill") == 1
                          and not replicas(m, "prefill", "STOPPING") else None)(scrape(url)), 90,
                 "the prefill pool drained back to one replica")
    held = [v for (name, labels), v in m.items() if name == "kvmesh_worker_held" and dict(labels)["pool"] == "prefill"]
    assert held and sum(held) == 0
    assert m[("kvmesh_planner_dry_run", ())] == 0
    # every request of the burst and after it succeeded; a request after the drain still does
    assert burst(url, 4) == [200] * 4


def test_dry_run_decides_and_moves_nothing(urls):
    url = urls["dry"]

    def decided_up(m: dict) -> bool:      # an up decision counted, and it is the one in force now
        made = decisions(m, "colocated")
        return bool(made.get("budget_pool") or any(r.startswith("up_") for r in made)) and m.get(("kvmesh_planner_target_replicas", (("pool", "colocated"),))) == 2

    # the target is the latest decision's: once the burst is over the next one is back to 1, so
    # the metrics are read while the burst runs (and a little after)
    with ThreadPoolExecutor(1) as ex:
        codes = ex.submit(burst, url, BURST // 2)
        seen = wait_for(lambda: (lambda m: m if decided_up(m) else None)(scrape(url)), 60,
                        "a dry-run scale-up decision in force", every_s=0.2)
        assert codes.result() == [200] * (BURST // 2)
    assert seen[("kvmesh_planner_dry_run", ())] == 1
    time.sleep(2)
    m = scrape(url)
    assert replicas(m, "colocated") == 1 and not replicas(m, "colocated", "STARTING")
