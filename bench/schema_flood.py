"""A flood of slow schemas over HTTP (issue 48 items 1 and 7): one client sends many distinct
slow JSON schemas at once while another sends plain and small guided requests.

    python bench/schema_flood.py [--slow 40] [--slow-properties 600] [--budget-s 3]
                                 [--probe-every 0.5] [--num-cpus 8] [--out FILE]

One local Ray + Serve runs the disaggregated app with two API keys (the tiny default model, the
engine's default settings but `grammar_compile_timeout_s` = --budget-s, pools of
tests/local_serve.SMALL_POOL: prefill `max_ongoing_requests` 16 as in the issue). After a
warm-up:

1. idle: five plain completions and five small guided ones (each schema new: it compiles) from
   the probe's key, one after another; their latency.
2. flood: the attacker's key POSTs --slow completions at once, each guided by its own schema of
   --slow-properties required string properties (past the budget: each ends in a 400 once its
   compile is stopped, or a 429 when its client has too many waiting). Meanwhile, every
   --probe-every seconds, the probe's key sends a plain completion and a small guided one (a new
   schema each), until the flood's last answer.

Printed: the probes' latency during the flood (median, max) beside idle, their statuses, the
flood's statuses, and how long until its last answer; the load average beside them. Runs on an
older checkout too (copy this file and tests/local_serve.py's needs there); before issue 48 item 1
a request waiting for its grammar held one of prefill's 16 slots.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.local_serve import SMALL_POOL, LocalServe  # noqa: E402

APP = "flood"
KEYS = {"attacker": "flood-attacker-key", "probe": "flood-probe-key"}


def config(budget_s: float):
    from kvmesh.cluster.config import ServeConfig
    return ServeConfig.model_validate({
        "mode": "disaggregated", "engine": {"store": None, "grammar_compile_timeout_s": budget_s},
        "prefill": dict(SMALL_POOL), "decode": dict(SMALL_POOL),
        "ingress": {"num_cpus": 0.1, "token_timeout_s": 300.0, "api_keys": list(KEYS.values())}})


def wide(n: int, tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)},
            "required": [f"{tag}_{i}" for i in range(n)]}


def small(tag: str) -> dict:
    return {"type": "object", "properties": {tag: {"type": "boolean"}}, "required": [tag],
            "additionalProperties": False}


async def complete(client: httpx.AsyncClient, url: str, who: str, schema: dict | None) -> tuple[int, float]:
    body = {"prompt": "{", "max_tokens": 8, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    t = time.monotonic()
    r = await client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[who]}"})
    return r.status_code, time.monotonic() - t


async def flood(url: str, slow: int, properties: int, every_s: float) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=slow + 50)) as client:
        idle_plain = [(await complete(client, url, "probe", None))[1] for _ in range(5)]
        idle_guided = [(await complete(client, url, "probe", small(f"idle{i}")))[1] for i in range(5)]
        done = asyncio.Event()
        probes: list[tuple[str, int, float]] = []

        async def probe(kind: str, schema: dict | None):
            probes.append((kind, *await complete(client, url, "probe", schema)))

        async def prober():
            tasks, i = [], 0
            while not done.is_set():
                tasks += [asyncio.create_task(probe("plain", None)),
                          asyncio.create_task(probe("guided", small(f"probe{i}")))]
                i += 1
                await asyncio.sleep(every_s)
            await asyncio.gather(*tasks)

        start = time.monotonic()
        prober_task = asyncio.create_task(prober())
        answers = await asyncio.gather(*(complete(client, url, "attacker", wide(properties, f"slow{i}"))
                                         for i in range(slow)))
        flood_s = time.monotonic() - start
        done.set()
        await prober_task
    flood_status = collections.Counter(status for status, _ in answers)
    row = {"slow": slow, "flood_s": flood_s, "flood_status": dict(flood_status),
           "idle_plain_p50_s": statistics.median(idle_plain), "idle_guided_p50_s": statistics.median(idle_guided)}
    for kind in ("plain", "guided"):
        lat = [t for k, _, t in probes if k == kind]
        row[f"{kind}_n"] = len(lat)
        row[f"{kind}_p50_s"] = statistics.median(lat) if lat else None
        row[f"{kind}_max_s"] = max(lat) if lat else None
        row[f"{kind}_status"] = dict(collections.Counter(s for k, s, _ in probes if k == kind))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slow", type=int, default=40)
    p.add_argument("--slow-properties", type=int, default=600)
    p.add_argument("--budget-s", type=float, default=3.0)
    p.add_argument("--probe-every", type=float, default=0.5)
    p.add_argument("--num-cpus", type=float, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import kvmesh
    with LocalServe(num_cpus=a.num_cpus) as ls:
        url = ls.deploy(APP, config(a.budget_s), "/")
        row = asyncio.run(flood(url, a.slow, a.slow_properties, a.probe_every))
    row["load"] = os.getloadavg()
    fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
    print(f"kvmesh from {os.path.dirname(kvmesh.__file__)}; {a.slow} schemas of {a.slow_properties} properties, "
          f"compile budget {a.budget_s:g} s; load average {', '.join(f'{x:.2f}' for x in row['load'])}")
    print("| probe | idle p50 s | during flood p50 s | max s | sent | statuses |")
    print("|---|---|---|---|---|---|")
    for kind in ("plain", "guided"):
        print(f"| {kind} | {fmt(row[f'idle_{kind}_p50_s'])} | {fmt(row[f'{kind}_p50_s'])} | "
              f"{fmt(row[f'{kind}_max_s'])} | {row[f'{kind}_n']} | {row[f'{kind}_status']} |")
    print(f"flood: {a.slow} answered in {row['flood_s']:.1f} s, statuses {row['flood_status']}")
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
