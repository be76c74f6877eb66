"""How long a store-tier prefix-index lookup takes in Redis, by chain length.

    python bench/index_lookup.py [--blocks 1024,8192] [--leases 0,4] [--repeats 200] [--json]

A private redis-server on a free port (never the one on 6379) holds one namespace: a chain
of N stored blocks, a checkpoint every 16 blocks, and memory leases of 0 or 4 workers (one
holds the whole chain, three a leading half: the worst case for the walk). Each lookup of the
whole chain is timed from the client, as a caller sees it:

  * script: `RedisIndex.lookup`, one EVALSHA that walks the chain on the server
  * pipeline: the lookup before it (one pipeline of TIME, two MGETs and a ZRANGE per block
    over the lease layout before it, one sorted set of workers per block, written here for it),
    the baseline, kept here to compare with

Both give the same LookupResult (checked). Prints a table (median and p99 ms, ratio) with the
load average; --json prints one JSON line per row.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore.hashing import PrefixHasher  # noqa: E402
from kvstore.index_base import LookupResult, walk_memory  # noqa: E402
from kvstore.redis_index import RedisIndex  # noqa: E402
from tests.conftest import REDIS_SERVER_BINARY, PrivateRedis  # noqa: E402

FINGERPRINT = "be4c0000000000000000000000000001"   # any hex fingerprint: a namespace of its own


def publish_old_leases(index: RedisIndex, worker: str, hashes: list[int], ttl_s: float) -> None:
    """Leases in the layout before per-worker sets: `{ns}:m:{hex}` -> {worker: deadline ms}."""
    secs, micros = index._client.time()
    deadline = secs * 1000 + micros // 1000 + int(ttl_s * 1000)
    pipe = index._client.pipeline(transaction=False)
    for key in index._keys("m", hashes):
        pipe.zadd(key, {worker: deadline})
    pipe.execute()


def pipeline_lookup(index: RedisIndex, hashes: list[int]) -> LookupResult:
    """The lookup before the server-side walk: 3 + N commands in one pipeline."""
    pipe = index._client.pipeline(transaction=False)
    pipe.time()
    pipe.mget(index._keys("b", hashes))
    pipe.mget(index._keys("c", hashes))
    for key in index._keys("m", hashes):
        pipe.zrange(key, 0, -1, withscores=True)
    (secs, micros), blocks, checkpoints, *leases = pipe.execute()
    now_ms = secs * 1000 + micros // 1000
    stored = next((i for i, present in enumerate(blocks) if present is None), len(blocks))
    marks = tuple(i for i in range(stored) if checkpoints[i] is not None)
    memory = walk_memory({w.decode() for w, deadline in members if deadline > now_ms} for members in leases)
    return LookupResult(stored, marks, memory)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def run(url: str, blocks: int, leases: int, repeats: int) -> dict:
    index = RedisIndex(url, FINGERPRINT)
    index.clear()
    hashes = PrefixHasher(FINGERPRINT, 1).hashes(list(range(blocks)))
    index.publish_blocks(hashes)
    for h in hashes[15::16]:
        index.publish_checkpoint(h)
    holders = [("whole", hashes)] + [(w, hashes[: blocks // 2]) for w in ("half-a", "half-b", "half-c")]
    for worker, chain in holders[:leases]:
        index.publish_memory(worker, chain, 3600.0)
        publish_old_leases(index, worker, chain, 3600.0)
    want = index.lookup(hashes)
    assert want == pipeline_lookup(index, hashes), "the two lookups disagree"
    assert want.stored == blocks and len(want.memory) == min(leases, len(holders))
    script, pipeline = [], []
    for _ in range(repeats // 10):          # alternated, so drift in the machine's load hits both
        script += timed(lambda: index.lookup(hashes), 10)
        pipeline += timed(lambda: pipeline_lookup(index, hashes), 10)
    index.clear()
    index.close()
    return {"blocks": blocks, "leases": leases, "script_ms_p50": statistics.median(script), "script_ms_p99": p99(script),
            "pipeline_ms_p50": statistics.median(pipeline), "pipeline_ms_p99": p99(pipeline),
            "repeats": len(script), "load_average": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="1024,8192", help="chain lengths, comma-separated")
    ap.add_argument("--leases", default="0,4", help="workers holding leases on the chain (0-4), comma-separated")
    ap.add_argument("--repeats", type=int, default=200, help="lookups timed per method and length")
    ap.add_argument("--json", action="store_true", help="one JSON line per row")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-redis-") as workdir:
        server = PrivateRedis(REDIS_SERVER_BINARY, Path(workdir))
        server.start()
        try:
            rows = [run(server.url, int(n), int(k), max(10, args.repeats))
                    for n in args.blocks.split(",") for k in args.leases.split(",")]
        finally:
            server.stop()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print("| blocks | workers with leases | script p50 ms | script p99 ms | pipeline p50 ms | pipeline p99 ms | pipeline / script (p50) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['blocks']:,} | {r['leases']} | {r['script_ms_p50']:.2f} | {r['script_ms_p99']:.2f} | "
              f"{r['pipeline_ms_p50']:.2f} | {r['pipeline_ms_p99']:.2f} | "
              f"{r['pipeline_ms_p50'] / r['script_ms_p50']:.1f}x |")


if __name__ == "__main__":
    main()
