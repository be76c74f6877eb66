"""What a store restore costs the requests already running (issue 45 items 1 and 5): their
step times while a warm request arrives, with the restore's reads in the engine step (prefetch
off: `restore_prefetch_bytes` 0) and off it (prefetch on, the default).

    python bench/restore_stall.py [--tokens 16384] [--running 4] [--policy full]
                                  [--read-latency-ms 0] [--out FILE]

A writer engine (the built-in model) prefills a --tokens document and persists it to a fresh
local store. Then, for each mode, a fresh reader engine on that store (nothing in memory)
starts --running requests decoding (short unrelated prompts, EOS ignored) and steps them; after
ten steps a warm request (the document + 16 new tokens) arrives. Printed per mode: the running
requests' median step before it arrived, the longest step from its arrival until its first
token, their ratio, and the warm request's TTFT (arrival to first token); the load average
beside. A third row is the floor: the same with the document already in the reader's device
memory (the admitting step then only computes the new tokens against the cached context). --read-latency-ms adds that much to every store read call (a network mount or object
store), on whichever thread makes it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvmesh.workers.engine import Engine  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

DECODE = SamplingParams(max_tokens=4_000, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine(store: str, policy: str, prefetch: bool) -> Engine:
    extra = {} if prefetch else {"restore_prefetch_bytes": 0}
    return Engine(EngineConfig(store=store, swa_policy=policy, kv_cache_bytes=768 << 20, speculative_tokens=0,
                               **extra))


def slow_reads(e: Engine, latency_s: float) -> None:
    """Every store read call of `e` takes `latency_s` longer (on the thread that makes it)."""
    if not latency_s:
        return
    store, real = e.prefix.store, e.prefix.store.get_many

    def slow(*args, **kw):
        time.sleep(latency_s)
        return real(*args, **kw)
    store.get_many = slow


def run(store: str, doc: list[int], question: list[int], args, prefetch: bool, resident: bool = False) -> dict:
    e = engine(store, args.policy, prefetch)
    slow_reads(e, args.read_latency_ms / 1e3)
    e.generate([[2] * 40], FIRST)                    # first-call costs out of the way
    if resident:                                     # the floor: the prefix already in device memory
        e.generate([doc], FIRST)
    for i in range(args.running):
        e.add_request(f"run{i}", [3 + i] * 24, DECODE)
    steps, arrived, first = [], None, None
    warm = doc + question
    while first is None:
        if len(steps) == 10:
            e.add_request("warm", warm, FIRST)
            arrived = time.perf_counter()
        t = time.perf_counter()
        outs = e.step()
        steps.append((t, time.perf_counter() - t))
        if any(o.request_id == "warm" and o.finished for o in outs):
            first = time.perf_counter()
    before = [d for t, d in steps[2:10]]
    during = [d for t, d in steps[10:]]
    cached = e.prefix.stats.tier_hit_tokens["store"]
    e.close()
    return {"mode": "resident" if resident else "prefetch" if prefetch else "in_step", "median_step_ms": statistics.median(before) * 1e3,
            "longest_step_during_ms": max(during) * 1e3, "ratio": max(during) / statistics.median(before),
            "warm_ttft_ms": (first - arrived) * 1e3, "steps_during": len(during), "store_hit_tokens": cached}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--running", type=int, default=4)
    p.add_argument("--policy", default="full")
    p.add_argument("--read-latency-ms", type=float, default=0.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(a.tokens)
    doc = torch.randint(3, 500, (a.tokens,), generator=g).tolist()
    question = torch.randint(3, 500, (16,), generator=g).tolist()
    store = tempfile.mkdtemp(prefix="kvmesh-restore-stall-")
    writer = engine(store, a.policy, True)
    writer.generate([doc], FIRST)
    writer.flush()
    writer.close()
    rows = [run(store, doc, question, a, prefetch) for prefetch in (False, True)]
    rows.append(run(store, doc, question, a, True, resident=True))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{a.tokens}-token document, {a.policy}, {a.running} requests decoding, store read latency "
          f"{a.read_latency_ms:g} ms per call; load average {load}")
    print("| restore reads | running: median step ms | longest step during the restore ms | ratio | warm TTFT ms | "
          "store hit tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        label = {"in_step": "in the step", "prefetch": "prefetch (off the step)",
                 "resident": "none (the prefix already in device memory: the floor)"}[r["mode"]]
        print(f"| {label} | {r['median_step_ms']:.1f} | "
              f"{r['longest_step_during_ms']:.1f} | {r['ratio']:.2f} | {r['warm_ttft_ms']:.1f} | "
              f"{r['store_hit_tokens']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
