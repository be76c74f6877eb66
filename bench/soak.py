"""A bounded soak of the disaggregated app under everything a client, the store and Redis
can do: normal requests, clients that vanish at random points, and injected store and
Redis faults. Reports requests completed, wrong outputs, errors by kind, resident memory
and held KV at start and end, and the replicas' idle CPU afterwards.

    python bench/soak.py [--duration 180] [--baseline 60] [--clients 32] [--out bench/out/soak.json]

One local Ray, one app (prefill + decode, NIXL handoff, a store folder, a private
password-protected redis-server as the index). Phases, each with --clients concurrent
clients sending back to back:

  * baseline (--baseline s): normal requests only, no faults: the strongest reference
  * soak (--duration s, at most 600): 70 % normal requests, 30 % clients that drop the
    connection (mid-body, while queued / in prefill / around the handoff, mid-stream),
    and every --fault-every s one injected fault: a store object truncated to 0 bytes,
    replaced by a directory or a FIFO, or bit-flipped; Redis OOM (maxmemory 1 +
    noeviction), READONLY (REPLICAOF a dead master) or stalled (DEBUG SLEEP 2).

Every normal request's greedy tokens are checked against a cold single-engine run of the
same prompt (a fixed set of shared-prefix prompts). The ratio to read is the soak's
completed requests per second over the baseline's (the machine is shared and noisy).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import redis  # noqa: E402

from tests.local_serve import LocalServe, free_port, small_config  # noqa: E402

PASSWORD = "soak-" + os.urandom(8).hex()
MAX_DURATION_S = 600
MAX_TOKENS = 12
RELEASE_TIMEOUT_S = 10.0


def start_redis(workdir: str) -> tuple[subprocess.Popen, redis.Redis, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", PASSWORD, "--enable-debug-command", "local",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=PASSWORD, socket_timeout=10)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, client, f"redis://:{PASSWORD}@127.0.0.1:{port}/0"


def prompts(n_groups: int = 48, per_group: int = 2, prefix: int = 256, suffix: int = 20) -> list[list[int]]:
    """Shared-prefix prompts whose prefixes (96 blocks) outgrow the device pool, so
    restores keep going to the store (where the faults are)."""
    rng = random.Random(0)
    out = []
    for _ in range(n_groups):
        shared = [rng.randrange(3, 259) for _ in range(prefix)]
        out += [shared + [rng.randrange(3, 259) for _ in range(suffix)] for _ in range(per_group)]
    return out


def cold_tokens(config, ps: list[list[int]]) -> list[list[int]]:
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.sampling.params import SamplingParams
    engine = Engine(config.engine.model_copy(update={"store": None, "index": "local"}).engine_config())
    outs = engine.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


# ---- clients -------------------------------------------------------------------------------
async def normal(client: httpx.AsyncClient, url: str, i: int, ps, want, tally: Counter) -> None:
    body = {"prompt": ps[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    try:
        r = await client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as e:
        tally[f"http_error:{type(e).__name__}"] += 1
        return
    if r.status_code != 200:
        tally[f"status_{r.status_code}:{r.json().get('error', {}).get('code')}"] += 1
    elif r.json()["choices"][0]["token_ids"] != want[i]:
        tally["wrong_output"] += 1
    else:
        tally["completed"] += 1


async def vanishing(port: int, rng: random.Random, ps, tally: Counter) -> None:
    how = rng.choice(["mid_body", "early", "early", "mid_stream"])
    body = json.dumps({"prompt": rng.choice(ps), "max_tokens": rng.randint(4, 40), "temperature": 0,
                       "ignore_eos": True, "stream": how == "mid_stream" or rng.random() < 0.5}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + (body[:len(body) // 2] if how == "mid_body" else body))
        await writer.drain()
        if how == "mid_stream":
            await asyncio.wait_for(reader.readuntil(b"data: "), 60)
            await asyncio.wait_for(reader.read(rng.randint(1, 400)), 60)
        else:
            await asyncio.sleep(rng.uniform(0, 0.6))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.transport.abort()
    tally[f"disconnect_{how}"] += 1


async def load(url: str, port: int, clients: int, seconds: float, ps, want, disconnect_share: float) -> Counter:
    tally: Counter = Counter()
    deadline = time.monotonic() + seconds

    async def loop(c: int):
        rng = random.Random(c)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            while time.monotonic() < deadline:
                if rng.random() < disconnect_share:
                    await vanishing(port, rng, ps, tally)
                else:
                    await normal(client, url, rng.randrange(len(ps)), ps, want, tally)
    await asyncio.gather(*(loop(c) for c in range(clients)))
    return tally


# ---- faults ---------------------------------------------------------------------------------
def store_fault(store: Path, rng: random.Random) -> str:
    objs = sorted(store.glob("*/*/*.kv"))
    objs = [p for p in objs if p.is_file()]
    if not objs:
        return "store:none"
    p, kind = rng.choice(objs), rng.choice(["zero_bytes", "directory", "fifo", "bit_flip"])
    with contextlib.suppress(OSError):
        if kind == "zero_bytes":
            p.write_bytes(b"")
        elif kind == "directory":
            p.unlink()
            p.mkdir()
        elif kind == "fifo":
            p.unlink()
            os.mkfifo(p)
        else:
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0x55
            p.write_bytes(data)
    return f"store:{kind}"


def redis_fault(client: redis.Redis, rng: random.Random) -> str:
    kind = rng.choice(["oom", "readonly", "debug_sleep"])
    if kind == "oom":
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        time.sleep(5)
        client.config_set("maxmemory", 0)
    elif kind == "readonly":
        client.execute_command("REPLICAOF", "127.0.0.1", free_port())
        time.sleep(5)
        client.execute_command("REPLICAOF", "NO", "ONE")
    else:
        client.execute_command("DEBUG", "SLEEP", 2)
    return f"redis:{kind}"


def inject(store: Path, client: redis.Redis, every_s: float, stop: threading.Event, injected: Counter) -> None:
    rng = random.Random(1)
    while not stop.wait(every_s):
        try:
            injected[store_fault(store, rng) if rng.random() < 0.5 else redis_fault(client, rng)] += 1
        except Exception as e:
            injected[f"injector_error:{type(e).__name__}"] += 1


def cleanup_store(store: Path) -> None:
    """Faults left behind (directories, FIFOs) are removed so the next run starts clean."""
    for p in store.glob("*/*/*.kv"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif not p.is_file():
            p.unlink()


# ---- the replicas ---------------------------------------------------------------------------
def replica_pids() -> dict[str, int]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                cmd = open(f"/proc/{pid}/cmdline").read()
                for name in ("Prefill", "Decode", "Ingress"):
                    if f"ServeReplica:soak:{name}" in cmd:
                        out[name] = int(pid)
    return out


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pool_state() -> dict:
    from ray import serve
    out = {}
    for name in ("Prefill", "Decode"):
        e = serve.get_deployment_handle(name, app_name="soak").stats.remote().result(timeout_s=60).engine
        out[name] = {"held": e.held, "running": e.running + e.waiting,
                     "used_slots": e.total_slots - e.free_slots,
                     "used_blocks": e.total_blocks - e.free_blocks,
                     "store_corrupt": e.store.corrupt if e.store is not None else 0}
    return out


def snapshot() -> dict:
    pids = replica_pids()
    return {"rss_mib": {n: round(rss_mib(p)) for n, p in pids.items()}, "pools": pool_state()}


def wait_drained(limit_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        s = pool_state()
        if all(v["held"] == v["running"] == v["used_slots"] == v["used_blocks"] == 0 for v in s.values()):
            break
        time.sleep(0.5)
    return time.monotonic() - start


def idle_cpu(seconds: float = 10.0) -> dict:
    pids = replica_pids()
    t0 = {n: cpu_s(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: round((cpu_s(p) - t0[n]) / seconds * 100, 1) for n, p in pids.items()}


def table(result: dict) -> str:
    b, s = result["baseline"], result["soak"]
    lines = ["| phase | seconds | completed | completed/s | wrong outputs | errors by kind | disconnects |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for name, r in (("baseline (no faults)", b), ("soak", s)):
        t = r["tally"]
        errors = {k: v for k, v in t.items() if k not in ("completed", "wrong_output") and not k.startswith("disc")}
        disc = sum(v for k, v in t.items() if k.startswith("disconnect"))
        lines.append(f"| {name} | {r['seconds']:.0f} | {t.get('completed', 0)} | {r['rate']:.2f} | "
                     f"{t.get('wrong_output', 0)} | {errors or 'none'} | {disc} |")
    lines += ["", f"soak / baseline completed per second: {s['rate'] / max(b['rate'], 1e-9):.2f}x",
              f"faults injected: {dict(result['injected'])}", "",
              "| | start | end (after drain) |", "|---|---|---|",
              f"| resident MiB | {result['start']['rss_mib']} | {result['end']['rss_mib']} |",
              f"| held KV | {result['start']['pools']} | {result['end']['pools']} |",
              f"| drained in | | {result['drain_s']:.1f} s |",
              f"| idle CPU % of a core (10 s) | | {result['idle_cpu']} |"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=180.0, help=f"soak seconds (at most {MAX_DURATION_S})")
    ap.add_argument("--baseline", type=float, default=60.0, help="seconds of the fault-free baseline")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--disconnect-share", type=float, default=0.3)
    ap.add_argument("--fault-every", type=float, default=8.0, help="seconds between injected faults")
    ap.add_argument("--out", default="bench/out/soak.json")
    args = ap.parse_args()
    duration = min(args.duration, MAX_DURATION_S)
    workdir = tempfile.mkdtemp(prefix="kvmesh-soak-")
    store = Path(workdir) / "store"
    proc, rclient, url_redis = start_redis(workdir)
    result: dict = {"args": vars(args)}
    try:
        config = small_config("disaggregated", engine={"store": str(store), "index": url_redis, "host_cache_bytes": 0,
                                                       "store_read_timeout_s": 2.0},
                              handoff={"release_timeout_s": RELEASE_TIMEOUT_S},
                              ingress={"num_cpus": 0.1, "token_timeout_s": 60.0})
        ps = prompts()
        want = cold_tokens(config, ps)
        with LocalServe(num_cpus=4) as ls:
            url = ls.deploy("soak", config, "/")
            result["start"] = snapshot()
            t0 = time.monotonic()
            tally = asyncio.run(load(url, ls.port, args.clients, args.baseline, ps, want, 0.0))
            wall = time.monotonic() - t0
            result["baseline"] = {"seconds": wall, "tally": tally, "rate": tally["completed"] / wall}
            injected: Counter = Counter()
            stop = threading.Event()
            injector = threading.Thread(target=inject, args=(store, rclient, args.fault_every, stop, injected))
            injector.start()
            t0 = time.monotonic()
            tally = asyncio.run(load(url, ls.port, args.clients, duration, ps, want, args.disconnect_share))
            wall = time.monotonic() - t0
            stop.set()
            injector.join()
            result["soak"] = {"seconds": wall, "tally": tally, "rate": tally["completed"] / wall}
            result["injected"] = injected
            result["drain_s"] = wait_drained(RELEASE_TIMEOUT_S + 60)
            result["end"] = snapshot()
            cleanup_store(store)
            result["idle_cpu"] = idle_cpu()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=dict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
