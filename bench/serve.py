"""The serving stack under load: disaggregated vs colocated, prefix reuse on vs off, the
NIXL handoff's bandwidth against a plain memory copy, and n=4 forks against four requests.

    python bench/serve.py [--concurrency 1,4,8] [--requests 24] [--prefix-tokens 384]
                          [--suffix-tokens 32] [--max-tokens 32] [--out bench/out/serve.json]
                          [--fork-only] [--fork-prompt 600] [--fork-tokens 64] [--fork-trials 3]

n=4 vs 4 requests: one completion with n=4 (one prefill; the four sequences fork the
prompt's blocks) against four concurrent requests of the same prompt (four prefills),
sampled (temperature 1, EOS ignored), a fresh random prompt per trial. TTFT = request
sent -> first token of each sequence (median over sequences, then trials); tok/s = all
output tokens / wall time; KV blocks = the peak of (total - free) blocks summed over the
pools, from /metrics polled every 20 ms while the trial runs.

One local Ray runs two apps of the same engine settings: disaggregated at `/` and
colocated at `/colocated`. An async httpx load generator replays a shared-prefix
workload: `--groups` system prompts of --prefix-tokens random token ids, each request
one of them plus its own --suffix-tokens, streamed (SSE), greedy, EOS ignored so every
request produces --max-tokens. At concurrency c, c clients each send requests back to
back until --requests are done. Every (mode, reuse, c) run draws fresh prefixes, so no
run inherits another's cache.

  * reuse on:  requests of a group share their prefix (the engine may reuse its blocks)
  * reuse off: the same prompts with a unique first token, so no two share any block
               (the same token counts and work, nothing to reuse)

Metrics per run, from the client's side (time.perf_counter):
  * TTFT p50 / p99: request sent -> first token event
  * TPOT: (last token - first token) / (tokens - 1), mean over requests
  * throughput: all generated tokens / wall time of the run
  * hit rate: sum usage.prompt_tokens_details.cached_tokens / sum prompt tokens

Handoff bandwidth: two NIXL agents in this process READ N bytes (registered tensors,
one descriptor, UCX), against `torch.Tensor.copy_` of the same bytes; median of
--repeats. Writes raw numbers to --out, a markdown table to stdout, plots next to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.local_serve import LocalServe, small_config  # noqa: E402

FIRST_TOKEN_ID = 3                  # ids below are bos / eos / pad in the default model
TOKEN_RANGE = 256                   # byte tokens of the default tokenizer: 3 .. 258
HANDOFF_SIZES_MB = (1, 4, 16, 64)
MiB = 1 << 20


@dataclass
class Run:
    mode: str
    reuse: bool
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_ms: float
    throughput_tok_s: float
    hit_rate: float


def workload(rng: random.Random, n: int, groups: int, prefix: int, suffix: int, reuse: bool) -> list[list[int]]:
    tok = lambda k: [rng.randrange(FIRST_TOKEN_ID, FIRST_TOKEN_ID + TOKEN_RANGE) for _ in range(k)]  # noqa: E731
    heads = [tok(prefix) for _ in range(groups)]
    prompts = [heads[i % groups] + tok(suffix) for i in range(n)]
    if not reuse:   # a unique first token: same lengths, no shared block
        prompts = [[FIRST_TOKEN_ID + (i % TOKEN_RANGE)] + tok(1) + p[2:] for i, p in enumerate(prompts)]
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                stamps += [time.perf_counter()] * len(choice.get("token_ids", []))
    return {"start": start, "stamps": stamps, "usage": usage}


async def run_load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    queue = list(reversed(prompts))
    results: list[dict] = []

    async def client_loop(client):
        while queue:
            results.append(await one_request(client, url, queue.pop(), max_tokens))
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def summarize(mode: str, reuse: bool, concurrency: int, results: list[dict], wall: float) -> Run:
    ttft = sorted((r["stamps"][0] - r["start"]) * 1e3 for r in results)
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) * 1e3 for r in results if len(r["stamps"]) > 1]
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    tokens = sum(len(r["stamps"]) for r in results)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    return Run(mode, reuse, concurrency, len(results), round(statistics.median(ttft), 1), round(pct(0.99), 1),
               round(statistics.mean(tpot), 2), round(tokens / wall, 1), round(cached / max(1, prompt), 3))


def handoff_bandwidth(repeats: int) -> list[dict]:
    """NIXL READ between two agents in this process vs a torch copy of the same bytes."""
    from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent
    rows = []
    for mb in HANDOFF_SIZES_MB:
        src = torch.randn(mb * MiB // 4)
        dst = torch.zeros_like(src)     # pages touched: no first-touch faults in either timing
        a, b = KVTransferAgent(f"bench-src-{mb}", [src]), KVTransferAgent(f"bench-dst-{mb}", [dst])
        region = [(0, 0, mb * MiB)]
        remote = a.describe(region)
        b.read(remote, region)          # connect + warm up
        nixl, copy = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            b.read(remote, region)
            nixl.append(time.perf_counter() - t)
            t = time.perf_counter()
            dst.copy_(src)
            copy.append(time.perf_counter() - t)
        assert torch.equal(src, dst)
        a.close()
        b.close()
        gbs = lambda ts: round(mb * MiB / statistics.median(ts) / 1e9, 2)  # noqa: E731
        rows.append({"mb": mb, "nixl_gb_s": gbs(nixl), "copy_gb_s": gbs(copy)})
    return rows


def table(runs: list[Run], handoff: list[dict]) -> str:
    lines = ["| mode | reuse | conc | TTFT p50 ms | TTFT p99 ms | TPOT ms | tok/s | hit rate |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.mode} | {'on' if r.reuse else 'off'} | {r.concurrency} | {r.ttft_p50_ms} | {r.ttft_p99_ms} "
              f"| {r.tpot_ms} | {r.throughput_tok_s} | {r.hit_rate:.1%} |" for r in runs]
    lines += ["", "| handoff MB | NIXL READ GB/s | memory copy GB/s |", "| ---: | ---: | ---: |"]
    lines += [f"| {h['mb']} | {h['nixl_gb_s']} | {h['copy_gb_s']} |" for h in handoff]
    return "\n".join(lines)


def plot(runs: list[Run], handoff: list[dict], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode in ("disaggregated", "colocated"):
        for reuse in (True, False):
            rs = [r for r in runs if r.mode == mode and r.reuse == reuse]
            label = f"{mode}, reuse {'on' if reuse else 'off'}"
            axes[0].plot([r.concurrency for r in rs], [r.ttft_p50_ms for r in rs], marker="o", label=label)
            axes[1].plot([r.concurrency for r in rs], [r.throughput_tok_s for r in rs], marker="o", label=label)
    axes[0].set(xlabel="concurrency", ylabel="TTFT p50 (ms)", title="time to first token")
    axes[1].set(xlabel="concurrency", ylabel="output tokens / s", title="throughput")
    axes[0].legend(fontsize=7)
    axes[2].plot([h["mb"] for h in handoff], [h["nixl_gb_s"] for h in handoff], marker="o", label="NIXL READ (UCX)")
    axes[2].plot([h["mb"] for h in handoff], [h["copy_gb_s"] for h in handoff], marker="o", label="memory copy")
    axes[2].set(xscale="log", xlabel="bytes moved (MiB)", ylabel="GB/s", title="handoff bandwidth")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


@dataclass
class ForkRun:
    mode: str
    shape: str
    ttft_ms: float
    tok_s: float
    peak_blocks: int


async def _stream_choices(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, dict[int, list[float]]]:
    start, stamps = time.perf_counter(), {}
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    stamps.setdefault(choice["index"], []).extend(
                        [time.perf_counter()] * len(choice.get("token_ids", [])))
    return start, stamps


async def _peak_blocks(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> int:
    peak = 0
    while not stop.is_set():
        text = (await client.get(f"{url}/metrics")).text
        used = {}
        for line in text.splitlines():
            for key in ("kvmesh_worker_total_blocks{", "kvmesh_worker_free_blocks{"):
                if line.startswith(key):
                    labels, value = line[len(key):].rsplit(" ", 1)
                    sign = 1 if "total" in key else -1
                    used[labels] = used.get(labels, 0) + sign * float(value)
        peak = max(peak, int(sum(used.values())))
        await asyncio.sleep(0.02)
    return peak


async def fork_trial(url: str, prompt: list[int], max_tokens: int, forked: bool, seed: int) -> tuple[float, float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True, "seed": seed}
    async with httpx.AsyncClient(timeout=300) as client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_peak_blocks(client, url, stop))
        t0 = time.perf_counter()
        if forked:
            runs = [await _stream_choices(client, url, {**body, "n": 4})]
        else:
            runs = await asyncio.gather(*(_stream_choices(client, url, {**body, "seed": seed + i}) for i in range(4)))
        wall = time.perf_counter() - t0
        stop.set()
        peak = await watcher
    ttfts = [(s[0] - start) * 1e3 for start, stamps in runs for s in stamps.values()]
    tokens = sum(len(s) for _, stamps in runs for s in stamps.values())
    assert tokens == 4 * max_tokens, tokens
    return statistics.median(ttfts), tokens / wall, peak


def fork_bench(urls: dict[str, str], prompt_tokens: int, max_tokens: int, trials: int) -> list[ForkRun]:
    rng, rows = random.Random(1), []
    for mode, url in urls.items():
        for forked in (True, False):
            results = []
            for t in range(trials):
                prompt = [rng.randrange(FIRST_TOKEN_ID, FIRST_TOKEN_ID + TOKEN_RANGE) for _ in range(prompt_tokens)]
                results.append(asyncio.run(fork_trial(url, prompt, max_tokens, forked, seed=t)))
            med = lambda i: statistics.median(r[i] for r in results)  # noqa: E731
            rows.append(ForkRun(mode, "n=4 (1 prefill)" if forked else "4 requests", round(med(0), 1),
                                round(med(1), 1), int(med(2))))
            print(rows[-1], flush=True)
    return rows


def fork_table(rows: list[ForkRun]) -> str:
    lines = ["| mode | shape | TTFT p50 ms | tok/s | peak KV blocks | vs 4 requests: TTFT | tok/s | blocks |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(b for b in rows if b.mode == r.mode and b.shape == "4 requests")
        lines.append(f"| {r.mode} | {r.shape} | {r.ttft_ms} | {r.tok_s} | {r.peak_blocks} | "
                     f"{r.ttft_ms / base.ttft_ms:.2f}x | {r.tok_s / base.tok_s:.2f}x | "
                     f"{r.peak_blocks / max(1, base.peak_blocks):.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=384)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="handoff bandwidth repeats")
    p.add_argument("--out", default="bench/out/serve.json")
    p.add_argument("--fork-only", action="store_true", help="run only the n=4 vs 4 requests comparison")
    p.add_argument("--fork-prompt", type=int, default=600, help="prompt tokens of the n=4 comparison")
    p.add_argument("--fork-tokens", type=int, default=64, help="output tokens per sequence")
    p.add_argument("--fork-trials", type=int, default=3)
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = {"kv_cache_bytes": 128 << 20, "max_num_seqs": 16, "max_batched_tokens": 1024, "store": None}
    runs: list[Run] = []
    rng = random.Random(0)
    with LocalServe(num_cpus=4) as ls:
        urls = {"disaggregated": ls.deploy("disagg", small_config("disaggregated", engine=engine), "/"),
                "colocated": ls.deploy("colo", small_config("colocated", engine=engine), "/colocated")}
        for mode, url in urls.items():
            asyncio.run(run_load(url, workload(rng, 4, 2, 64, 8, True), 2, 4))     # warm up
        forks = fork_bench(urls, args.fork_prompt, args.fork_tokens, args.fork_trials)
        for mode, url in urls.items():
            for reuse in (True, False) if not args.fork_only else ():
                for c in levels:
                    prompts = workload(rng, args.requests, args.groups, args.prefix_tokens, args.suffix_tokens, reuse)
                    results, wall = asyncio.run(run_load(url, prompts, c, args.max_tokens))
                    runs.append(summarize(mode, reuse, c, results, wall))
                    print(runs[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.fork_only:
        out.with_name(out.stem + "_fork.json").write_text(json.dumps(
            {"args": vars(args), "forks": [asdict(r) for r in forks], "cpus": os.cpu_count()}, indent=2))
        print(fork_table(forks))
        return 0
    handoff = handoff_bandwidth(args.repeats)
    out.write_text(json.dumps({"args": vars(args), "runs": [asdict(r) for r in runs], "handoff": handoff,
                               "forks": [asdict(r) for r in forks], "cpus": os.cpu_count()}, indent=2))
    print(table(runs, handoff))
    print()
    print(fork_table(forks))
    plot(runs, handoff, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
