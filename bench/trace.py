"""Prefix reuse on a production trace: every SWA policy against no reuse, and the cost model
against the replay.

Replays a window of the Mooncake conversation trace (../shared/traces/, Apache-2.0) through
the offline engine, one request at a time in arrival order, each 512-token trace block
scaled to one `block_tokens` block of a tiny V4 model (tests/helpers.py configs), each hash
id a deterministic block of token ids. Every policy runs on a fresh store in the same
process; "no reuse" is the same engine with prefix reuse off. Per policy it reports the
hit tokens by tier (device / host / store), recomputed tokens, the store's tensor bytes and
write rate, TTFT p50/p99 and their ratio to no reuse, and the cost model's prediction of
the same replay (its step cost and prefill speed fitted on the no-reuse run, its read
bandwidth measured on the store): hit and recomputed tokens and bytes must be exact, mean
TTFT within 25 %. Every request's first token and logprob must equal the no-reuse run's.

With --serve N, the first N requests also go through `kvmesh serve` (a local Ray Serve app
per policy, colocated, token-id prompts over HTTP) and are checked against the same tokens.

    python bench/trace.py                              # 300 requests, tiny swa_csa_hca model
    python bench/trace.py --requests 100 --policies full,auto --serve 40
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvmesh.kvstore.policy.cost import Hardware, ScheduledPeriods, simulate  # noqa: E402
from kvmesh.kvstore.policy.trace import (  # noqa: E402
    load_trace,
    prompt_token_ids,
    sample_conversations,  # noqa: E402
)
from tests.helpers import BLOCK_TOKENS, write_tiny_checkpoint  # noqa: E402
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import (
    EngineConfig,  # noqa: E402
    parse_bytes,  # noqa: E402
)
from kvmesh.workers.replay import run_request, stored_payload  # noqa: E402

SHARED_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
EXCERPT = ROOT / "tests" / "data" / "conversation_trace_excerpt.jsonl"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fit_cold(records) -> tuple[float, float]:
    """Least squares TTFT = step_s + tokens / tps on the no-reuse run (one step per request)."""
    xs, ys = [r.prompt_tokens for r in records], [r.ttft_s for r in records]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - b * mx, 0.0), 1.0 / max(b, 1e-12)


def read_bandwidth(root: Path) -> float:
    files = list(root.rglob("*.kv"))
    total, t0 = 0, time.perf_counter()
    for p in files:
        total += len(p.read_bytes())
    return total / max(time.perf_counter() - t0, 1e-9)


def engine(model: Path, policy: str, store: str, args, reuse: bool = True) -> Engine:
    e = Engine(EngineConfig(model=str(model), block_tokens=args.block_tokens, swa_policy=policy, store=store,
                            prefix_reuse=reuse, kv_cache_bytes=args.kv_cache_bytes,
                            host_cache_bytes=args.host_cache_bytes, max_batched_tokens=args.chunk,
                            speculative_tokens=0))
    return e


def warm(e: Engine) -> None:
    """First-call costs out of the way, on a prompt of its own (no store: nothing persisted)."""
    from kvmesh.workers.replay import FIRST_TOKEN
    reuse, e.prefix.enabled = e.prefix.enabled, False
    e.generate([[5] * (3 * e.config.block_tokens + 1)], FIRST_TOKEN)
    e.prefix.enabled = reuse


def step_cost(model: Path, args) -> float:
    """Seconds of one forward step beyond its tokens: the same prompt in one step and in
    one step per block (medians of 3), prefix reuse off."""
    from kvmesh.workers.replay import FIRST_TOKEN
    n = 32 * args.block_tokens
    times = {}
    for chunk in (n, args.block_tokens):
        e = Engine(EngineConfig(model=str(model), block_tokens=args.block_tokens, prefix_reuse=False,
                                max_batched_tokens=chunk, kv_cache_bytes=args.kv_cache_bytes, speculative_tokens=0))
        warm(e)
        runs = []
        for i in range(3):
            t0 = time.perf_counter()
            e.generate([[7 + i] * n], FIRST_TOKEN)
            runs.append(time.perf_counter() - t0)
        times[chunk] = statistics.median(runs)
        e.close()
    return max(times[args.block_tokens] - times[n], 0.0) / (n // args.block_tokens - 1)


def summarize(policy: str, e: Engine, root: Path, recs, cold, reqs, args, fit: dict) -> dict:
    payload = stored_payload(e)
    choices = list(e.prefix.auto.choices.values()) if e.prefix.auto is not None else []
    w = e.prefix.writer.stats
    read_bps = read_bandwidth(root)
    hw = Hardware(fit["tps"], read_bps, 1e12, overhead_s=fit["overhead_s"], step_s=fit["step_s"])
    # adaptive auto: the model replays the periods the engine chose (measured figures differ)
    tuner = ScheduledPeriods(e.prefix.auto.choices) if e.prefix.auto is not None else None
    pred = simulate(reqs, e.layout, e.policy, hw, tuner=tuner, chunk_tokens=args.chunk)
    mismatched = sum(1 for a, b in zip(recs, cold) if a.token != b.token or abs(a.logprob - b.logprob) > 1e-4)
    ttft, cold_ttft = [r.ttft_s for r in recs], [r.ttft_s for r in cold]
    return {
        "policy": policy, "requests": len(recs), "prompt_tokens": sum(r.prompt_tokens for r in recs),
        "hit_tokens": sum(r.hit_tokens for r in recs), "recompute_tokens": sum(r.recompute_tokens for r in recs),
        "device_tokens": sum(r.device_tokens for r in recs), "host_tokens": sum(r.host_tokens for r in recs),
        "store_tokens": sum(r.store_tokens for r in recs),
        "bytes_stored": sum(v[1] for v in payload.values()), "objects": {k: v[0] for k, v in payload.items()},
        "file_bytes_written": w["bytes"], "write_bps": w["bytes"] / max(w["write_s"], 1e-9),
        "written_per_replay_s": w["bytes"] / sum(ttft),
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "ttft_mean": statistics.fmean(ttft),
        "p50_vs_cold": pct(ttft, 0.5) / pct(cold_ttft, 0.5),
        "mean_vs_cold": statistics.fmean(ttft) / statistics.fmean(cold_ttft),
        "mismatched": mismatched, "auto_periods": choices,
        "pred_hit_tokens": pred.hit_tokens, "pred_recompute_tokens": pred.recompute_tokens,
        "pred_bytes": pred.bytes_written, "pred_ttft_mean": statistics.fmean(pred.ttft_s),
        "pred_over_measured_ttft": statistics.fmean(pred.ttft_s) / statistics.fmean(ttft),
        "store_read_bps": read_bps,
    }


def serve_replay(model: Path, policies: list[str], reqs, args, cold) -> list[dict]:
    """The first requests through `kvmesh serve` (colocated app, one per policy)."""
    import httpx

    from tests.local_serve import LocalServe, small_config
    rows = []
    with LocalServe(num_cpus=2) as ls:
        for policy in ["no reuse"] + policies:
            root = tempfile.mkdtemp(prefix="kvmesh-trace-serve-")
            cfg = small_config("colocated", engine={
                "model": str(model), "block_tokens": args.block_tokens, "swa_policy": "full" if policy == "no reuse"
                else policy, "store": root, "kv_cache_bytes": args.kv_cache_bytes, "host_cache_bytes": args.host_cache_bytes,
                "max_batched_tokens": args.chunk})
            url = ls.deploy("trace", cfg)
            ttft, cached, mismatched = [], 0, 0
            with httpx.Client(timeout=120) as client:
                client.post(f"{url}/v1/completions", json={"prompt": [5] * 50, "max_tokens": 1})   # warm-up
                for i, (req, ref) in enumerate(zip(reqs, cold)):
                    prompt = prompt_token_ids(req, args.block_tokens, args.vocab)
                    if policy == "no reuse":    # a unique first token: same work, nothing shared
                        prompt = [3 + i % 200] + prompt[1:]
                    t0 = time.perf_counter()
                    r = client.post(f"{url}/v1/completions", json={
                        "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True,
                        "ignore_eos": True})
                    ttft.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    body = r.json()
                    cached += body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                    if policy != "no reuse" and body["choices"][0]["token_ids"][0] != ref.token:
                        mismatched += 1
            rows.append({"policy": policy, "requests": len(ttft), "cached_tokens": cached,
                         "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "mismatched": mismatched})
    base = rows[0]["ttft_p50"]
    for r in rows:
        r["p50_vs_no_reuse"] = r["ttft_p50"] / base
    return rows


def table(rows: list[dict], cold: dict) -> str:
    head = ("| policy | hit tok | device | host | store | recomputed | stored KiB | written KiB/s served | TTFT p50 ms "
            "| p99 ms | p50 vs no reuse | model: hit / recomp / bytes | model TTFT / measured | tokens = cold |")
    lines = [head, "|" + "---|" * (head.count("|") - 1),
             f"| no reuse | 0 | 0 | 0 | 0 | 0 | 0 | 0 | {cold['ttft_p50'] * 1e3:.2f} | {cold['ttft_p99'] * 1e3:.2f} "
             f"| 1.00 | | | |"]
    for r in rows:
        exact = ("exact" if (r["pred_hit_tokens"], r["pred_recompute_tokens"], r["pred_bytes"]) ==
                 (r["hit_tokens"], r["recompute_tokens"], r["bytes_stored"]) else
                 f"{r['pred_hit_tokens']} / {r['pred_recompute_tokens']} / {r['pred_bytes']}")
        name = r["policy"] + (f" (P: {r['auto_periods'][-1] if r['auto_periods'] else 0})"
                              if r["policy"] == "auto" else "")
        lines.append(f"| {name} | {r['hit_tokens']} | {r['device_tokens']} | {r['host_tokens']} | "
                     f"{r['store_tokens']} | {r['recompute_tokens']} | {r['bytes_stored'] / 1024:.0f} | "
                     f"{r['written_per_replay_s'] / 1024:.0f} | {r['ttft_p50'] * 1e3:.2f} | {r['ttft_p99'] * 1e3:.2f} | "
                     f"{r['p50_vs_cold']:.2f} | {exact} | {r['pred_over_measured_ttft']:.2f} | "
                     f"{r['requests'] - r['mismatched']}/{r['requests']} |")
    return "\n".join(lines)


def serve_table(rows: list[dict]) -> str:
    lines = ["| policy (kvmesh serve) | requests | cached tokens | TTFT p50 ms | p99 ms | p50 vs no reuse "
             "| tokens = offline cold |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "" if r["policy"] == "no reuse" else f"{r['requests'] - r['mismatched']}/{r['requests']}"
        lines.append(f"| {r['policy']} | {r['requests']} | {r['cached_tokens']} | {r['ttft_p50'] * 1e3:.1f} | "
                     f"{r['ttft_p99'] * 1e3:.1f} | {r['p50_vs_no_reuse']:.2f} | {same} |")
    return "\n".join(lines)


def plot(rows: list[dict], cold: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for r in rows:
        auto = r["policy"].startswith("auto")
        ax.plot(r["bytes_stored"] / 2**20, r["ttft_mean"] * 1e3, "*" if auto else "o",
                markersize=14 if auto else 7, color="C3" if auto else "C0")
        ax.annotate(r["policy"], (r["bytes_stored"] / 2**20, r["ttft_mean"] * 1e3), textcoords="offset points",
                    xytext=(7, 3), fontsize=8)
    ax.axhline(cold["ttft_mean"] * 1e3, color="grey", linestyle="--", linewidth=1,
               label=f"no reuse ({cold['ttft_mean'] * 1e3:.1f} ms)")
    ax.set_xlabel("store bytes after the replay (MiB)")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(f"{rows[0]['requests']} trace requests: storage vs TTFT per SWA policy (auto: star)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(SHARED_TRACE if SHARED_TRACE.exists() else EXCERPT))
    p.add_argument("--sample", type=int, default=40, help="keep 1/N of the conversations (0: a window)")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--tiny", default="swa_csa_hca", choices=sorted(BLOCK_TOKENS))
    p.add_argument("--policies", default=None, help="default: full, periodic:4B, periodic:16B, zero, auto "
                                                    "(B = block_tokens)")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default="8MiB")
    p.add_argument("--host-cache-bytes", type=parse_bytes, default="2MiB")
    p.add_argument("--chunk", type=int, default=4096, help="max batched tokens per step")
    p.add_argument("--serve", type=int, default=0, help="also replay the first N requests through kvmesh serve")
    p.add_argument("--out", default="bench/results/trace")
    args = p.parse_args()
    args.block_tokens = bt = BLOCK_TOKENS[args.tiny]
    policies = (args.policies or f"full,periodic:{4 * bt},periodic:{16 * bt},zero,auto").split(",")
    reqs = load_trace(args.trace, bt)
    reqs = (sample_conversations(reqs, args.sample) if args.sample else reqs)[args.start:args.start + args.requests]
    model = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="kvmesh-tiny-")), args.tiny)
    print(f"{len(reqs)} requests from {args.trace} (from #{args.start}), {sum(r.tokens for r in reqs)} prompt "
          f"tokens, tiny {args.tiny}, block_tokens {bt}", file=sys.stderr)

    step_s = step_cost(model, args)
    roots = {p: Path(tempfile.mkdtemp(prefix="kvmesh-trace-")) for p in ["no reuse"] + policies}
    engines = {p: engine(model, "full" if p == "no reuse" else p, str(roots[p]), args, reuse=p != "no reuse")
               for p in roots}
    for e in engines.values():
        warm(e)
    args.vocab = engines["no reuse"].args.vocab_size
    # Interleaved: request i runs on every engine before request i+1, so the machine's
    # noise (2 shared cores) falls on all policies alike.
    recs = {p: [] for p in engines}
    for i, req in enumerate(reqs):
        for p, e in engines.items():
            recs[p].append(run_request(e, req, f"{p}-{i}"))
    cold_recs = recs["no reuse"]
    base_step, tps = fit_cold(cold_recs)
    cold_ttft = [r.ttft_s for r in cold_recs]
    cold = {"ttft_p50": pct(cold_ttft, 0.5), "ttft_p99": pct(cold_ttft, 0.99), "ttft_mean": statistics.fmean(cold_ttft),
            "step_s": step_s, "prefill_tps": tps}
    print(f"  no reuse: TTFT p50 {cold['ttft_p50'] * 1e3:.2f} ms; fit: {base_step * 1e3:.2f} ms/request + "
          f"{tps:,.0f} tok/s; {step_s * 1e3:.2f} ms per extra step", file=sys.stderr)
    rows = []
    for policy in policies:
        rows.append(summarize(policy, engines[policy], roots[policy], recs[policy], cold_recs, reqs, args,
                              {"tps": tps, "overhead_s": base_step, "step_s": step_s}))
        engines[policy].close()
        r = rows[-1]
        print(f"  {policy:>14}: hit {r['hit_tokens']} recomputed {r['recompute_tokens']} stored "
              f"{r['bytes_stored'] / 2**20:.2f} MiB TTFT p50 {r['ttft_p50'] * 1e3:.2f} ms "
              f"(model/measured {r['pred_over_measured_ttft']:.2f}) mismatched {r['mismatched']}", file=sys.stderr)
    print(table(rows, cold))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"trace": args.trace, "start": args.start, "tiny": args.tiny, "block_tokens": bt, "no_reuse": cold,
              "policies": rows}
    if args.serve:
        result["serve"] = serve_replay(model, policies, reqs[:args.serve], args, cold_recs)
        print()
        print(serve_table(result["serve"]))
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    plot(rows, cold, Path(f"{out}.png"))
    print(f"\nwrote {out}.json and {out}.png", file=sys.stderr)
    failures = [r["policy"] for r in rows if r["mismatched"] or not 0.75 <= r["pred_over_measured_ttft"] <= 1.25
                or (r["pred_hit_tokens"], r["pred_recompute_tokens"], r["pred_bytes"])
                != (r["hit_tokens"], r["recompute_tokens"], r["bytes_stored"])]
    if failures:
        print(f"FAILED (tokens differ from cold, or the cost model is off): {failures}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
