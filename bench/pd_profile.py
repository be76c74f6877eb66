"""Fit the step-time profile the P/D planner and `kvmesh simulate --pd` start from (issue 46 items 2-3).

    python bench/pd_profile.py [--model DIR] [--repeats 5] [--json]

Runs the synchronous Engine (the built-in model unless --model; the pools' engine settings of
tests/local_serve.small_config: max_batched_tokens 512, max_num_seqs 8, no drafts, no prefix
reuse) and fits, by least squares on the median of --repeats runs of each point:

  * prefill: the time of a step that computes n prompt tokens of one request (n = 32 ... 512,
    and the later chunks of a 1,536-token prompt): step_s = prefill_step_s + n * prefill_token_s
  * decode: a step of B sequences holding K KV tokens in all (B = 1 ... 8, contexts 32 ... 1,024):
    step_s = decode_step_s + B * decode_seq_s + K * decode_kv_token_s

and prints a table of measured against fitted, the load average beside it, and the profile's
fields (--json: the profile alone, one line) -- what `cluster/serve/planner.py`'s
BUILTIN_CPU_PROFILE holds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kvmesh.workers.checkpoint.default_model import ensure_default_model  # noqa: E402
from kvmesh.workers.engine import Engine  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

CHUNK, SEQS = 512, 8


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = np.random.default_rng(seed)
    return g.integers(3, vocab, n).tolist()


def prefill_points(engine: Engine, repeats: int, vocab: int) -> list[tuple[int, float]]:
    """(tokens computed in the step, seconds) for single-request prefill steps."""
    pts, seed = [], 1000
    for n in (32, 64, 128, 256, 384, 512, 1536):
        times: dict[int, list[float]] = {}
        for _ in range(repeats):
            seed += 1
            engine.add_request(f"p{seed}", prompt(n, vocab, seed), SamplingParams(max_tokens=1, ignore_eos=True))
            done = 0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                k = min(CHUNK, n - done)
                times.setdefault(k, []).append(time.perf_counter() - t0)
                done += k
        pts += [(k, statistics.median(v)) for k, v in times.items()]
    return pts


def decode_points(engine: Engine, repeats: int, vocab: int) -> list[tuple[int, int, float]]:
    """(batch, KV tokens of the batch, seconds): the median of the steps after every request of the
    batch has its first token (no prompt left to compute), per batch size and context."""
    pts, seed = [], 5000
    for ctx in (32, 256, 1024):
        for b in (1, 2, 4, 8):
            samples: list[tuple[int, float]] = []
            for _ in range(max(1, repeats // 2)):
                seed += 1
                params = SamplingParams(max_tokens=12 + 2 * (b * ctx // CHUNK + 1), ignore_eos=True)
                for i in range(b):
                    engine.add_request(f"d{seed}-{i}", prompt(ctx, vocab, seed * 16 + i), params)
                lengths: dict[str, int] = {}
                while engine.has_unfinished():
                    prefilled = len(lengths) == b
                    t0 = time.perf_counter()
                    outs = engine.step()
                    dt = time.perf_counter() - t0
                    if prefilled and len(outs) == b:
                        samples.append((sum(ctx + n for n in lengths.values()), dt))
                    for o in outs:
                        lengths[o.request_id] = len(o.token_ids)
            if not samples:
                raise RuntimeError(f"no decode step with all {b} sequences of {ctx} tokens (KV too small?)")
            pts.append((b, int(statistics.median(k for k, _ in samples)), statistics.median(t for _, t in samples)))
    return pts


def fit(pre, dec) -> dict:
    a = np.array([[1.0, n] for n, _ in pre])
    (p0, p1), *_ = np.linalg.lstsq(a, np.array([t for _, t in pre]), rcond=None)
    d = np.array([[1.0, b, k] for b, k, _ in dec])
    (d0, d1, d2), *_ = np.linalg.lstsq(d, np.array([t for *_, t in dec]), rcond=None)
    return {"prefill_step_s": round(max(p0, 0.0), 6), "prefill_token_s": round(max(p1, 1e-9), 9),
            "decode_step_s": round(max(d0, 0.0), 6), "decode_seq_s": round(max(d1, 0.0), 6),
            "decode_kv_token_s": round(max(d2, 0.0), 10), "max_batched_tokens": CHUNK, "max_num_seqs": SEQS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    model = Path(a.model) if a.model else ensure_default_model()
    engine = Engine(EngineConfig(model=str(model), max_batched_tokens=CHUNK, max_num_seqs=SEQS,
                                 kv_cache_bytes=256 << 20, prefix_reuse=False, speculative_tokens=0))
    vocab = engine.args.vocab_size
    prefill_points(engine, 1, vocab)            # warm-up
    pre, dec = prefill_points(engine, a.repeats, vocab), decode_points(engine, a.repeats, vocab)
    prof = fit(pre, dec)
    if a.json:
        print(json.dumps(prof))
        return 0
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("prefill step: tokens | measured ms | fitted ms")
    for n, t in pre:
        print(f"  {n:5d} | {t * 1e3:7.2f} | {(prof['prefill_step_s'] + n * prof['prefill_token_s']) * 1e3:7.2f}")
    print("decode step: batch | KV tokens | measured ms | fitted ms")
    for b, k, t in dec:
        f = prof["decode_step_s"] + b * prof["decode_seq_s"] + k * prof["decode_kv_token_s"]
        print(f"  {b:3d} | {k:6d} | {t * 1e3:7.2f} | {f * 1e3:7.2f}")
    print(json.dumps(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
