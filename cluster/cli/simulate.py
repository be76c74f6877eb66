"""`kvmesh simulate`: project every SWA policy to a model's real shape on a request trace.

    kvmesh simulate --trace ../shared/traces/conversation_trace.jsonl --config V4-Pro \\
        --prefill-tokens-per-s 40000 --store-read-gbps 20 --store-write-gbps 10 [--capacity-tb 2] [--json]

`--config` is a released shape (V4-Pro, V4-Flash), a config.json or a checkpoint directory.

    kvmesh simulate --pd --trace ../shared/traces/conversation_trace.jsonl [--profile FILE]
        [--slo-ttft-ms 2000] [--slo-itl-ms 200] [--loads 4,8,16] [--json]

`--pd` replays the trace against simulated prefill and decode pools (cluster/serve/pd_sim.py) under
the P/D planner (cluster/serve/planner.py) and its baselines -- the best static split, Ray Serve's
default policy, Dynamo's throughput formula -- at each load (that many tenants replaying the trace at
once) and on a 10x burst; step times are the built-in model's as fitted on this machine
(bench/pd_profile.py) unless `--profile` names another fit (its --json output).
The trace's blocks keep their size (`--block-tokens`, default the trace's 512), so lengths
are the trace's own. The model is `kvmesh.kvstore.policy.cost`; `--json` prints one object per policy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


class SimulateError(ValueError):
    """A simulate argument that cannot be used; the message says why."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="project SWA policies to a model's shape on a request trace")
    p.add_argument("--trace", required=True, help="trace JSONL (Mooncake format: hash_ids of 512-token blocks)")
    p.add_argument("--config", help="V4-Pro, V4-Flash, a config.json or a checkpoint directory (not with --pd)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=40_000.0,
                   help="uncached prefill speed of one prefill replica (default 40000)")
    p.add_argument("--store-read-gbps", type=float, default=20.0, help="store read GB/s per replica (default 20)")
    p.add_argument("--store-write-gbps", type=float, default=10.0, help="store write GB/s (default 10)")
    p.add_argument("--capacity-tb", type=float, help="store capacity in TB (default: unlimited)")
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "fp8"],
                   help="compressed entries + indexer keys (default bfloat16); SWA state stays bfloat16")
    p.add_argument("--block-tokens", type=int, help="tokens per trace block and cache block (default 512; "
                                                    "--pd: 32, as bench/goodput.py replays it)")
    p.add_argument("--periods", default="2048,8192,32768", help="periodic:P policies to compare (tokens)")
    p.add_argument("--eviction", choices=["lru", "unread-first"], default="lru",
                   help="store eviction under --capacity-tb: LRU (the store's default) or objects never read "
                        "since written first")
    p.add_argument("--limit", type=int, help="only the first N requests")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per policy (--pd: one line)")
    pd = p.add_argument_group("P/D pools (--pd)")
    pd.add_argument("--pd", action="store_true", help="size prefill and decode pools: the planner against baselines")
    pd.add_argument("--profile", help="a step-time fit (bench/pd_profile.py --json); default the built-in model's")
    pd.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    pd.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    pd.add_argument("--slo-itl-ms", type=float, default=200.0)
    pd.add_argument("--loads", default="4,8,16", help="tenants replaying the trace at once, per load (default 4,8,16)")
    pd.add_argument("--max-tokens", type=int, default=32, help="output tokens a request asks for at most")
    pd.add_argument("--duration-s", type=float, default=600.0, help="simulated seconds per load")
    pd.add_argument("--warmup-s", type=float, default=120.0, help="not scored: every policy starts at one replica")
    pd.add_argument("--interval-s", type=float, default=10.0, help="the planner's decision interval")
    pd.add_argument("--max-replicas", type=int, default=8, help="per pool")
    pd.add_argument("--max-total", type=int, default=16, help="all pools together")
    pd.add_argument("--steady-s", type=float, default=3600.0, help="the planner's steady run (turns per hour)")
    p.set_defaults(handler=run_simulate)


def layout_for(config: str, dtype: str, block_tokens: int):
    from dataclasses import replace

    from kvmesh.kvstore.policy.cost import V4_SHAPES
    from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams
    if config in V4_SHAPES:
        params = V4_SHAPES[config]
    else:
        from kvmesh.workers.model.args import ConfigError, ModelArgs
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise SimulateError(f"--config {config!r}: not {' or '.join(V4_SHAPES)}, nor an existing config file "
                                f"or checkpoint directory")
        try:
            a = ModelArgs.from_file(path)
        except ConfigError as e:
            raise SimulateError(str(e)) from None
        params = LayoutParams(a.layer_types, a.head_dim, a.index_head_dim, a.csa_ratio, a.hca_ratio,
                              a.sliding_window, rope_dim=a.rope_head_dim)
    return CacheLayout.build(replace(params, dtype="bfloat16", kv_dtype=dtype), block_tokens)


def run_simulate(args: argparse.Namespace) -> int:
    if args.pd:
        return run_pd(args)
    if not args.config:
        print("kvmesh simulate: --config is required (or --pd)", file=sys.stderr)
        return 2
    args.block_tokens = args.block_tokens or 512
    from kvmesh.kvstore.policy.cost import Hardware, policies_for, simulate
    from kvmesh.kvstore.device.layout import LayoutError
    from kvmesh.kvstore.policy.trace import TraceError, load_trace
    try:
        layout = layout_for(args.config, args.kv_cache_dtype, args.block_tokens)
        periods = [int(p) for p in args.periods.split(",") if p]
        if any(p <= 0 or p % args.block_tokens for p in periods):
            raise SimulateError(f"--periods: each must be a positive multiple of --block-tokens ({args.block_tokens})")
        if min(args.prefill_tokens_per_s, args.store_read_gbps, args.store_write_gbps) <= 0:
            raise SimulateError("--prefill-tokens-per-s and the store bandwidths must be positive")
        requests = load_trace(args.trace, args.block_tokens, limit=args.limit)
    except (SimulateError, TraceError, LayoutError, ValueError) as e:
        print(f"kvmesh simulate: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("kvmesh simulate: the trace has no requests", file=sys.stderr)
        return 2
    capacity = int(args.capacity_tb * 1e12) if args.capacity_tb else None
    hw = Hardware(args.prefill_tokens_per_s, args.store_read_gbps * 1e9, args.store_write_gbps * 1e9, capacity)
    outcomes = [simulate(requests, layout, pol, hw, unread_first=args.eviction == "unread-first")
                for pol in policies_for(args.block_tokens, periods)]
    if args.json:
        print(json.dumps([o.as_json() for o in outcomes], indent=1))
    else:
        print(format_outcomes(outcomes, args, layout))
    return 0


def format_outcomes(outcomes, args, layout) -> str:
    rows = [("policy", "stored TB", "write GB/s", "hit tokens", "recompute/hit", "TTFT mean s", "vs no reuse",
             "TTFT saved h")]
    for o in outcomes:
        mean, cold = statistics.fmean(o.ttft_s), statistics.fmean(o.cold_ttft_s)
        name = o.policy + (f" (P={o.periods[-1]})" if o.periods else "")
        rows.append((name, f"{o.bytes_stored / 1e12:.3f}", f"{o.write_bps / 1e9:.3f}",
                     f"{o.hit_tokens / o.prompt_tokens:.1%}", f"{o.recompute_tokens / max(o.hit_tokens, 1):.3f}",
                     f"{mean:.3f}", f"{mean / cold:.2f}", f"{o.ttft_saved_s / 3600:.2f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    o = outcomes[0]
    cap = f"{args.capacity_tb} TB" if args.capacity_tb else "unlimited"
    lines += ["", f"{args.config}, kv {layout.params.entry_dtype}, block {layout.block_tokens} tokens: "
              f"{o.requests:,} requests, {o.prompt_tokens:,} prompt tokens over {o.duration_s / 60:.0f} min; "
              f"prefill {args.prefill_tokens_per_s:,.0f} tok/s, store read {args.store_read_gbps} GB/s, "
              f"write {args.store_write_gbps} GB/s, capacity {cap}"
              + (f", eviction {args.eviction}" if args.capacity_tb else "")]
    return "\n".join(lines)


def run_pd(args: argparse.Namespace) -> int:
    from kvmesh.cluster.serve.pd_sim import compare
    from kvmesh.cluster.serve.planner import BUILTIN_CPU_PROFILE, Profile
    from kvmesh.kvstore.policy.trace import TraceError, load_trace
    block_tokens = args.block_tokens or 32
    try:
        if args.config:
            raise SimulateError("--config is not read with --pd: fit a model's step times with "
                                "`python bench/pd_profile.py --model DIR --json > fit.json`, then --profile fit.json")
        profile = BUILTIN_CPU_PROFILE
        if args.profile:
            try:
                profile = Profile.from_json(json.loads(Path(args.profile).read_text()))
            except (OSError, ValueError, TypeError) as e:
                raise SimulateError(f"--profile {args.profile}: {e}") from None
        loads = [int(x) for x in args.loads.split(",") if x]
        if not loads or min(loads) < 1:
            raise SimulateError("--loads: positive whole numbers of tenants, e.g. 4,8,16")
        if min(args.slo_ttft_ms, args.slo_itl_ms, args.duration_s, args.interval_s) <= 0 or args.warmup_s < 0:
            raise SimulateError("--slo-ttft-ms, --slo-itl-ms, --duration-s and --interval-s must be positive")
        if args.warmup_s >= args.duration_s:
            raise SimulateError(f"--warmup-s {args.warmup_s:g} leaves nothing of --duration-s {args.duration_s:g}")
        trace = load_trace(args.trace, block_tokens, limit=args.limit)
    except (SimulateError, TraceError, ValueError) as e:
        print(f"kvmesh simulate: {e}", file=sys.stderr)
        return 2
    if not trace:
        print("kvmesh simulate: the trace has no requests", file=sys.stderr)
        return 2
    pools = ("colocated",) if args.mode == "colocated" else ("prefill", "decode")
    out = compare(trace, profile, mode=args.mode, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_itl_s=args.slo_itl_ms / 1e3,
                  loads=loads, block_tokens=block_tokens, max_tokens=args.max_tokens, duration_s=args.duration_s,
                  warmup_s=args.warmup_s, interval_s=args.interval_s,
                  max_replicas={p: args.max_replicas for p in pools}, max_total=args.max_total,
                  steady_s=args.steady_s)
    if args.json:
        print(json.dumps(out))
    else:
        print(format_pd(out))
    return 0


def format_pd(out: dict) -> str:
    rows = [("load", "policy", "goodput / replica-s", "vs ray_default", "attainment", "mean replicas", "note")]
    for row in out["loads"]:
        ray = row["ray_default"]["goodput_per_replica_s"]
        for name in ("planner", "ray_default", "dynamo", "best_static"):
            if name not in row:
                continue
            r = row[name]
            note = (f"sizes {r['sizes']}" if "sizes" in r else
                    f"grew in {r['intervals_to_grow']} interval(s)" if r.get("intervals_to_grow") else "")
            rows.append((row["load"], name, f"{r['goodput_per_replica_s']:.3f}",
                         f"{r['goodput_per_replica_s'] / ray:.2f}x" if ray else "-", f"{r['attainment']:.3f}",
                         f"{r['mean_replicas']:.2f}", note))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) if i in (0, 1, 6) else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    o = out["optimistic_profile"]
    lines += ["", f"{out['mode']}, SLO TTFT {out['slo_ttft_ms']:g} ms / ITL {out['slo_itl_ms']:g} ms, decisions every "
              f"{out['interval_s']:g} s, {out['duration_s']:g} s per load scored after {out['warmup_s']:g} s",
              f"profile x{o['factor']:g} (too optimistic): fitted within 10% after {o['intervals']} decision(s); "
              f"planner turns per hour on a steady load: {out['steady_turns_per_hour']}"]
    return "\n".join(lines)
