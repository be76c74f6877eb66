"""What a store restore costs the requests already running (issue 45 items 1 and 5): their
step times while a warm request arrives, with the restore in the engine step (its reads and its
copy into the cache: `restore_prefetch_bytes` 0, `handoff_loads_in_flight` 0) and off it (the
defaults: the reads on a prefetch thread while the request waits outside the batch, the copy on a
loader thread while it waits with its memory reserved).

    python bench/restore_stall.py [--tokens 16384] [--running 4] [--policy full]
                                  [--read-latency-ms 0] [--out FILE] [--plot FILE.png]

A writer engine (the built-in model) prefills a --tokens document and persists it to a fresh
local store. Then, for each mode, a fresh reader engine on that store (nothing in memory)
starts --running requests decoding (short unrelated prompts, EOS ignored) and steps them; after
forty steps a warm request (the document + 16 new tokens) arrives. Printed per mode: the running
requests' median step before it arrived, the longest step from its arrival until its first
token, their ratio, and the warm request's TTFT (arrival to first token); the load average
beside. A third row is the floor: the same with the document already in the reader's device
memory (the admitting step then only computes the new tokens against the cached context). --read-latency-ms adds that much to every store read call (a network mount or object
store), on whichever thread makes it.

With --handoff the warm request comes as a P/D handoff instead (decode role): a prefill engine
holds the document's cache, and the reader gets it with a Resume whose load copies the gathered
cache after --handoff-latency-ms (the wire: a NIXL READ or a Ray copy of that many MB at some
bandwidth), read inside the step (`handoff_loads_in_flight` 0) or off it (the default, 4); TTFT is
then arrival to its first decoded token. The floor row is the same without the wire's latency.
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

from kvmesh.kvstore.store.tiers import nbytes  # noqa: E402
from kvmesh.workers.engine import Engine  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.request import Resume  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402
from bench.prefix_reuse import warm_read_buffers  # noqa: E402

BEFORE = 40        # steps before the warm request comes (the first two are not counted)
DECODE = SamplingParams(max_tokens=4_000, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
HANDOFF = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)    # prefill's token + one decoded


SLOW_STORE_GROUP = 8        # --object-latency-ms: a call with buffers of its own gets this many objects at a time


def engine(store: str, policy: str, prefetch: bool, max_num_seqs: int | None = None, reads: int = 4) -> Engine:
    # in the step: the reads and the copy into the cache, as every restore was before issue 45
    extra = {"store_reads_in_flight": reads} if prefetch else {"restore_prefetch_bytes": 0, "handoff_loads_in_flight": 0}
    if max_num_seqs is not None:
        extra["max_num_seqs"] = max_num_seqs
    return Engine(EngineConfig(store=store, swa_policy=policy, kv_cache_bytes=768 << 20, speculative_tokens=0,
                               **extra))


def slow_reads(e: Engine, latency_s: float, object_latency_s: float = 0.0, bandwidth: float = 0.0) -> None:
    """Every store read call of `e` takes `latency_s` longer, plus `object_latency_s` per object
    it reads and its bytes at `bandwidth` bytes/s (0: no cap): a network mount or an object store
    answering one object after another. Slept on the thread that makes the call."""
    if not (latency_s or object_latency_s or bandwidth):
        return
    store, real = e.prefix.store, e.prefix.store.get_many

    def slow(kind, hashes, expect=None, own=False):
        """Objects arrive over time, not all at once after a pause: a call that gets buffers of
        its own (a prefetch) reads 8 objects at a time, each group when the store would have
        sent it; one reading into the reused staging buffer (views valid until the next call)
        reads all, then waits what they would have taken."""
        t0, out = time.perf_counter(), []
        time.sleep(latency_s)
        step = SLOW_STORE_GROUP if own else max(1, len(hashes))
        for i in range(0, len(hashes), step):
            got = real(kind, hashes[i:i + step], expect, own)
            out += got
            owed = latency_s + object_latency_s * len(out) + (
                sum(nbytes(o) for o in out if o is not None) / bandwidth if bandwidth else 0.0)
            time.sleep(max(0.0, t0 + owed - time.perf_counter()))
        return out
    store.get_many = slow


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def held_document(doc: list[int], policy: str) -> tuple:
    """--handoff: a prefill engine's held cache of `doc`: (first output, held handle, gathered payload)."""
    prefill = Engine(EngineConfig(swa_policy=policy, kv_cache_bytes=768 << 20, speculative_tokens=0))
    prefill.add_request("warm", doc, HANDOFF, hold_kv=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.held), None)
    held, payload = prefill.held_handle("warm"), prefill.export_held("warm")
    prefill.release_held("warm")
    prefill.close()
    return first, held, payload


def handoff_resume(held_doc: tuple, latency_s: float) -> Resume:
    first, held, payload = held_doc

    def load(cache, blocks, slot, reused):
        time.sleep(latency_s)                        # the wire
        cache.scatter(blocks[reused:], slot, cache.skip_blocks(payload, reused))
    return Resume(first.first, load, first.cached_tokens, held.rng_state)


def run(store: str, doc: list[int], question: list[int], args, prefetch: bool, resident: bool = False,
        held_doc: tuple | None = None) -> dict:
    if held_doc is not None:            # --handoff: prefetch means the load off the step
        e = Engine(EngineConfig(swa_policy=args.policy, kv_cache_bytes=768 << 20, speculative_tokens=0,
                                handoff_loads_in_flight=4 if prefetch else 0))
    else:
        e = engine(store, args.policy, prefetch, args.running if args.queued else None, args.reads_in_flight)
        if prefetch:                     # its read buffers as a serving engine's are (no fresh memory per restore)
            slow = args.read_latency_ms or args.object_latency_ms or args.bandwidth_mb_s
            warm_read_buffers(e, SLOW_STORE_GROUP if slow else None)
        slow_reads(e, args.read_latency_ms / 1e3, args.object_latency_ms / 1e3, args.bandwidth_mb_s * 1e6)
    e.generate([[2] * 40], FIRST)                    # first-call costs out of the way
    if resident and held_doc is None:                # the floor: the prefix already in device memory
        e.generate([doc], FIRST)
    for i in range(args.running):       # --queued: the first one ends --queued steps after the warm request came
        params = SamplingParams(max_tokens=BEFORE + args.queued, temperature=0.0, ignore_eos=True) \
            if args.queued and i == 0 else DECODE
        e.add_request(f"run{i}", [3 + i] * 24, params)
    steps, arrived, first = [], None, None
    warm = doc + question
    while first is None:
        if len(steps) == BEFORE and held_doc is not None:
            e.add_request("warm", doc, HANDOFF,
                          resume=handoff_resume(held_doc, 0.0 if resident else args.handoff_latency_ms / 1e3))
            arrived = time.perf_counter()
        elif len(steps) == BEFORE:
            e.add_request("warm", warm, FIRST)
            arrived = time.perf_counter()
        t = time.perf_counter()
        outs = e.step()
        steps.append((t, time.perf_counter() - t))
        if any(o.request_id == "warm" and o.finished for o in outs):
            first = time.perf_counter()
    before = [d for t, d in steps[2:BEFORE]]
    during = [d for t, d in steps[BEFORE:]]
    reading = during[:-1] or [0.0]       # the last step admitted it (prefill + its first token)
    cached = e.prefix.stats.tier_hit_tokens["store"]
    e.close()
    median = statistics.median(before)
    return {"mode": "resident" if resident else "prefetch" if prefetch else "in_step", "median_step_ms": median * 1e3,
            "longest_step_during_ms": max(during) * 1e3, "ratio": max(during) / median,
            "longest_step_before_admission_ms": max(reading) * 1e3, "ratio_before_admission": max(reading) / median,
            "p95_step_before_admission_ms": percentile(reading, 95) * 1e3,
            "longest_step_before_arrival_ms": max(before) * 1e3, "p95_step_before_arrival_ms": percentile(before, 95) * 1e3,
            "admitting_step_ms": during[-1] * 1e3,
            "series": [(t - arrived, d) for t, d in steps[2:]],
            "warm_ttft_ms": (first - arrived) * 1e3, "steps_during": len(during), "store_hit_tokens": cached}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--running", type=int, default=4)
    p.add_argument("--policy", default="full")
    p.add_argument("--read-latency-ms", type=float, default=0.0, help="added to every store read call")
    p.add_argument("--object-latency-ms", type=float, default=0.0, help="added per object read")
    p.add_argument("--bandwidth-mb-s", type=float, default=0.0, help="store read bandwidth cap (MB/s; 0: none)")
    p.add_argument("--reads-in-flight", type=int, default=4, help="engine.store_reads_in_flight of the reader")
    p.add_argument("--queued", type=int, default=0,
                   help="the engine holds --running sequences at most, so the warm request queues until one "
                        "of them ends, this many steps after it came (0: it is admitted at once)")
    p.add_argument("--handoff", action="store_true", help="the warm request comes as a P/D handoff (decode role)")
    p.add_argument("--handoff-latency-ms", type=float, default=50.0, help="with --handoff: the wire's time per load")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="write the step times around the restore as a PNG here")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(a.tokens)
    doc = torch.randint(3, 500, (a.tokens,), generator=g).tolist()
    question = torch.randint(3, 500, (16,), generator=g).tolist()
    store = tempfile.mkdtemp(prefix="kvmesh-restore-stall-")
    held_doc = None
    if a.handoff:
        held_doc = held_document(doc, a.policy)
    else:
        writer = engine(store, a.policy, True)
        writer.generate([doc], FIRST)
        writer.flush()
        writer.close()
    rows = [run(store, doc, question, a, prefetch, held_doc=held_doc) for prefetch in (False, True)]
    rows.append(run(store, doc, question, a, True, resident=True, held_doc=held_doc))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    if a.handoff:
        print(f"{a.tokens}-token document handed off (decode role), {a.policy}, {a.running} requests decoding, "
              f"the wire {a.handoff_latency_ms:g} ms per load; load average {load}")
    else:
        print(f"{a.tokens}-token document, {a.policy}, {a.running} requests decoding, store read latency "
              f"{a.read_latency_ms:g} ms per call + {a.object_latency_ms:g} ms per object, bandwidth "
              f"{a.bandwidth_mb_s or 'uncapped'} MB/s, queued {a.queued} steps, {a.reads_in_flight} reads in flight; "
              f"load average {load}")
    print("| restore reads | running: median step ms | before it came: p95 / longest ms | while it waits: steps, "
          "p95 / longest ms | ratio (longest) | admitting step ms | ratio | warm TTFT ms | store hit tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        label = {"in_step": "in the step", "prefetch": "prefetch (off the step)",
                 "resident": "none (the prefix already in device memory: the floor)"}[r["mode"]]
        if a.handoff:
            label = {"in_step": "handoff load in the step", "prefetch": "handoff load off the step",
                     "resident": "handoff load off the step, no wire time (the floor)"}[r["mode"]]
        print(f"| {label} | {r['median_step_ms']:.1f} | {r['p95_step_before_arrival_ms']:.1f} / "
              f"{r['longest_step_before_arrival_ms']:.1f} | {r['steps_during'] - 1}, "
              f"{r['p95_step_before_admission_ms']:.1f} / {r['longest_step_before_admission_ms']:.1f} | "
              f"{r['ratio_before_admission']:.2f} | {r['admitting_step_ms']:.1f} | {r['ratio']:.2f} | "
              f"{r['warm_ttft_ms']:.1f} | {r['store_hit_tokens']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    if a.plot:
        plot(rows, a, Path(a.plot))
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def plot(rows: list[dict], a, path: Path) -> None:
    """The running requests' step times around the warm request's arrival, one line per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"in_step": "restore in the step", "prefetch": "reads and copy off the step (default)",
              "resident": "floor: prefix already in device memory"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        xs, ys = (list(v) for v in zip(*r["series"]))
        xs.append(xs[-1] + ys[-1])        # each step drawn from its start to its end
        ys.append(ys[-1])
        ax.step([x * 1e3 for x in xs], [y * 1e3 for y in ys], where="post", label=labels[r["mode"]])
    ax.axvline(0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("ms since the warm request arrived (each mark: one engine step)")
    ax.set_ylabel("step time, ms (log)")
    store = "handoff" if a.handoff else (f"{a.object_latency_ms:g} ms/object, {a.bandwidth_mb_s or 'uncapped'} MB/s"
                                          if a.object_latency_ms or a.bandwidth_mb_s else "local files")
    ax.set_title(f"{a.tokens}-token restore beside {a.running} decoding requests ({store})")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
