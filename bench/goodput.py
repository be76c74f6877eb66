"""Goodput of a running deployment on the production trace: requests that meet both their TTFT
and their ITL target, per replica-second provisioned (issue 46 item 1; DistServe's metric,
`vllm bench serve --goodput`).

    python bench/goodput.py --url URL --slo-ttft-ms MS --slo-itl-ms MS [--time-scale X]
                            [--requests N] [--start K] [--trace FILE] [--block-tokens B]
                            [--max-tokens M] [--vocab V] [--api-key KEY] [--poll-s S]
                            [--burst START:LENGTH:FACTOR] [--plot FILE] [--json]
    python bench/goodput.py --serve colocated|disaggregated [--overrides JSON] ...
                            # a local deployment of the built-in model (tests/local_serve.small_config,
                            # its sections updated by --overrides, e.g. '{"ingress": {"decode_prefill_max_tokens": 256}}')

Open loop: request i of the trace (../shared/traces/conversation_trace.jsonl, Mooncake's
format; requests [--start, --start + --requests)) is sent at its arrival time divided by
--time-scale (2 replays twice as fast), whatever the earlier ones are doing. Its prompt is
the trace's blocks as token ids (kvstore/policy/trace.py: each 512-token trace block becomes
--block-tokens deterministic ids below --vocab, so requests that share `hash_ids` share a
prefix), cut to fit the model's context; it asks for min(its output length, --max-tokens)
tokens, EOS ignored, greedy, streamed. Per request: TTFT (sent -> first token) and its
inter-token gaps (an event of k tokens after a gap g counts k gaps of g / k); ITL is the
request's p90 gap. A request is *good* when it succeeded, TTFT <= --slo-ttft-ms and ITL <=
--slo-itl-ms (one output token: no gap to miss). Attainment = good / requests sent.

Replicas provisioned are read from the deployment's /metrics every --poll-s seconds
(`kvmesh_pool_replicas{pool, state}`: Serve's controller's count, starting replicas
included) and integrated over the run, from the first request sent to the last one ended:
`replica_s`. goodput_per_replica_s = good requests / replica_s.

Printed: a table (requests, failed, attainment, TTFT and ITL percentiles, replica_s, goodput
per replica-second, the load average beside it), or with --json one line with
`goodput_per_replica_s`, `attainment`, `failed`, `replica_s` and the rest (`prefill_routes`: where a
disaggregated deployment ran the prompts, from /metrics). --plot writes a
figure over time: arrivals, queued prompt tokens (sent, no first token yet: what the client
has waiting), replicas per pool, attainment of the requests that ended in each second.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvmesh.kvstore.policy.trace import TraceRequest, load_trace, prompt_token_ids  # noqa: E402

SHARED_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
EXCERPT = ROOT / "tests" / "data" / "conversation_trace_excerpt.jsonl"
LIVE_STATES = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "STOPPING")     # each holds its resources


@dataclass
class Outcome:
    sent: float                     # seconds from the run's start
    prompt_tokens: int
    asked: int                      # output tokens asked for
    ttft_s: float | None = None
    gaps: list[float] = field(default_factory=list)     # per token after the first
    ended: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def itl_s(self) -> float:
        return pct(self.gaps, 0.9) if self.gaps else 0.0

    def good(self, slo_ttft_s: float, slo_itl_s: float) -> bool:
        return (self.error is None and self.ttft_s is not None and self.ttft_s <= slo_ttft_s
                and self.itl_s <= slo_itl_s)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def prompts(reqs: list[TraceRequest], block_tokens: int, vocab: int, max_model_len: int,
            max_tokens: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, tokens asked) per request, each fitted into the context."""
    out = []
    for r in reqs:
        asked = max(1, min(r.output_tokens, max_tokens))
        ids = prompt_token_ids(r, block_tokens, vocab)[:max(1, max_model_len - asked)]
        out.append((r.t, ids, asked))
    return out


async def one(client: httpx.AsyncClient, url: str, headers: dict, ids: list[int], asked: int,
              start: float, model: str) -> Outcome:
    out = Outcome(time.monotonic() - start, len(ids), asked)
    body = {"model": model, "prompt": ids, "max_tokens": asked, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"])[:200]
                    break
                k = sum(len(c.get("token_ids") or ()) or bool(c.get("text")) for c in event.get("choices", ()))
                if not k:
                    continue
                now = time.monotonic() - start
                if last is None:
                    out.ttft_s = now - out.sent
                    out.gaps += [0.0] * (k - 1)     # tokens that came with the first: no wait
                else:
                    out.gaps += [(now - last) / k] * k
                last = now
                out.tokens += k
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        out.ended = time.monotonic() - start
    if out.error is None and out.tokens < asked:
        out.error = f"stream ended after {out.tokens} of {asked} tokens"
    return out


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` in a /metrics text (prometheus_client's parser)."""
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


def replicas_by_pool(text: str) -> dict[str, int]:
    """{pool: replicas} from a /metrics text (kvmesh_pool_replicas, every state that holds resources)."""
    out: dict[str, int] = {}
    for labels, value in samples(text, "kvmesh_pool_replicas"):
        if labels["state"] in LIVE_STATES:
            out[labels["pool"]] = out.get(labels["pool"], 0) + int(value)
    return out


async def replay(url: str, plan: list[tuple[float, list[int], int]], time_scale: float, headers: dict,
                 poll_s: float, model: str, targets: list | None = None
                 ) -> tuple[list[Outcome], list[tuple[float, dict[str, int]]], float]:
    """Every request sent at its time; the /metrics polls meanwhile (time, replicas by pool), and into
    `targets` (time, the planner's target replicas by pool) where the deployment has a planner."""
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        polls: list[tuple[float, dict[str, int]]] = []
        start = time.monotonic()
        stop = asyncio.Event()

        async def poll():
            while not stop.is_set():
                t = time.monotonic() - start
                try:
                    text = (await client.get(f"{url}/metrics", headers=headers)).text
                    polls.append((t, replicas_by_pool(text)))
                    if targets is not None:
                        targets.append((t, {lb["pool"]: int(v) for lb, v in
                                            samples(text, "kvmesh_planner_target_replicas")}))
                except httpx.HTTPError:
                    pass
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), poll_s)

        poller = asyncio.create_task(poll())
        t0 = plan[0][0]
        tasks = []
        for t, ids, asked in plan:
            delay = (t - t0) / time_scale - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, headers, ids, asked, start, model)))
        outcomes = await asyncio.gather(*tasks)
        stop.set()
        await poller
    return outcomes, polls, time.monotonic() - start


def bursty(plan: list[tuple[float, list[int], int]], time_scale: float, start: float, length: float,
           factor: float) -> list[tuple[float, list[int], int]]:
    """The plan with a step in its arrival rate: requests whose replay time falls in [start, start +
    length * factor) arrive `factor` times as fast (within [start, start + length)), the later ones
    shifted to follow."""
    t0, out = plan[0][0], []
    for t, ids, asked in plan:
        tau = (t - t0) / time_scale
        if tau > start:
            tau = start + (tau - start) / factor if tau <= start + length * factor else tau - length * factor + length
        out.append((t0 + tau * time_scale, ids, asked))
    return out


def pool_response(polls: list[tuple[float, dict[str, int]]], burst_at: float) -> dict:
    """How the prefill pool answered a burst at `burst_at` s: its replicas (any live state) then, the
    first poll that saw more (s after the burst), the most it reached, and how many at the end."""
    before = [n.get("prefill", 0) for t, n in polls if t <= burst_at] or [0]
    after = [(t, n.get("prefill", 0)) for t, n in polls if t > burst_at]
    rose = next((t - burst_at for t, n in after if n > before[-1]), None)
    return {"prefill_at_burst": before[-1], "prefill_rose_after_s": round(rose, 1) if rose is not None else None,
            "prefill_max": max((n for _, n in after), default=before[-1]),
            "prefill_at_end": after[-1][1] if after else before[-1]}


def replica_seconds(polls: list[tuple[float, dict[str, int]]], t0: float, t1: float) -> float:
    """The replica count integrated over [t0, t1], each poll standing until the next."""
    total = 0.0
    for i, (t, by_pool) in enumerate(polls):
        until = polls[i + 1][0] if i + 1 < len(polls) else t1
        a, b = max(t, t0), min(until, t1)
        if b > a:
            total += (b - a) * sum(by_pool.values())
    first = polls[0] if polls else None
    if first and first[0] > t0:         # before the first poll: as the first poll saw it
        total += (min(first[0], t1) - t0) * sum(first[1].values())
    return total


def summary(outcomes: list[Outcome], polls, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    t0 = min(o.sent for o in outcomes)
    t1 = max(o.ended for o in outcomes)
    good = [o for o in outcomes if o.good(slo_ttft_ms / 1e3, slo_itl_ms / 1e3)]
    ok = [o for o in outcomes if o.error is None]
    rs = replica_seconds(polls, t0, t1)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    itl = [o.itl_s for o in ok if o.gaps]
    pools = sorted({p for _, by_pool in polls for p in by_pool})
    return {"requests": len(outcomes), "good": len(good), "failed": len(outcomes) - len(ok),
            "attainment": len(good) / len(outcomes), "replica_s": rs,
            "goodput_per_replica_s": len(good) / rs if rs > 0 else None,
            "duration_s": t1 - t0, "ttft_p50_ms": pct(ttft, 0.5) * 1e3 if ttft else None,
            "ttft_p90_ms": pct(ttft, 0.9) * 1e3 if ttft else None,
            "itl_p50_ms": pct(itl, 0.5) * 1e3 if itl else None, "itl_p90_ms": pct(itl, 0.9) * 1e3 if itl else None,
            "prompt_tokens_mean": statistics.fmean(o.prompt_tokens for o in outcomes),
            "replicas_max": {p: max(by_pool.get(p, 0) for _, by_pool in polls) for p in pools},
            "slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms,
            "errors": sorted({o.error for o in outcomes if o.error})[:5], "load": os.getloadavg()}


def plot(outcomes: list[Outcome], polls, slo_ttft_ms: float, slo_itl_ms: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    end = int(max(o.ended for o in outcomes)) + 1
    seconds = list(range(end))
    arrivals = [sum(1 for o in outcomes if s <= o.sent < s + 1) for s in seconds]
    queued = [sum(o.prompt_tokens for o in outcomes if o.sent <= s and (o.ttft_s is None and (o.ended or 0) > s
                                                                      or o.ttft_s is not None and o.sent + o.ttft_s > s))
              for s in seconds]
    attained = []
    for s in seconds:
        ended = [o for o in outcomes if s <= (o.ended or 0) < s + 1]
        attained.append(sum(o.good(slo_ttft_ms / 1e3, slo_itl_ms / 1e3) for o in ended) / len(ended) if ended else None)
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    axes[0].bar(seconds, arrivals, width=1.0, color="C0")
    axes[0].set_ylabel("arrivals / s")
    axes[1].plot(seconds, queued, color="C1")
    axes[1].set_ylabel("queued prompt\ntokens")
    for pool in sorted({p for _, by_pool in polls for p in by_pool}):
        axes[2].step([t for t, _ in polls], [by_pool.get(pool, 0) for _, by_pool in polls], where="post", label=pool)
    axes[2].set_ylabel("replicas")
    axes[2].legend(fontsize=8)
    axes[3].plot([s for s, a in zip(seconds, attained) if a is not None], [a for a in attained if a is not None],
                 "o-", markersize=3, color="C2")
    axes[3].set_ylim(-0.05, 1.05)
    axes[3].set_ylabel("attainment")
    axes[3].set_xlabel("seconds into the replay")
    axes[0].set_title(f"{len(outcomes)} trace requests, SLO TTFT {slo_ttft_ms:g} ms / ITL {slo_itl_ms:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(row: dict) -> str:
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"      # noqa: E731
    return "\n".join([
        "| requests | failed | attainment | TTFT p50 / p90 ms | ITL p50 / p90 ms | replica_s | goodput / replica-s |",
        "|---:|---:|---:|---|---|---:|---:|",
        f"| {row['requests']} | {row['failed']} | {row['attainment']:.2f} | {fmt(row['ttft_p50_ms'])} / "
        f"{fmt(row['ttft_p90_ms'])} | {fmt(row['itl_p50_ms'])} / {fmt(row['itl_p90_ms'])} | {fmt(row['replica_s'])} | "
        f"{fmt(row['goodput_per_replica_s'], 3)} |"])


def prefill_routes(url: str, headers: dict) -> dict[str, int]:
    """/metrics' kvmesh_prefill_route_total by route (a disaggregated deployment: where prompts ran)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text
    return {labels["route"]: int(value) for labels, value in samples(text, "kvmesh_prefill_route_total")}


def run(args, url: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(timeout=60) as c:
        card = c.get(f"{url}/v1/models", headers=headers).raise_for_status().json()["data"][0]
    trace = Path(args.trace) if args.trace else (SHARED_TRACE if SHARED_TRACE.is_file() else EXCERPT)
    reqs = load_trace(trace, args.block_tokens, args.start, args.requests)
    if not reqs:
        raise SystemExit(f"no requests in {trace} from line {args.start + 1}")
    plan = prompts(reqs, args.block_tokens, args.vocab, card["max_model_len"], args.max_tokens)
    if args.burst:
        plan = bursty(plan, args.time_scale, *args.burst)
    routes_before = prefill_routes(url, headers)
    targets: list = []
    outcomes, polls, _ = asyncio.run(replay(url, plan, args.time_scale, headers, args.poll_s, card["id"], targets))
    row = summary(outcomes, polls, args.slo_ttft_ms, args.slo_itl_ms)
    after = prefill_routes(url, headers)
    row["prefill_routes"] = {r: after[r] - routes_before.get(r, 0) for r in after}
    row.update(trace=str(trace), time_scale=args.time_scale, block_tokens=args.block_tokens,
               max_tokens=args.max_tokens)
    if args.burst:
        row["burst"] = list(args.burst)
        row.update(pool_response(polls, args.burst[0]))
        planned = [(t, n) for t, n in targets if n]
        if planned:         # when the planner's decision (not the replica it asked for) came
            row["prefill_target_rose_after_s"] = pool_response(planned, args.burst[0])["prefill_rose_after_s"]
    if args.plot:
        plot(outcomes, polls, args.slo_ttft_ms, args.slo_itl_ms, args.plot)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="the deployment's base URL (its /v1/completions, /v1/models, /metrics)")
    p.add_argument("--serve", choices=("colocated", "disaggregated"),
                   help="start a local deployment of the built-in model (tests/local_serve.py's small pools) instead")
    p.add_argument("--overrides", default="{}", help="with --serve: config sections to update, as JSON")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-itl-ms", type=float, required=True)
    p.add_argument("--time-scale", type=float, default=1.0, help="the replay runs this many times as fast as the trace")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--start", type=int, default=0, help="the trace's first request replayed (0-based line)")
    p.add_argument("--trace", default=None, help=f"default {SHARED_TRACE} (else the tests' excerpt)")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens a 512-token trace block becomes")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens asked for at most")
    p.add_argument("--vocab", type=int, default=2048, help="prompt ids are drawn below this (any model's vocabulary)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", "").split(",")[0] or None)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--burst", type=lambda v: tuple(float(x) for x in v.split(":")), default=None,
                   metavar="START:LENGTH:FACTOR", help="a step in the arrival rate: from START s of the replay, "
                   "LENGTH s of arrivals FACTOR times as fast (the JSON adds how the prefill pool answered)")
    p.add_argument("--plot", default=None, help="write the figure over time here (PNG)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    a = p.parse_args(argv)
    if bool(a.url) == bool(a.serve):
        p.error("give --url or --serve, one of them")
    if a.serve:
        from tests.local_serve import LocalServe, small_config
        with LocalServe(num_cpus=8) as ls:
            row = run(a, ls.deploy("goodput", small_config(a.serve, **json.loads(a.overrides)), "/"))
        row["config"] = a.serve
        row["overrides"] = json.loads(a.overrides)
    else:
        row = run(a, a.url.rstrip("/"))
    if a.json:
        print(json.dumps(row))
    else:
        print(f"{row['requests']} requests of {row['trace']} from {a.start}, time scale {a.time_scale:g}, "
              f"SLO TTFT {a.slo_ttft_ms:g} ms / ITL {a.slo_itl_ms:g} ms; load average "
              f"{', '.join(f'{x:.2f}' for x in row['load'])}")
        print(table(row))
        if row["errors"]:
            print("errors:", *row["errors"], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
