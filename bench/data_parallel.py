"""`bench/engine.py --data-parallel-size N`: one replica of N ranks three ways, same run, same prompts.

    OMP_NUM_THREADS=1 python bench/engine.py --data-parallel-size 2 --concurrency 8,32 --max-tokens 16
    OMP_NUM_THREADS=1 python bench/engine.py --data-parallel-size 2 --speculative 1 --concurrency 2,16   # k = 0 vs auto
    OMP_NUM_THREADS=1 python bench/engine.py --data-parallel-size 4 --tensor-parallel-size 2 --concurrency 8
                                                                   # + DP=2 x TP=2: TP inside the DP ranks

* one process (TP=1);
* TP=N with expert parallelism: every rank holds the same cache, so the replica's KV capacity
  is one rank's budget;
* DP=N with expert parallelism: N whole attention engines, each with its own cache of the
  same budget, so the replica holds N times the KV tokens; requests spread over the ranks;
* with --tensor-parallel-size T, also DP=N/T x TP=T: N/T attention engines of T ranks each (the
  group's ranks hold copies of one cache, so N/T times one rank's KV tokens), the experts over all N.

Per size and concurrency: TTFT, decode and end-to-end tok/s (medians of --repeats), the
replica's KV capacity in tokens (all ranks' distinct blocks x block_tokens) and the peak in use
during the run, and for DP where rank 0's time goes: the MoE exchange (all-gather of hidden
states and picks with their counts + all-reduce of partial expert outputs; EXCHANGE_COLLECTIVES
per MoE layer, waiting for the slower rank included; "rows + sums" leaves out the counts'
all-gather, where a rank waits for the slower one, so it is closer to the cost of moving the
data), and the per-tick messages (rank 0's, waiting for the slowest rank's step included).
Then the exchange alone: its collectives in a loop between N processes with nothing else to do,
median per exchange at 1 and each concurrency's tokens per rank (the floor of its cost here).
Greedy tokens are compared across the three, request by request. The KV budget is
bench/engine.py's KV_CACHE_BYTES (1 GiB) per rank, as in its other modes.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from kvmesh.workers.checkpoint.default_model import ensure_default_model
from kvmesh.workers.checkpoint.sizing import attention_problems
from kvmesh.workers.engine import open_engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ModelArgs
from kvmesh.workers.model.moe import EXCHANGE_COLLECTIVES
from kvmesh.workers.parallel.collectives import Collectives, init_method
from kvmesh.workers.parallel.replica import LocalProcessLauncher

EXCHANGE_REPS = 200


def kv_tokens(engine) -> tuple[int, int]:
    """(tokens in use, capacity) of the replica's distinct KV blocks: a DP engine's ranks each
    hold their own; TP ranks hold copies of rank 0's, counted once."""
    bt = engine.config.block_tokens
    if hasattr(engine, "rank_stats"):
        stats = engine.rank_stats
        return (sum(s.total_blocks - s.free_blocks for s in stats) * bt, sum(s.total_blocks for s in stats) * bt)
    return engine.blocks.num_used * bt, engine.blocks.num_blocks * bt


def exchange_alone(rank: int, size: int, method: str, hidden: int, topk: int, tokens: list[int]) -> dict[int, float]:
    """The MoE exchange's collectives alone (no model, no other work between them), as
    MoE.exchanged runs them: counts, one byte row per token (hidden fp32 values + topk ids +
    topk weights), the all-reduce of [size * T, hidden]. Median ms per exchange at each T."""
    comm = Collectives(rank, size, method, "cpu", 60.0)
    medians = {}
    for t in tokens:
        row = torch.zeros(t, hidden * 4 + topk * 8, dtype=torch.uint8)
        times = []
        for _ in range(EXCHANGE_REPS):
            t0 = time.perf_counter()
            counts = comm.all_counts(t)
            rows = comm.all_gather_rows(row, counts)
            comm.all_reduce(torch.zeros(rows.shape[0], hidden))
            times.append(time.perf_counter() - t0)
        medians[t] = statistics.median(times) * 1e3
    comm.close()
    return medians


def time_exchange(size: int, hidden: int, topk: int, tokens: list[int]) -> dict[int, float]:
    """Rank 0's median exchange time (ms) at each T tokens per rank, ranks 1..size-1 spawned."""
    store = Collectives.host_store("127.0.0.1", size, 60.0)
    method = init_method("127.0.0.1", store)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=exchange_alone, args=(r, size, method, hidden, topk, tokens), daemon=True)
             for r in range(1, size)]
    for p in procs:
        p.start()
    comm0 = exchange_alone(0, size, method, hidden, topk, tokens)
    for p in procs:
        p.join(timeout=30)
    return comm0


def splittable(model_dir: Path, size: int, out: Path) -> Path:
    """`model_dir` when TP=size splits its attention; else a random checkpoint of its config with
    o_groups = size (the built-in model has 2 output groups, which TP=4 cannot split), written
    once with transformers (same shapes and costs but the output projection's grouping; random
    weights: this measures speed, and the greedy tokens are still compared across the setups)."""
    args = ModelArgs.from_file(model_dir / "config.json")
    if not attention_problems(args, size):
        return model_dir
    target = out / f"o_groups{size}"
    if not (target / "model.safetensors").is_file():
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        cfg = {**json.loads((model_dir / "config.json").read_text()), "o_groups": size}
        torch.manual_seed(0)
        DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).to(torch.float32).save_pretrained(target)
        for f in model_dir.glob("tokenizer*.json"):
            shutil.copy(f, target / f.name)
    print(f"{model_dir} has o_groups {args.o_groups}, which TP={size} cannot split: all setups run {target} "
          f"(its config with o_groups {size}, random weights)", file=sys.stderr)
    return target


def replicas(size: int, tp: int = 1) -> dict[str, dict]:
    """The setups compared: one process, TP=size+EP, DP=size+EP and (tp > 1) DP=size/tp x TP=tp+EP."""
    out = {"TP=1": dict(), f"TP={size}+EP": dict(tensor_parallel_size=size, enable_expert_parallel=True),
           f"DP={size}+EP": dict(data_parallel_size=size, enable_expert_parallel=True)}
    if tp > 1:
        if size % tp or size == tp:
            raise SystemExit(f"--tensor-parallel-size {tp} must divide --data-parallel-size {size} and be smaller")
        out[f"DP={size // tp} x TP={tp}+EP"] = dict(data_parallel_size=size // tp, tensor_parallel_size=tp,
                                                  enable_expert_parallel=True)
    return out


def rank0_stats(engine) -> dict:
    """Rank 0's collective and message counters: a DP x TP replica's exchange runs on its expert
    group (the DP group carries the ticks and the step flags)."""
    ranks = getattr(getattr(engine, "local", None), "ranks", None)
    if ranks is None or ranks.experts is None:
        comm = engine.comm if hasattr(engine, "comm") else engine.model.shard.comm
        return dict(comm.stats)
    stats = dict(ranks.experts.stats)
    stats.update({k: v for k, v in engine.comm.stats.items() if k.startswith("message")})
    stats["collectives"] += engine.comm.stats["collectives"]       # the step flags, as a DP replica counts them
    return stats


def dp_main(args, levels: list[int], size: int, run_kvmesh, make_prompts, median_run,
            kv_cache_bytes: int, warmup_seed: int, tp: int = 1) -> int:
    model_dir = Path(args.model) if args.model else ensure_default_model()
    model_dir = splittable(model_dir, size, Path(args.out).parent)
    setups = replicas(size, tp)
    rows, raw, tokens = [], [], {}
    for name, kw in setups.items():
        engine = open_engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(levels),
                                          max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=kv_cache_bytes,
                                          prefix_reuse=False, **kw),
                             launcher=LocalProcessLauncher(args.threads))
        layers = engine.args.num_hidden_layers
        try:
            run_kvmesh(engine, make_prompts(max(levels), args.prompt_len, engine.args.vocab_size, warmup_seed),
                       args.max_tokens)
            for i, c in enumerate(levels):
                runs = []
                for rep in range(args.repeats):
                    before = rank0_stats(engine)
                    peak = [0]
                    k, k_tokens = run_kvmesh(engine, make_prompts(c, args.prompt_len, engine.args.vocab_size,
                                                                  seed=1000 * i + rep), args.max_tokens,
                                             on_step=lambda: peak.__setitem__(0, max(peak[0], kv_tokens(engine)[0])))
                    after = rank0_stats(engine)
                    delta = {key: after[key] - before[key] for key in before}
                    runs.append((k, delta, peak[0]))
                    tokens.setdefault((c, rep), {})[name] = k_tokens
                    print(f"{name} c={c} #{rep}: {k.wall_s:.2f}s", file=sys.stderr)
                k = median_run([r[0] for r in runs])
                mid = sorted(runs, key=lambda r: r[0].wall_s)[len(runs) // 2]
                rows.append((name, c, k, mid[1], mid[2], kv_tokens(engine)[1], layers))
                raw.append({"setup": name, "concurrency": c, "capacity_tokens": kv_tokens(engine)[1],
                            "runs": [{**r[0].__dict__, **r[1], "peak_kv_tokens": r[2]} for r in runs]})
        finally:
            engine.close()
    same = sum(len({str(v) for v in by.values()}) == 1 for by in tokens.values())
    print(f"model: {model_dir}, fp32; prompt {args.prompt_len}, max_tokens {args.max_tokens}; torch threads "
          f"{args.threads} per rank; KV budget {kv_cache_bytes / 2**30:g} GiB per rank; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min); greedy tokens equal across the "
          f"{len(setups)} in {same}/{len(tokens)} runs\n")
    print("| replica | c | TTFT ms | decode tok/s | e2e tok/s | KV capacity (tokens) | peak KV in use (tokens) | "
          "MoE exchange ms / layer | of which rows + sums ms | exchange share of wall | tick messages ms / tick |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, c, k, d, peak, capacity, layers in rows:
        ticks = d["messages"] / 2 if name.startswith("DP") else 0
        exchanges = (d["collectives"] - ticks) / EXCHANGE_COLLECTIVES if ticks else 0   # + one step flag a tick
        per_layer = f"{d['collective_s'] / exchanges * 1e3:.2f}" if exchanges else "-"
        moved = f"{(d['collective_s'] - d['counts_s']) / exchanges * 1e3:.2f}" if exchanges else "-"
        share = f"{d['collective_s'] / k.wall_s:.0%}" if exchanges else "-"
        per_tick = f"{d['message_s'] / ticks * 1e3:.2f}" if ticks else "-"
        print(f"| {name} | {c} | {k.ttft_mean_s * 1e3:.0f} | {k.decode_tok_s:.1f} | {k.e2e_tok_s:.1f} | "
              f"{capacity:,} | {peak:,} | {per_layer} | {moved} | {share} | {per_tick} |")
    a = ModelArgs.from_file(model_dir / "config.json")
    alone = time_exchange(size, a.hidden_size, a.num_experts_per_tok, sorted({1, *levels}))
    print(f"\nthe exchange alone (its {EXCHANGE_COLLECTIVES} collectives, gloo, {size} processes, hidden "
          f"{a.hidden_size} fp32, no model work between them), median of {EXCHANGE_REPS}: "
          + ", ".join(f"{t} token(s) per rank {ms:.2f} ms" for t, ms in alone.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                               "threads_per_rank": args.threads, "load_average": os.getloadavg(),
                               "moe_layers": rows[0][6] if rows else 0, "runs": raw,
                               "exchange_alone_ms": alone}, indent=2))
    print(f"\nwrote {out}")
    return 0


# ---- with and without speculation (--data-parallel-size N --speculative K) ---------------------------
SPEC_KV_BYTES = 128 << 20      # per rank: the openings and their tokens fit many times over


def drafted(engine) -> list[tuple[int, int]]:
    """Each rank's (draft tokens, accepted) so far (a TP replica: rank 0's, for all)."""
    return [(s.counters.draft_tokens, s.counters.accepted_draft_tokens) for s in engine.rank_stats]


def spec_main(args, levels: list[int], size: int, run_kvmesh, openings: tuple[str, ...], median_run) -> int:
    """TP=1, TP=N+EP and DP=N+EP, each without drafts (k = 0) and as served by default (the MTP
    layer, speculative_tokens auto): per replica both engines are open at once and every round
    runs them in turn (the order alternating), so load hits both alike; medians shown. The
    prompts are the corpus-style openings (bench/engine.py --speculative); greedy tokens are
    compared with TP=1, request by request."""
    model_dir = Path(args.model) if args.model else ensure_default_model()
    setups = {"TP=1": dict(), f"TP={size}+EP": dict(tensor_parallel_size=size, enable_expert_parallel=True),
              f"DP={size}+EP": dict(data_parallel_size=size, enable_expert_parallel=True)}
    lines, tokens, equal = [], {}, {}
    for name, kw in setups.items():
        engines = {k: open_engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(levels),
                                               max_batched_tokens=args.max_batched_tokens,
                                               kv_cache_bytes=SPEC_KV_BYTES, prefix_reuse=False,
                                               speculative_tokens=k, **kw),
                                  launcher=LocalProcessLauncher(args.threads)) for k in (0, None)}
        try:
            for engine in engines.values():
                run_kvmesh(engine, [engine.tokenizer.encode(o) for o in openings[:max(levels)]], args.max_tokens)  # warm-up
            for c in levels:
                runs = {k: [] for k in engines}
                for rep in range(args.repeats):
                    prompts = [engines[0].tokenizer.encode(openings[(i + rep) % len(openings)]) for i in range(c)]
                    for k in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                        before = drafted(engines[k])
                        result, out = run_kvmesh(engines[k], prompts, args.max_tokens)
                        runs[k].append((result, [(d - d0, a - a0) for (d, a), (d0, a0) in zip(drafted(engines[k]),
                                                                                               before)]))
                        ref = tokens.setdefault((c, rep), out)       # TP=1 runs first
                        equal[name, c, k] = equal.get((name, c, k), 0) + sum(x == y for x, y in zip(out, ref))
                        print(f"{name} k={k} c={c} #{rep}: {result.wall_s:.2f}s", file=sys.stderr)
                base = median_run([r for r, _ in runs[0]])
                for k, rs in runs.items():
                    m = median_run([r for r, _ in rs])
                    per_rank = [tuple(map(sum, zip(*(d[r] for _, d in rs)))) for r in range(len(rs[0][1]))]
                    accept = " / ".join(f"{a / d:.2f}" if d else "-" for d, a in per_rank) if k is None else "-"
                    lines.append(f"| {name} | {c} | {'auto' if k is None else k} | {m.ttft_mean_s * 1e3:.0f} | "
                                 f"{m.decode_tok_s:.1f} | {m.e2e_tok_s:.1f} | {m.e2e_tok_s / base.e2e_tok_s:.2f}x | "
                                 f"{accept} | {equal[name, c, k]}/{c * args.repeats} |")
        finally:
            for engine in engines.values():
                engine.close()
    print(f"model: {model_dir}, fp32; openings, max_tokens {args.max_tokens}, greedy; torch threads {args.threads} "
          f"per rank; medians of {args.repeats} rounds; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)\n")
    print("| replica | c | k | TTFT ms | decode tok/s | e2e tok/s | e2e vs k=0 | acceptance per rank | "
          "greedy equal to TP=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0
