"""EPLB on a DP + EP replica: per-rank expert load before and after rebalancing, on a skewed workload.

    OMP_NUM_THREADS=1 python bench/eplb.py [--data-parallel-size 2] [--redundant 2] [--concurrency 16]
                                           [--prompt-len 64] [--max-tokens 32] [--workloads skewed,uniform]

Workloads (same prompts for every engine of a workload):
* skewed: prompts drawn from the --skew-tokens token ids whose routing puts the largest share of
  picks on one rank's static block of experts (rank r: experts [r*E/N, (r+1)*E/N); the rank whose
  top tokens concentrate most), found by a calibration pass of a one-process engine with hooks on
  every MoE gate (each candidate token repeated, prefilled);
* uniform: random token ids (bench/engine.py's make_prompts).

Per workload, three DP=N+EP engines side by side (prefix reuse off, so a repeated run is the same
work), each running the workload once as warm-up, then --repeats rounds of one run per engine,
interleaved (speeds: the median run by e2e tok/s; imbalance: over all measured steps):
* no EPLB: the baseline for speed and for the greedy tokens;
* EPLB counting only (R redundant experts, never rebalanced: step_interval past the run): the
  imbalance "before" (its redundant slots hold copies of each rank's own experts, so the load per
  rank is the static split's);
* EPLB rebalancing at the end of every run (step_interval = one run's steps): the measured runs
  are the imbalance "after" (each rebalance, at a run's last step, is inside that run's wall time).
The fastest decode step (all requests decoding, over the measured runs) is the least disturbed by a
busy neighbour. Imbalance is EPLB's metric (`kvmesh_worker_eplb_imbalance`): max / mean tokens (picks) per rank,
averaged over the MoE layers, here over exactly the measured run's steps (rank 0's counts; every
rank counts the same). "static split" is the same picks as the split without EPLB would place them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine import KV_CACHE_BYTES, make_prompts, run_kvmesh  # noqa: E402
from kvmesh.workers.checkpoint.default_model import ensure_default_model  # noqa: E402
from kvmesh.workers.engine import Engine, open_engine  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.parallel.eplb import imbalance  # noqa: E402
from kvmesh.workers.parallel.replica import LocalProcessLauncher  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

CANDIDATES = 256          # token ids scored in the calibration pass
CALIBRATION_LEN = 16      # each candidate repeated this many times


def rank_shares(model_dir: Path, size: int) -> dict[int, torch.Tensor]:
    """Candidate token id -> the share of its picks (every MoE layer, CALIBRATION_LEN repeats)
    on each rank's static block of experts [N], from a one-process engine's gates."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", prefix_reuse=False, speculative_tokens=0,
                                 max_num_seqs=CANDIDATES, max_batched_tokens=CANDIDATES * CALIBRATION_LEN))
    block = engine.args.n_routed_experts // size
    g = torch.Generator().manual_seed(7)
    tokens = torch.randperm(engine.args.vocab_size - 3, generator=g)[:CANDIDATES].add(3).tolist()
    picks: list[torch.Tensor] = []
    hooks = [layer.ffn.gate.register_forward_hook(lambda m, i, out: picks.append(out[1].clone()))
             for layer in engine.model.layers]
    try:
        engine.generate([[t] * CALIBRATION_LEN for t in tokens], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    rows = torch.stack([p for p in picks if p.shape[0] == CANDIDATES * CALIBRATION_LEN])   # the prefill step
    ranks = torch.nn.functional.one_hot(rows // block, size).float()              # [layers, T, K, N]
    share = ranks.mean((0, 2)).view(CANDIDATES, CALIBRATION_LEN, size).mean(1)
    return dict(zip(tokens, share))


def skewed_prompts(shares: dict[int, torch.Tensor], n: int, length: int, top: int, seed: int
                   ) -> tuple[list[list[int]], int, float]:
    """Prompts from the `top` tokens most concentrated on one rank; (prompts, that rank, their mean share)."""
    best = max(range(len(next(iter(shares.values())))),
               key=lambda r: sum(sorted((s[r].item() for s in shares.values()), reverse=True)[:top]))
    hot = sorted(shares, key=lambda t: -shares[t][best].item())[:top]
    g = torch.Generator().manual_seed(seed)
    prompts = [[hot[i] for i in torch.randint(0, top, (length,), generator=g).tolist()] for _ in range(n)]
    return prompts, best, sum(shares[t][best].item() for t in hot) / top


def open_setup(model_dir: Path, args, concurrency: int, eplb: dict | None):
    kw = dict(enable_eplb=True, eplb_config=eplb) if eplb else {}
    return open_engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=concurrency,
                                    max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=KV_CACHE_BYTES,
                                    prefix_reuse=False, speculative_tokens=0,
                                    data_parallel_size=args.data_parallel_size, enable_expert_parallel=True, **kw),
                       launcher=LocalProcessLauncher(args.threads))


def measure(engines: dict, args, prompts: list[list[int]]) -> dict[str, dict]:
    """Each engine's first run (warm-up), then --repeats rounds of one measured run per engine,
    interleaved (a neighbour's load lands on all three alike); speeds: the median run by e2e tok/s."""
    starts, runs = {}, {name: [] for name in engines}
    for name, engine in engines.items():
        run_kvmesh(engine, prompts, args.max_tokens)
        starts[name] = engine.local.balancer.steps if engine.local.balancer is not None else 0
    for _ in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(run_kvmesh(engine, prompts, args.max_tokens))
    out = {}
    for name, engine in engines.items():
        done = runs[name]
        mid = sorted(done, key=lambda r: r[0].e2e_tok_s)[len(done) // 2][0]
        r = {"run": mid.__dict__, "runs": [x[0].__dict__ for x in done], "tokens": done[0][1],
             "same_each_run": all(x[1] == done[0][1] for x in done)}
        bal, start = engine.local.balancer, starts[name]
        if bal is not None:
            end = bal.steps
            assert end <= bal.settings.window_size, "window too small to hold the runs"
            r.update(first_run_steps=start, measured_steps=end - start, rebalances=bal.rebalances,
                     moved_experts=engine.stats().eplb.moved_experts, rebalance_s=bal.rebalance_s,
                     imbalance=imbalance(bal.placed[start:end].sum(0)),
                     imbalance_static=imbalance(bal.static[start:end].sum(0)))
        out[name] = r
    return out


def one_run_steps(model_dir: Path, args, prompts: list[list[int]], eplb: dict) -> int:
    """Counted steps of one run of `prompts` (the rebalancing engine's step_interval)."""
    engine = open_setup(model_dir, args, len(prompts), eplb)
    try:
        run_kvmesh(engine, prompts, args.max_tokens)
        return engine.local.balancer.steps
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--redundant", type=int, default=2, help="num_redundant_experts (a multiple of the DP size)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--skew-tokens", type=int, default=8, help="distinct token ids the skewed prompts draw from")
    p.add_argument("--workloads", default="skewed,uniform")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per engine after the first; medians")
    p.add_argument("--out", default="bench/out/eplb.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    shares = rank_shares(model_dir, args.data_parallel_size)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rows, raw = [], {}
    for workload in args.workloads.split(","):
        if workload == "skewed":
            prompts, hot, share = skewed_prompts(shares, args.concurrency, args.prompt_len, args.skew_tokens, seed=1)
            print(f"skewed: {args.skew_tokens} token ids with {share:.0%} of their picks on rank {hot}'s experts "
                  f"(calibration prefill)", file=sys.stderr)
        else:
            prompts = make_prompts(args.concurrency, args.prompt_len, vocab, seed=1)
        t0 = time.perf_counter()
        counting = dict(num_redundant_experts=args.redundant, window_size=1 << 16, step_interval=1 << 30)
        n = one_run_steps(model_dir, args, prompts, counting)
        setups = {"no_eplb": None, "eplb_counting": counting,
                  "eplb_rebalanced": dict(num_redundant_experts=args.redundant, window_size=(args.repeats + 2) * n,
                                          step_interval=n)}
        engines = {}
        try:
            for name, eplb in setups.items():
                engines[name] = open_setup(model_dir, args, len(prompts), eplb)
            got = measure(engines, args, prompts)
        finally:
            for engine in engines.values():
                engine.close()
        plain, counting, balanced = got["no_eplb"], got["eplb_counting"], got["eplb_rebalanced"]
        print(f"{workload}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        raw[workload] = got
        for name, r in (("no EPLB", plain), ("EPLB, before (counting only)", counting),
                        ("EPLB, rebalancing", balanced)):
            rows.append((workload, name, r, r["tokens"] == plain["tokens"] and r["same_each_run"]))
    load = os.getloadavg()
    print(f"\nmodel: {model_dir}, fp32; DP={args.data_parallel_size}+EP (gloo, {args.threads} thread per rank), "
          f"R={args.redundant} redundant experts; {args.concurrency} prompts of {args.prompt_len} tokens, "
          f"max_tokens {args.max_tokens}, greedy; medians of {args.repeats} runs; load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} "
          f"(1, 5, 15 min)\n")
    print("| workload | setup | imbalance, static split | imbalance as placed | rebalances | experts moved "
          "| rebalance ms | decode tok/s | e2e tok/s | e2e vs no EPLB | fastest decode step ms | greedy = no EPLB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, name, r, same in rows:
        base = next(x for w, n_, x, _ in rows if w == workload and n_ == "no EPLB")["run"]
        eplb = ([f"{r['imbalance_static']:.3f}", f"{r['imbalance']:.3f}", str(r["rebalances"]), str(r["moved_experts"]),
                 f"{r['rebalance_s'] * 1e3:.0f}"] if "imbalance" in r else ["-"] * 5)
        run = r["run"]
        print(f"| {workload} | {name} | {' | '.join(eplb)} | {run['decode_tok_s']:.1f} | {run['e2e_tok_s']:.1f} | "
              f"{run['e2e_tok_s'] / base['e2e_tok_s']:.2f} | {min(x['step_min_ms'] for x in r['runs']):.1f} | "
              f"{'yes' if same else 'NO'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_average": load,
                               "runs": {w: {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                            for k, v in by.items()} for w, by in raw.items()}}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
