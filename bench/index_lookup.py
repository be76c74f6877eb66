"""How long a store-tier prefix-index lookup takes in Redis, by chain length.

    python bench/index_lookup.py [--blocks 1024,8192] [--leases 0,4] [--repeats 200] [--json]

A private redis-server on a free port (never the one on 6379) holds one namespace: a chain
of N stored blocks, a checkpoint every 16 blocks, and memory leases of 0 or 4 workers (one
holds the whole chain, three a leading half: the worst case for the walk). Each lookup of the
whole chain is timed from the client, as a caller sees it:

  * hash: `RedisIndex.lookup`, one EVALSHA over the hash layout (fields = raw 8-byte hashes)
  * per-key: the script lookup before it, the baseline: one EVALSHA that builds a key name per
    block (`{ns}:b:{hex}`, `{ns}:c:{hex}`) for pages of MGET and ZMSCORE's per-worker lease sets
    (`{ns}:w:{worker}`), over that layout, written here for it. (The pipeline of 3 + N commands
    before both is gone from this bench: it was 7-18x slower than the per-key script.)

Both give the same LookupResult (checked). Beside each median and p99 it prints Redis's own CPU
time per lookup (INFO cpu, main thread), which a loaded machine inflates less than wall time,
and the load average; --json prints one JSON line per row.

    python bench/index_lookup.py --writes [--baseline-ref REV]

times the lease writes instead (median of 20 rounds: a new worker publishes an 8,192-block chain
beside three holding its first half, renews it, publishes a step's 4 blocks, removes 512), and
with --baseline-ref the same with kvstore/index/redis_index.py as it was at git revision REV, loaded
beside this one, the two alternated twice.
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

from kvmesh.kvstore.hashing import PrefixHasher, hash_hex  # noqa: E402
from kvmesh.kvstore.index.base import LookupResult  # noqa: E402
from kvmesh.kvstore.index.redis_index import RedisIndex  # noqa: E402
from tests.conftest import REDIS_SERVER_BINARY, PrivateRedis  # noqa: E402

FINGERPRINT = "be4c0000000000000000000000000001"   # any hex fingerprint: a namespace of its own
_PAGE = 512

# The per-key layout's lookup, as RedisIndex ran it before the hash layout (ARGV[1] the namespace's
# key prefix, ARGV[2] the chain as hex).
PER_KEY_LOOKUP_LUA = f"""
local ns, chain = ARGV[1], ARGV[2]
local n = #chain / 16
local function hex(i) return string.sub(chain, 16 * i - 15, 16 * i) end
local function page(prefix, from, to)
  local out = {{}}
  for i = from, to do out[#out + 1] = prefix .. hex(i) end
  return out
end
local function run(cmd, key, prefix, to, alive)
  local count = 0
  for from = 1, to, {_PAGE} do
    local last = math.min(from + {_PAGE} - 1, to)
    local got = key and redis.call(cmd, key, unpack(page(prefix, from, last)))
                    or redis.call(cmd, unpack(page(prefix, from, last)))
    for i = 1, #got do
      if not alive(got[i]) then return count end
      count = count + 1
    end
  end
  return count
end
local stored = run('MGET', nil, ns .. ':b:', n, function(v) return v end)
local marks = {{}}
for from = 1, stored, {_PAGE} do
  local got = redis.call('MGET', unpack(page(ns .. ':c:', from, math.min(from + {_PAGE} - 1, stored))))
  for i = 1, #got do
    if got[i] then marks[#marks + 1] = from + i - 2 end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function live(score) return score and tonumber(score) > now end
local memory = {{}}
if n > 0 then
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', ns .. ':workers', '(' .. now, '+inf')) do
    local key = ns .. ':w:' .. w
    if live(redis.call('ZSCORE', key, hex(1))) then
      memory[#memory + 1] = w
      memory[#memory + 1] = run('ZMSCORE', key, '', n, live)
    end
  end
end
return {{stored, marks, memory}}
"""


class PerKeyLayout:
    """The layout before the hash one, on the same server and namespace prefix (the baseline)."""

    def __init__(self, index: RedisIndex) -> None:
        self._client, self._ns = index._client, index._ns
        self._script = self._client.register_script(PER_KEY_LOOKUP_LUA)

    def publish(self, hashes: list[int], checkpoints: list[int], leases: list[tuple[str, list[int]]]) -> None:
        c, ns = self._client, self._ns
        c.mset({f"{ns}:b:{hash_hex(h)}": 1 for h in hashes})
        c.mset({f"{ns}:c:{hash_hex(h)}": 1 for h in checkpoints})
        secs, micros = c.time()
        deadline = secs * 1000 + micros // 1000 + 3_600_000
        for worker, chain in leases:
            c.zadd(f"{ns}:w:{worker}", {hash_hex(h): deadline for h in chain})
            c.zadd(f"{ns}:workers", {worker: deadline})

    def lookup(self, hashes: list[int]) -> LookupResult:
        chain = b"".join(h.to_bytes(8, "big") for h in hashes).hex()
        stored, marks, memory = self._script(args=[self._ns, chain])
        return LookupResult(stored, tuple(marks), {memory[i].decode(): memory[i + 1] for i in range(0, len(memory), 2)})


def server_cpu_s(index: RedisIndex) -> float:
    info = index._client.info("cpu")
    return info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"]


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
    holders = ([("whole", hashes)] + [(w, hashes[: blocks // 2]) for w in ("half-a", "half-b", "half-c")])[:leases]
    index.publish_blocks(hashes)
    for h in hashes[15::16]:
        index.publish_checkpoint(h)
    for worker, chain in holders:
        index.publish_memory(worker, chain, 3600.0)
    per_key = PerKeyLayout(index)
    per_key.publish(hashes, hashes[15::16], holders)
    want = index.lookup(hashes)
    assert want == per_key.lookup(hashes), "the two lookups disagree"
    assert want.stored == blocks and len(want.memory) == leases
    times: dict[str, list[float]] = {"hash": [], "per_key": []}
    cpu = dict.fromkeys(times, 0.0)
    for _ in range(repeats // 10):          # alternated, so drift in the machine's load hits both
        for name, fn in (("hash", index.lookup), ("per_key", per_key.lookup)):
            before = server_cpu_s(index)
            times[name] += timed(lambda: fn(hashes), 10)
            cpu[name] += server_cpu_s(index) - before
    index.clear()
    index.close()
    row = {"blocks": blocks, "leases": leases, "repeats": len(times["hash"]), "load_average": os.getloadavg()[0]}
    for name, xs in times.items():
        row |= {f"{name}_ms_p50": statistics.median(xs), f"{name}_ms_p99": p99(xs),
                f"{name}_server_cpu_ms": cpu[name] * 1000 / len(xs)}
    return row


def write_times(url: str, cls, rounds: int = 20) -> dict:
    """Median ms of the lease writes of `cls` (a RedisIndex class) in a fresh namespace."""
    index = cls(url, FINGERPRINT)
    index.clear()
    hashes = PrefixHasher(FINGERPRINT, 1).hashes(list(range(8192)))
    for w in ("half-a", "half-b", "half-c"):
        index.publish_memory(w, hashes[:4096], 3600.0)
    times: dict[str, list[float]] = {"publish 8,192 new": [], "renew 8,192": [], "publish 4": [], "remove 512": []}
    for r in range(rounds):
        worker = f"w{r}"
        for name, fn in (("publish 8,192 new", lambda: index.publish_memory(worker, hashes, 3600.0)),
                         ("renew 8,192", lambda: index.publish_memory(worker, hashes, 3600.0)),
                         ("publish 4", lambda: index.publish_memory(worker, hashes[100:104], 3600.0)),
                         ("remove 512", lambda: index.remove_memory(worker, hashes[:512]))):
            times[name] += timed(fn, 1)
    index.clear()
    index.close()
    return {name: statistics.median(xs) for name, xs in times.items()}


# what redis_index.py imported before kvstore/ was cut into subpackages under `kvmesh`
OLD_IMPORTS = {"kvstore.hashing": "kvmesh.kvstore.hashing", "kvstore.index_base": "kvmesh.kvstore.index.base",
               "kvstore.log_once": "kvmesh.kvstore.log_once", "kvstore.redact": "kvmesh.kvstore.redact"}


def baseline_class(rev: str):
    """RedisIndex as kvstore/index/redis_index.py was at git revision `rev`."""
    import importlib.util
    import subprocess
    root = Path(__file__).resolve().parent.parent
    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"], capture_output=True, text=True)
    found = show("kvstore/index/redis_index.py")
    if found.returncode:      # a revision before the `kvmesh` import name: its layout and its imports
        found = show("kvstore/redis_index.py")
        for old, new in OLD_IMPORTS.items():
            found.stdout = found.stdout.replace(f"from {old} import", f"from {new} import")
    found.check_returncode()
    source = found.stdout
    path = Path(tempfile.mkdtemp(prefix="kvmesh-bench-")) / "baseline_redis_index.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kvmesh.kvstore.baseline_redis_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RedisIndex


def main_writes(url: str, rev: str | None) -> None:
    runs = [("this tree", RedisIndex)] + ([(rev, baseline_class(rev))] if rev else [])
    rows = [(label, write_times(url, cls)) for _ in range(2) for label, cls in runs]
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    names = list(rows[0][1])
    print("| index | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, row in rows:
        print(f"| {label} | " + " | ".join(f"{row[n]:.2f}" for n in names) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="1024,8192", help="chain lengths, comma-separated")
    ap.add_argument("--leases", default="0,4", help="workers holding leases on the chain (0-4), comma-separated")
    ap.add_argument("--repeats", type=int, default=200, help="lookups timed per method and length")
    ap.add_argument("--json", action="store_true", help="one JSON line per row")
    ap.add_argument("--writes", action="store_true", help="time the lease writes instead of lookups")
    ap.add_argument("--baseline-ref", default=None, help="with --writes: also kvstore/index/redis_index.py at this git revision")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-redis-") as workdir:
        server = PrivateRedis(REDIS_SERVER_BINARY, Path(workdir))
        server.start()
        try:
            if args.writes:
                main_writes(server.url, args.baseline_ref)
                return
            rows = [run(server.url, int(n), int(k), max(10, args.repeats))
                    for n in args.blocks.split(",") for k in args.leases.split(",")]
        finally:
            server.stop()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    print("| blocks | workers with leases | hash p50 ms | hash p99 ms | hash server CPU ms | per-key p50 ms | "
          "per-key p99 ms | per-key server CPU ms | per-key / hash (p50) | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['blocks']:,} | {r['leases']} | {r['hash_ms_p50']:.2f} | {r['hash_ms_p99']:.2f} | "
              f"{r['hash_server_cpu_ms']:.2f} | {r['per_key_ms_p50']:.2f} | {r['per_key_ms_p99']:.2f} | "
              f"{r['per_key_server_cpu_ms']:.2f} | {r['per_key_ms_p50'] / r['hash_ms_p50']:.1f}x | "
              f"{r['load_average']:.1f} |")


if __name__ == "__main__":
    main()
