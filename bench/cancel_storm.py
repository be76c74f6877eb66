"""The cancel storm (issue 48 item 3): streams dropped right after their first token, while
plain requests are served.

    python bench/cancel_storm.py [--drops 64] [--release-timeout 30] [--max-tokens 64]
                                 [--plain 5] [--plain-max-tokens 8] [--plain-every 0.5]
                                 [--num-cpus 8] [--out FILE]

One local Ray + Serve runs the disaggregated app (the tiny default model, the engine's default
settings, pools of tests/local_serve.SMALL_POOL: `max_ongoing_requests` 16 as in the issue,
`handoff.release_timeout_s` as given, 30 s by default as shipped). After a warm-up:

1. idle: --plain plain (non-streamed) completions one after another; their latency.
2. storm: --drops clients at once each POST a streamed completion (a prompt of a few blocks,
   --max-tokens, EOS ignored), read until the first event that carries a token, and drop the
   connection (a hard close, as a client that goes away). Meanwhile a plain completion is sent
   every --plain-every seconds (each on its own), from the storm's start until the prefill pool
   holds nothing.
   Printed: the plain requests' latency while the storm's holds last (median, max), the time
   from the last drop until the prefill replicas' held caches reach 0 (polled every 50 ms via
   `Prefill.info()`), and how many holds the prefill released by timeout
   (`held_timeouts`, summed over the prefill replicas' stats).

Before issue 48 item 3 the ingress told nobody when a client left after prefill answered, so
each dropped stream whose decode had not yet read the cache held it for release_timeout_s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.local_serve import SMALL_POOL, LocalServe, drop_after_first_token  # noqa: E402

APP = "storm"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8      # a few 128-token blocks (byte tokenizer)
PLAIN = "hello world, a plain request"


def config(release_timeout_s: float):
    from kvmesh.cluster.config import ServeConfig
    return ServeConfig.model_validate({
        "mode": "disaggregated", "engine": {"store": None},
        "prefill": dict(SMALL_POOL), "decode": dict(SMALL_POOL),
        "ingress": {"num_cpus": 0.1, "token_timeout_s": 120.0},
        "handoff": {"release_timeout_s": release_timeout_s}})


def held() -> int:
    from ray import serve
    return serve.get_deployment_handle("Prefill", APP).info.remote().result(timeout_s=30)["held"]


def held_timeouts() -> int:
    from kvmesh.cluster.serve.metrics import scrape_pools
    from ray import serve

    async def scrape():
        return await scrape_pools({"prefill": serve.get_deployment_handle("Prefill", APP)})
    return sum(s.held_timeouts for s in asyncio.run(scrape()))


async def drop_one(port: int, max_tokens: int) -> float:
    """One streamed completion, dropped once an event with a token arrived; when it dropped."""
    await drop_after_first_token(port, {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True, "stream": True, "return_token_ids": True})
    return time.monotonic()


async def plain(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    t = time.monotonic()
    r = await client.post(f"{url}/v1/completions", json={"prompt": PLAIN, "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.monotonic() - t


async def storm(url: str, port: int, drops: int, max_tokens: int, plain_tokens: int, every_s: float,
                limit_s: float) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        stop = asyncio.Event()
        probes: list[tuple[float, float]] = []      # (sent, latency)

        async def probe_one():
            sent = time.monotonic()
            probes.append((sent, await plain(client, url, plain_tokens)))

        async def prober():
            tasks = []
            while not stop.is_set():
                tasks.append(asyncio.create_task(probe_one()))
                await asyncio.sleep(every_s)
            await asyncio.gather(*tasks)
        start = time.monotonic()
        probe = asyncio.create_task(prober())
        dropped = await asyncio.gather(*(drop_one(port, max_tokens) for _ in range(drops)))
        last_drop = max(dropped)
        cleared = None
        while time.monotonic() - last_drop < limit_s:
            if await asyncio.to_thread(held) == 0:
                cleared = time.monotonic() - last_drop
                break
            await asyncio.sleep(0.05)
        stop.set()
        await probe
    during = [lat for sent, lat in probes if sent <= last_drop + (cleared or limit_s)]
    return {"drops": drops, "storm_s": last_drop - start, "held_zero_after_s": cleared,
            "plain_during": len(during), "plain_p50_s": statistics.median(during) if during else None,
            "plain_max_s": max(during) if during else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drops", type=int, default=64)
    p.add_argument("--release-timeout", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--plain", type=int, default=5)
    p.add_argument("--plain-max-tokens", type=int, default=8)
    p.add_argument("--plain-every", type=float, default=0.5, help="seconds between plain requests in the storm")
    p.add_argument("--num-cpus", type=float, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with LocalServe(num_cpus=a.num_cpus) as ls:
        url = ls.deploy(APP, config(a.release_timeout), "/")

        async def idle() -> list[float]:
            async with httpx.AsyncClient(timeout=300) as client:
                for _ in range(2):      # warm-up
                    await plain(client, url, a.plain_max_tokens)
                return [await plain(client, url, a.plain_max_tokens) for _ in range(a.plain)]
        idle_s = asyncio.run(idle())
        before = held_timeouts()
        result = asyncio.run(storm(url, ls.port, a.drops, a.max_tokens, a.plain_max_tokens, a.plain_every,
                                   a.release_timeout + 30))
        result.update(idle_p50_s=statistics.median(idle_s), held_timeouts=held_timeouts() - before,
                      release_timeout_s=a.release_timeout, load=os.getloadavg())
    fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
    print("| drops | idle plain p50 s | plain during p50 s | plain during max s | plain sent | "
          "held -> 0 after last drop s | held_timeouts |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['drops']} | {fmt(result['idle_p50_s'])} | {fmt(result['plain_p50_s'])} | "
          f"{fmt(result['plain_max_s'])} | {result['plain_during']} | {fmt(result['held_zero_after_s'])} | "
          f"{result['held_timeouts']} |")
    print(f"storm (all {result['drops']} dropped) took {result['storm_s']:.2f} s; release_timeout_s "
          f"{result['release_timeout_s']:g}; load average {', '.join(f'{x:.2f}' for x in result['load'])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
