"""Prefix reuse: cold vs warm TTFT per SWA policy, what each policy stores, and how close
the warm TTFT is to its floor.

For each prompt size, a writer engine prefills a document (cold TTFT) and persists it to a
fresh store; a *fresh* reader engine on the same store then serves a prompt that shares a
prefix with it plus a short unique question (warm TTFT), in two scenarios:

  * doc-end:  the whole document + question (the hit ends where the document's prompt-end
              checkpoint is, so `periodic` restores as much as `full`)
  * mid-doc:  the document cut 5 blocks + 7 tokens before its end + question (the hit ends
              between checkpoints: `periodic:P` restores at the nearest one and computes
              the rest, `zero` recomputes its span)

The floor of the warm TTFT is

    bytes loaded / read bandwidth of the store (measured in this run)  +  model compute of
    the warm request (the recomputed tokens, the question, the first-token step)

so warm / floor shows the overhead of the restore path itself.

    python bench/prefix_reuse.py                      # 2K, 8K, 16K tokens on the default model
    python bench/prefix_reuse.py --sizes 2048 --policies full,zero
    python bench/prefix_reuse.py --kv-cache-dtypes auto,fp8   # each policy with both KV dtypes

With `--kv-cache-dtypes` each policy runs once per KV dtype (`fp8`: V4's FP8 records for
the compressed entries and indexer keys; the SWA state stays in the compute dtype).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import (
    EngineConfig,  # noqa: E402
    parse_bytes,  # noqa: E402
)
from kvmesh.workers.reuse.prefix_cache import PART_MIN_OBJECTS  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
QUESTION_TOKENS = 16


def engine(policy: str, store: str, args, kv: str = "auto", reader: str = "auto", **extra) -> Engine:
    """A fresh engine, warmed up on an unrelated short prompt (first-call costs excluded)."""
    e = Engine(EngineConfig(model=args.model, block_tokens=args.block_tokens, swa_policy=policy, store=store,
                            kv_cache_bytes=args.kv_cache_bytes, max_batched_tokens=args.chunk,
                            kv_cache_dtype=kv, speculative_tokens=0, store_reader=reader, **extra))
    e.generate([[2] * 40], FIRST_TOKEN)
    return e


def warm_read_buffers(e: Engine, group: int | None = None) -> None:
    """Give a fresh reader engine's store the read buffers a serving engine has after its first
    restore (reused, kvstore/store/read_buffers.py): read its blocks once as a prefetch does (the
    first objects, then the rest; `group`: in calls of that many objects) and drop them. Otherwise
    the measured restore also pays for faulting fresh memory in, 20-50 ms for 10 MB on this VM, a
    first-call cost like the warm-up prompt's."""
    keys = e.prefix.store.list("block") if e.prefix.store is not None else []
    if group:
        parts = [keys[i:i + group] for i in range(0, len(keys), group)]
    else:
        parts = [keys[:PART_MIN_OBJECTS], keys[PART_MIN_OBJECTS:]] if len(keys) >= 2 * PART_MIN_OBJECTS else [keys]
    held = [e.prefix.store.get_many("block", part, own=True) for part in parts if part]
    del held


def timed_first_token(e: Engine, prompt: list[int]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = e.generate([prompt], FIRST_TOKEN)[0]
    return time.perf_counter() - t0, out


def drop_page_cache(root: Path) -> None:
    """Evict the store's files from the page cache (POSIX_FADV_DONTNEED, after an fsync), so the
    next read goes to the device: what a restore on another node, or after a while, reads."""
    for p in root.rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(root: Path, cold: bool = False) -> float:
    """Sequential read bandwidth of the store's files (bytes/s), as a restore reads them
    (`cold`: from the device, the page cache dropped first)."""
    if cold:
        drop_page_cache(root)
    files = [p for p in root.rglob("*.kv")]
    total, t0 = 0, time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            total += len(f.read())
    return total / max(time.perf_counter() - t0, 1e-9)


def run_one(policy: str, size: int, args, doc: list[int], question: list[int], kv: str = "auto",
            readers: tuple[str, ...] = ("auto",)) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    try:
        writer = engine(policy, str(root), args, kv)
        cold_s, cold_out = timed_first_token(writer, doc)
        writer.flush()
        stored = writer.prefix.store.stats().total_bytes
        writer.close()
        bw = read_bandwidth(root, cold=getattr(args, "drop_page_cache", False))
        rows = []
        cut = size - 5 * args.block_tokens - 7
        scenarios = (("doc-end", doc + question), ("mid-doc", doc[:cut] + question))
        runs: dict[tuple[str, str], list] = {(sc, r): [] for sc, _ in scenarios for r in readers}
        for i in range(getattr(args, "repeat", 1)):     # the readers take turns; a fresh engine each run
            for (scenario, prompt), how in [(sp, r) for sp in scenarios for r in readers]:
                copy = root.parent / f"{root.name}-{scenario}-{how}-{i}"    # a warm run writes what it computed:
                shutil.copytree(root, copy)                                # the next one starts from the writer's store
                gc.collect()
                reader = engine(policy, str(copy), args, kv, how)
                warm_read_buffers(reader)
                if getattr(args, "drop_page_cache", False):
                    drop_page_cache(copy)
                before = dataclasses.replace(reader.counters)
                warm_s, warm_out = timed_first_token(reader, prompt)
                runs[scenario, how].append((warm_s, reader.counters.forward_s - before.forward_s,
                                            reader.prefix.store.reader, warm_out, dict(reader.prefix.stats.last),
                                            reader.prefix.stats.bytes_loaded, len(prompt)))
                reader.close()
                shutil.rmtree(copy, ignore_errors=True)
        for (scenario, _), how in [(sp, r) for sp in scenarios for r in readers]:
            got = runs[scenario, how]
            warm_s, forward_s = statistics.median(r[0] for r in got), statistics.median(r[1] for r in got)
            _, _, used, warm_out, last, loaded, prompt_tokens = got[-1]
            floor = loaded / bw + forward_s
            rows.append({"policy": policy, "kv": kv, "reader": used, "tokens": size, "scenario": scenario,
                         "cold_ttft_s": cold_s, "runs": len(got),
                         "warm_ttft_s": warm_s, "speedup": cold_s / warm_s,
                         "stored_bytes_per_1k": stored * 1000 / size, "prompt_tokens": prompt_tokens,
                         "cached_tokens": warm_out.cached_tokens, "recomputed": last.get("recompute", 0),
                         "bytes_loaded": loaded, "load_s": last.get("load_s", 0.0), "compute_s": forward_s,
                         "read_bw": bw, "floor_s": floor, "warm_over_floor": warm_s / floor})
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def miss_cost(args, tokens: int) -> list[dict]:
    """Issue 45 item 2: what prefetch costs a request whose prefix no tier holds. A writer stores a
    document (the index is not empty); then, alone on an idle engine and beside four decoding
    requests, fresh prompts of `tokens` tokens that share nothing with it arrive, with prefetch on
    (the default: its index lookup on a loader thread, the request parked until it answers) and off
    (`restore_prefetch_bytes: 0`: the lookup in the step), the two engines taking turns. Per row: the
    median time from its arrival to the start of the forward that computes it (what a lookup can add:
    the forward itself varies 1.5x from run to run on this machine), the median TTFT, and the blocks
    the parked request held (a miss must hold none)."""
    root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-miss-"))
    try:
        writer = engine("full", str(root), args)
        writer.generate([torch.randint(3, 500, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()],
                        FIRST_TOKEN)
        writer.flush()
        writer.close()
        engines = {"on": engine("full", str(root), args), "off": engine("full", str(root), args,
                                                                        restore_prefetch_bytes=0)}
        decode = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        got: dict[tuple[str, str], list] = {}
        seed = 100
        for i in range(args.repeat):
            for beside in ("idle", "4 decoding"):
                for how, e in engines.items():
                    seed += 1
                    prompt = torch.randint(3, 500, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
                    if beside != "idle":
                        for j in range(4):
                            e.add_request(f"run{seed}-{j}", [3 + j] * 24, decode)
                        for _ in range(5):
                            e.step()
                    used = e.blocks.num_used
                    started, run = [], e.runner.run

                    def noted(batch, *a, rid=f"miss{seed}", run=run, **kw):
                        if not started and any(seq.request_id == rid for seq, _ in batch):
                            started.append(time.perf_counter())
                        return run(batch, *a, **kw)
                    e.runner.run = noted
                    t0 = time.perf_counter()
                    e.add_request(f"miss{seed}", prompt, FIRST_TOKEN)
                    parked = e.blocks.num_used - used
                    first = None
                    while first is None:
                        outs = e.step()
                        if any(o.request_id == f"miss{seed}" for o in outs):
                            first = time.perf_counter() - t0
                    e.runner.run = run
                    for j in range(4 if beside != "idle" else 0):
                        e.abort(f"run{seed}-{j}")
                    while e.has_unfinished():
                        e.step()
                    got.setdefault((beside, how), []).append((first, parked, e.prefix.stats.hits, started[0] - t0))
        rows = []
        for (beside, how), runs in got.items():
            rows.append({"beside": beside, "prefetch": how, "tokens": tokens, "runs": len(runs),
                         "ttft_ms": statistics.median(r[0] for r in runs) * 1e3,
                         "to_forward_ms": statistics.median(r[3] for r in runs) * 1e3,
                         "parked_blocks": max(r[1] for r in runs), "hits": runs[-1][2]})
        for e in engines.values():
            e.close()
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = ("| policy | kv | reader | tokens | hit | cold TTFT s | warm TTFT s | speedup | stored KB/1K tok | cached "
            "| recomputed | loaded MB | load s | compute s | floor s | warm/floor |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['policy']} | {r.get('kv', 'auto')} | {r.get('reader', 'file')} | {r['tokens']} | {r['scenario']} | {r['cold_ttft_s']:.3f} | "
                     f"{r['warm_ttft_s']:.3f} | "
                     f"{r['speedup']:.1f}x | {r['stored_bytes_per_1k'] / 1024:.0f} | {r['cached_tokens']} | "
                     f"{r['recomputed']} | {r['bytes_loaded'] / 2**20:.1f} | {r['load_s']:.3f} | "
                     f"{r['compute_s']:.3f} | {r['floor_s']:.3f} | {r['warm_over_floor']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], size: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for scenario, marker in (("doc-end", "o"), ("mid-doc", "s")):
        pts = [r for r in rows if r["tokens"] == size and r["scenario"] == scenario]
        ax.plot([r["stored_bytes_per_1k"] / 2**20 for r in pts], [r["warm_ttft_s"] * 1000 for r in pts],
                marker, label=f"warm, hit at {scenario}")
        for r in pts:
            if scenario == "mid-doc":
                ax.annotate(r["policy"], (r["stored_bytes_per_1k"] / 2**20, r["warm_ttft_s"] * 1000),
                            textcoords="offset points", xytext=(7, -3), fontsize=8)
    pts = [r for r in rows if r["tokens"] == size]
    cold = sum(r["cold_ttft_s"] for r in pts) / max(len(pts), 1) * 1000
    ax.axhline(cold, color="grey", linestyle="--", linewidth=1, label=f"cold TTFT ({cold:.0f} ms)")
    ax.set_xlabel("store bytes per 1K prompt tokens (MiB)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"SWA policies at {size} tokens: storage vs warm TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--sizes", default="2048,8192,16384")
    p.add_argument("--policies", default="full,periodic:1024,periodic:2048,periodic:4096,zero")
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2048, help="max batched tokens per step")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default="768MiB")
    p.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto, bfloat16, fp8")
    p.add_argument("--store-readers", default="auto",
                   help="comma-separated engine.store_reader values the warm engines read with: auto, nixl, file")
    p.add_argument("--repeat", type=int, default=1,
                   help="warm runs per row (fresh engine each); the row shows the median")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="evict the store's files from the page cache before each warm run (and the bandwidth "
                        "measurement): reads from the device, not from memory")
    p.add_argument("--miss-cost", type=int, default=0, metavar="TOKENS",
                   help="instead: what prefetch costs a request whose prefix no tier holds (issue 45 item 2), "
                        "prompts of this many tokens, --repeat of each")
    p.add_argument("--out", default="bench/out/prefix_reuse")
    args = p.parse_args()
    if args.miss_cost:
        rows = miss_cost(args, args.miss_cost)
        print("| beside | prefetch | prompt tokens | runs | arrival to its forward ms | TTFT ms "
              "| blocks held while parked | hits |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['beside']} | {r['prefetch']} | {r['tokens']} | {r['runs']} | {r['to_forward_ms']:.2f} | "
                  f"{r['ttft_ms']:.1f} | {r['parked_blocks']} | {r['hits']} |")
        on = {r["beside"]: r["to_forward_ms"] for r in rows if r["prefetch"] == "on"}
        off = {r["beside"]: r["to_forward_ms"] for r in rows if r["prefetch"] == "off"}
        print("\n" + "; ".join(f"{b}: prefetch adds {on[b] - off[b]:+.2f} ms" for b in on))
        print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
        return 0
    torch.manual_seed(0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        g = torch.Generator().manual_seed(size)
        doc = torch.randint(3, 500, (size,), generator=g).tolist()
        question = torch.randint(3, 500, (QUESTION_TOKENS,), generator=g).tolist()
        for policy, kv in [(p_, k) for p_ in args.policies.split(",") for k in args.kv_cache_dtypes.split(",")]:
            rows += run_one(policy, size, args, doc, question, kv, tuple(args.store_readers.split(",")))
            print(f"  {policy:>14} {kv:>8} {size:>6}: cold {rows[-1]['cold_ttft_s']:.3f}s warm "
                  f"{rows[-2]['warm_ttft_s']:.3f}s / {rows[-1]['warm_ttft_s']:.3f}s", file=sys.stderr)
    print(table(rows))
    print(f"\nload average {', '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    Path(f"{out}.json").write_text(json.dumps(rows, indent=1))
    sizes = sorted({r["tokens"] for r in rows})
    plot(rows, 8192 if 8192 in sizes else sizes[-1], Path(f"{out}.png"))
    print(f"\nwrote {out}.json and {out}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
