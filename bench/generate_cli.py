"""`kvmesh generate` as a user runs it: the default (MTP speculation, `auto`) against
`--speculative-tokens 0`, wall time of the whole command, start-up included.

    python bench/generate_cli.py                                   # one process, 8 x 512 tokens
    python bench/generate_cli.py --max-tokens 160 --rounds 3
    python bench/generate_cli.py --engine-args "--data-parallel-size 2 --enable-expert-parallel" \
                                 --prompts 2 --max-num-seqs 1

Each round runs the two commands in turn (the order alternating between rounds) on one JSONL
file: the first `--prompts` English openings of bench/engine.py (the built-in model's own text
follows them), greedy, `ignore_eos`, `--max-tokens` each, `--max-num-seqs` sequences at a time per
engine (1: one request at a time, the latency case). Reported per round: each command's wall
time, the speed-up (k = 0's time / the default's), the drafts `kvmesh generate` reports and
whether every line's tokens are equal; then the median speed-up. The load average is printed
beside each round: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import OPENINGS  # noqa: E402

DRAFTS = re.compile(r"speculative decoding: (\d+) draft tokens, (\d+)% accepted")


def write_requests(path: Path, prompts: int, max_tokens: int) -> None:
    lines = [{"id": f"r{i}", "prompt": OPENINGS[i % len(OPENINGS)], "max_tokens": max_tokens,
              "temperature": 0, "ignore_eos": True} for i in range(prompts)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def run_generate(requests: Path, engine_args: list[str]) -> tuple[float, dict[str, list[int]], str]:
    """(wall seconds, id -> token ids, the drafts line or '-') of one `kvmesh generate`."""
    cmd = [sys.executable, "-m", "kvmesh.cluster.cli", "generate", "--input", str(requests), *engine_args]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    tokens = {r["id"]: r["token_ids"] for r in map(json.loads, done.stdout.splitlines())}
    drafts = DRAFTS.search(done.stderr)
    return wall, tokens, f"{drafts[1]} ({drafts[2]}%)" if drafts else "-"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engine-args", default="", help="more `kvmesh generate` flags, for both commands")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    base = ["--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.engine_args)]
    commands = {"default": base, "k=0": [*base, "--speculative-tokens", "0"]}
    rows, speedups = [], []
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.jsonl"
        write_requests(requests, args.prompts, args.max_tokens)
        for r in range(args.rounds):
            before = load()
            order = list(commands) if r % 2 == 0 else list(reversed(commands))
            runs = {name: run_generate(requests, commands[name]) for name in order}
            (t_spec, tok_spec, drafts), (t_plain, tok_plain, _) = runs["default"], runs["k=0"]
            equal = sum(tok_spec[i] == tok_plain[i] for i in tok_plain)
            speedups.append(t_plain / t_spec)
            rows.append((r + 1, t_spec, t_plain, speedups[-1], drafts, equal, len(tok_plain), before, load()))
    median = statistics.median(speedups)
    if args.json:
        print(json.dumps({"engine_args": args.engine_args, "prompts": args.prompts, "max_tokens": args.max_tokens,
                          "max_num_seqs": args.max_num_seqs, "speedups": speedups, "median_speedup": median,
                          "greedy_equal": all(row[5] == row[6] for row in rows),
                          "load_average": os.getloadavg()}))
        return 0
    print(f"kvmesh generate {shlex.join(base)}: {args.prompts} prompts x {args.max_tokens} tokens, "
          f"default vs --speculative-tokens 0, wall time of the whole command\n")
    print("| round | default s | k=0 s | speed-up | drafts (accepted) | greedy equal | load before | load after |")
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for rnd, t_spec, t_plain, speedup, drafts, equal, lines, before, after in rows:
        print(f"| {rnd} | {t_spec:.2f} | {t_plain:.2f} | {speedup:.2f}x | {drafts} | {equal}/{lines} | {before} | {after} |")
    print(f"\nmedian speed-up {median:.2f}x over {len(rows)} rounds (load average 1/5/15 min: {load()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
