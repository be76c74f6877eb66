"""A flood of slow schemas and the ones behind it: how long a mid-size and a small schema wait.

    python bench/grammar_flood.py [--slow 10] [--slow-properties 600] [--mid-properties 120,200]
                                  [--workers N] [--budget-s 10]

One GuideCompiler on the built-in model's tokenizer, as a worker builds it (EngineConfig's
grammar limits: --workers compiler processes, default the CPUs at most 4; --budget-s per
compile). Each schema is an object of N required string properties with distinct names (no
cache hits). First, alone: each mid-size schema's compile time. Then the flood: --slow
schemas of --slow-properties are submitted at once, and 0.5 s later one mid-size schema of each
size and one small one; printed: the time from its submission to its grammar for each, beside
its time alone, and how many slow ones had ended by then. Runs on an older checkout too (copy
it and bench/tool_call.py there; the slice of issue 48 item 2 is then absent). Prints the load
average beside the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvmesh  # noqa: E402
from kvmesh.workers.checkpoint.default_model import ensure_default_model  # noqa: E402
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from kvmesh.workers.sampling import compile_pool  # noqa: E402
from kvmesh.workers.sampling.grammar import GrammarLimits, GuideCompiler  # noqa: E402


def schema(n: int, tag: str) -> str:
    return json.dumps({"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)},
                       "required": [f"{tag}_{i}" for i in range(n)]}, sort_keys=True)


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(compiler: GuideCompiler, text: str, timeout_s: float = 600) -> tuple[float, str]:
    t = time.monotonic()
    try:
        compiler.compile_async(("json_schema", text)).result(timeout=timeout_s)
        return time.monotonic() - t, "ok"
    except Exception as e:
        return time.monotonic() - t, type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow", type=int, default=10)
    parser.add_argument("--slow-properties", type=int, default=600)
    parser.add_argument("--mid-properties", default="120,200")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    tok = load_tokenizer(ensure_default_model())
    limits = GrammarLimits(compile_timeout_s=args.budget_s, compile_workers=args.workers)
    compiler = GuideCompiler(tok, tok.vocab_size, list(tok.stop_token_ids), limits)
    sliced = getattr(compile_pool, "SLICE_S", None)
    print(f"kvmesh from {os.path.dirname(kvmesh.__file__)}; slice {sliced} s; load average {load()}")
    try:
        timed(compiler, schema(3, "warm"))                                  # children up, tokenizer info built
        workers = compiler._pool.size
        mids = [int(n) for n in args.mid_properties.split(",")]
        alone = {n: timed(compiler, schema(n, f"alone{n}"))[0] for n in mids}
        slow_text = schema(args.slow_properties, "slow0")
        print(f"{workers} compiler processes, budget {args.budget_s:g} s; slow schema {len(slow_text):,} bytes; "
              + ", ".join(f"{n} properties {len(schema(n, 'x')):,} bytes" for n in mids))
        slow = [compiler.compile_async(("json_schema", schema(args.slow_properties, f"slow{i}")))
                for i in range(args.slow)]
        time.sleep(0.5)
        from concurrent.futures import ThreadPoolExecutor
        def behind(text: str) -> tuple[float, str, int]:      # and how many slow ones had ended then
            return (*timed(compiler, text), sum(f.done() for f in slow))
        with ThreadPoolExecutor(len(mids) + 1) as pool:
            waits = {n: pool.submit(behind, schema(n, f"behind{n}")) for n in mids}
            small = pool.submit(behind, schema(3, "small"))
            rows = [(f"{n} properties", alone[n], *waits[n].result()) for n in mids]
            rows.append(("3 properties (small)", None, *small.result()))
        for f in slow:
            try:
                f.result(timeout=600)
            except Exception:
                pass
        stats = compiler.stats()
    finally:
        compiler.close()
    print(f"\n| schema behind {args.slow} slow ones | alone s | behind them s | result | slow ones ended by then |")
    print("|---|---:|---:|---|---:|")
    for name, a, took, result, ended in rows:
        print(f"| {name} | {'-' if a is None else f'{a:.2f}'} | {took:.2f} | {result} | {ended} |")
    print(f"\ncompiles {stats.compiles}, budget kills {stats.budget_kills}, "
          f"preempted {getattr(stats, 'preempted', '-')}; load average {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
