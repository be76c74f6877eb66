"""`bench/engine.py --data-parallel-size N`: one replica of N ranks three ways, same run, same prompts.

    OMP_NUM_THREADS=1 python bench/engine.py --data-parallel-size 2 --concurrency 8,32 --max-tokens 16

* one process (TP=1);
* TP=N with expert parallelism: every rank holds the same cache, so the replica's KV capacity
  is one rank's budget;
* DP=N with expert parallelism: N whole attention engines, each with its own cache of the
  same budget, so the replica holds N times the KV tokens; requests spread over the ranks.

Per size and concurrency: TTFT, decode and end-to-end tok/s (medians of --repeats), the
replica's KV capacity in tokens (all ranks' distinct blocks x block_tokens) and the peak in use
during the run, and for DP where rank 0's time goes: the MoE exchange (all-gather of hidden
states and picks with their counts + all-reduce of partial expert outputs; EXCHANGE_COLLECTIVES
per MoE layer, waiting for the slower rank included; "rows + sums" leaves out the counts'
all-gather, where a rank waits for the slower one, so it is closer to the cost of moving the
data), and the per-tick messages (rank 0's, waiting for the slowest rank's step included).
Greedy tokens are compared across the three, request by request. The KV budget is
bench/engine.py's KV_CACHE_BYTES (1 GiB) per rank, as in its other modes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from workers.checkpoint.default_model import ensure_default_model
from workers.engine import open_engine
from workers.engine.dp_rank import run_dp_rank
from workers.engine_config import EngineConfig
from workers.model.moe import EXCHANGE_COLLECTIVES
from workers.parallel.replica import LocalProcessLauncher


def kv_tokens(engine) -> tuple[int, int]:
    """(tokens in use, capacity) of the replica's distinct KV blocks: a DP engine's ranks each
    hold their own; TP ranks hold copies of rank 0's, counted once."""
    bt = engine.config.block_tokens
    if hasattr(engine, "rank_stats"):
        stats = engine.rank_stats
        return (sum(s.total_blocks - s.free_blocks for s in stats) * bt, sum(s.total_blocks for s in stats) * bt)
    return engine.blocks.num_used * bt, engine.blocks.num_blocks * bt


def dp_main(args, levels: list[int], size: int, run_kvmesh, make_prompts, median_run,
            kv_cache_bytes: int, warmup_seed: int) -> int:
    model_dir = Path(args.model) if args.model else ensure_default_model()
    setups = {"TP=1": dict(), f"TP={size}+EP": dict(tensor_parallel_size=size, enable_expert_parallel=True),
              f"DP={size}+EP": dict(data_parallel_size=size, enable_expert_parallel=True)}
    rows, raw, tokens = [], [], {}
    for name, kw in setups.items():
        main = run_dp_rank if kw.get("data_parallel_size") else None
        engine = open_engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(levels),
                                          max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=kv_cache_bytes,
                                          prefix_reuse=False, **kw),
                             launcher=LocalProcessLauncher(args.threads, main=main))
        comm = engine.comm if hasattr(engine, "comm") else engine.model.shard.comm
        layers = engine.args.num_hidden_layers
        try:
            run_kvmesh(engine, make_prompts(max(levels), args.prompt_len, engine.args.vocab_size, warmup_seed),
                       args.max_tokens)
            for i, c in enumerate(levels):
                runs = []
                for rep in range(args.repeats):
                    before = dict(comm.stats)
                    peak = [0]
                    k, k_tokens = run_kvmesh(engine, make_prompts(c, args.prompt_len, engine.args.vocab_size,
                                                                  seed=1000 * i + rep), args.max_tokens,
                                             on_step=lambda: peak.__setitem__(0, max(peak[0], kv_tokens(engine)[0])))
                    delta = {key: comm.stats[key] - before[key] for key in before}
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
          f"three in {same}/{len(tokens)} runs\n")
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                               "threads_per_rank": args.threads, "load_average": os.getloadavg(),
                               "moe_layers": rows[0][6] if rows else 0, "runs": raw}, indent=2))
    print(f"\nwrote {out}")
    return 0
