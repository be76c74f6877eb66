"""The cluster the chaos tests break: namespace hosts (onprem_hosts.Hosts) running real Ray,
the kvmesh app deployed with `serve deploy`, a private Redis index, and a steady load.

    head 10.214.N.1   Ray GCS + dashboard, Serve controller, HTTP proxy, Ingress
    P1, P2            one Prefill replica each (custom resource kvmesh_prefill: 1)
    D1, D2            one Decode replica each  (kvmesh_decode: 1); a late host D3 may join
    this side .254    redis-server (the prefix index), started and restarted by the test

Ray is started on each host over SSH with the `ray start` lines deploy/onprem.yaml runs there
(`ray up` itself is pinned by test_onprem_cluster.py; here its minutes would be spent on
every run). UCX is limited to TCP on the hosts: they share this machine's kernel, and UCX's
shared-memory transports would carry a "remote" READ past a cut link.

`Load` sends greedy streamed completions with shared long prefixes from a few client threads
and checks every answer against the cold greedy tokens; `Row` is one line of the table.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import redis
import yaml

from tests.conftest import REDIS_SERVER_BINARY, SERVE_SETTINGS, PrivateRedis
from tests.helpers import stream_items
from tests.integration.onprem_hosts import Hosts

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT = 6379
HTTP_PORT = 8000
RAY_START_S = 180.0
ERROR_KEYS = {"message", "type", "param", "code"}
ERROR_PAUSE_S = 0.5
# no log monitor streams the workers' logs to drivers (no test reads them there; they stay in each
# host's /tmp/ray/session_*/logs): ~1.2 CPU-s a node (tests/integration/conftest.py's HEAD too)
NO_LOG_MONITOR = "--include-log-monitor=false --disable-usage-stats"


def host_env(python_bin: Path) -> str:
    return (f"cd {ROOT} && export PATH={python_bin}:$PATH PYTHONPATH={ROOT} OMP_NUM_THREADS=1 UCX_TLS=tcp "
            f"RAY_USAGE_STATS_ENABLED=0 RAY_SERVE_LOG_TO_STDERR=0 REPORTER_UPDATE_INTERVAL_MS=60000 "
            + " ".join(f"{k}={v}" for k, v in SERVE_SETTINGS.items()) + "; ")  # see tests/conftest.py


class RayOnHosts:
    """Ray on namespace hosts; everything it starts lives in the hosts' PID namespaces, so
    Hosts.close() (or Hosts.kill) stops it, and no other Ray on this machine is touched."""

    def __init__(self, hosts: Hosts, python_bin: Path):
        self.hosts, self.env = hosts, host_env(python_bin)
        self.head = hosts.ips[0]

    def ssh(self, ip: str, command: str, timeout: float = RAY_START_S) -> str:
        out = self.hosts.ssh(ip, self.env + command, timeout=timeout)
        assert out.returncode == 0, f"on {ip}: `{command}` failed:\n{(out.stdout + out.stderr)[-3000:]}"
        return out.stdout

    def start_head(self, env: str = "", pools: tuple[str, ...] = ()) -> None:
        """`env`: `NAME=value ...` for the head's Ray (its GCS reads `RAY_<setting>` at start);
        `pools`: pools whose replicas the head hosts too (a `kvmesh_<pool>` resource each)."""
        resources = json.dumps({f"kvmesh_{p}": 1 for p in ("head", *pools)})
        self.ssh(self.head, f"{env} ray start --head --port={RAY_PORT} --num-cpus=1 --object-store-memory=80000000 "
                            f"--resources='{resources}' --dashboard-host=127.0.0.1 {NO_LOG_MONITOR}")

    def join(self, ip: str, pool: str) -> None:
        self.ssh(ip, f"ray start --address={self.head}:{RAY_PORT} --num-cpus=1 --object-store-memory=80000000 "
                     f"--resources='{{\"kvmesh_{pool}\": 1}}' {NO_LOG_MONITOR}")

    def join_all(self, pools: dict[str, str]) -> None:
        with ThreadPoolExecutor(len(pools)) as ex:
            list(ex.map(lambda kv: self.join(*kv), pools.items()))

    def replicas(self) -> dict[str, tuple[str, str]]:
        """Serve replica id (the `worker` label of /metrics) -> (deployment, host address)."""
        out = self.ssh(self.head, f"python -c '{REPLICAS}'", timeout=120)
        line = [l for l in out.splitlines() if l.startswith("REPLICAS ")][-1]
        return {k: tuple(v) for k, v in json.loads(line[len("REPLICAS "):]).items()}

    def serve_deploy(self, config: dict) -> None:
        """`serve deploy` on the head (non-blocking: replicas that cannot be placed stay pending)."""
        path = self.hosts.shared / "serve-chaos.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.ssh(self.head, "serve deploy /mnt/kvmesh/serve-chaos.yaml")


@contextlib.contextmanager
def hosts_with_ray(n: int, name: str, net: str, pools: dict[int, str], head_env: str = "",
                   head_pools: tuple[str, ...] = ()) -> Iterator[tuple[Hosts, PrivateRedis, RayOnHosts]]:
    """`n` namespace hosts with a private Redis on their gateway and Ray over SSH: the head on
    host 0 (`head_env`, `head_pools`: RayOnHosts.start_head), host i joined with `pools[i]`.
    Everything it started is stopped and removed on exit, also when bringing it up fails."""
    hosts, server, workdir = Hosts(n, name, net), None, Path(tempfile.mkdtemp(prefix=f"{name}-redis-"))
    try:
        hosts.start()
        hosts.check_isolated()
        server = PrivateRedis(REDIS_SERVER_BINARY, workdir, host=hosts.gateway)
        server.start()
        ray = RayOnHosts(hosts, Path(sys.executable).parent)
        ray.start_head(head_env, head_pools)
        ray.join_all({hosts.ips[i]: pool for i, pool in pools.items()})
        yield hosts, server, ray
    finally:
        hosts.close()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def cold_tokens(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The offline single-process engine's greedy tokens: what every answer is checked against."""
    from tests.local_serve import small_config
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.sampling.params import SamplingParams
    outs = Engine(small_config().engine.engine_config()).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


# run on the head: where each live replica of the app is
REPLICAS = """
import json, ray
from ray.util.state import list_actors
ray.init(address="auto", logging_level="ERROR")
ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
out = {}
for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000):
    if a.class_name.startswith("ServeReplica:kvmesh:") and a.node_id in ip:
        out[a.name.rsplit("#", 1)[1]] = (a.class_name.rsplit(":", 1)[1], ip[a.node_id])
print("REPLICAS " + json.dumps(out))
"""


def serve_config(redis_url: str, release_timeout_s: float) -> dict:
    """deploy/serve-onprem.yaml's app with fixed pools of two (one replica per host), the
    test's Redis, a short handoff timeout and chunked prefill."""
    config = yaml.safe_load((ROOT / "deploy" / "serve-onprem.yaml").read_text())
    args = config["applications"][0]["args"]
    args["engine"].update(index=redis_url, kv_cache_bytes="16MiB", max_num_seqs=8)
    for pool in ("prefill", "decode"):
        args[pool].pop("autoscaling", None)
        args[pool].update(num_replicas=2, num_cpus=0.25, resources={f"kvmesh_{pool}": 1})
    # prefill in chunks of 128 tokens: a long prompt spans several steps, so a kill lands mid-prefill
    args["prefill"]["engine"] = {"max_batched_tokens": 128}
    args["ingress"].update(num_cpus=0.1, token_timeout_s=30.0)
    args["handoff"]["release_timeout_s"] = release_timeout_s
    config["http_options"]["port"] = HTTP_PORT
    return config


# -- what the cluster says about itself: /metrics ---------------------------------------------
def scrape(url: str) -> dict[tuple, float]:
    """{(metric name, (label=value, ...)): value} from the ingress's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def per_worker(metrics: dict, name: str, pool: str) -> dict[str, float]:
    """worker id -> value of kvmesh_worker_<name> for the live replicas of `pool`."""
    out = {}
    for (metric, labels), value in metrics.items():
        labels = dict(labels)
        if metric == f"kvmesh_worker_{name}" and labels.get("pool") == pool:
            out[labels["worker"]] = value
    return out


def total(metrics: dict, name: str, **match) -> float:
    return sum(v for (metric, labels), v in metrics.items()
               if metric == name and all(dict(labels).get(k) == w for k, w in match.items()))


def forget_leases(redis_url: str, namespace: str = "*") -> int:
    """Delete every memory lease of `namespace` ("*": of every namespace) from the prefix index at
    `redis_url`: an index lookup then knows no holder, only the KV events can tell where a prefix is."""
    client = redis.Redis.from_url(redis_url)
    try:
        patterns = [f"kvmesh:{namespace}:[le]:*",       # redis_index's layout: every lease record
                    *(f"kvmesh:{namespace}:{name}" for name in ("holders", "m", "t", "tn"))]
        keys = [k for pattern in patterns for k in client.scan_iter(match=pattern)]
        return client.delete(*keys) if keys else 0
    finally:
        client.close()


# -- the load -----------------------------------------------------------------------------------
def shared_prefix_prompts(groups: int, per_group: int, prefix: int, suffix: int, seed: int = 23) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        shared = [rng.randrange(3, 259) for _ in range(prefix)]
        out += [shared + [rng.randrange(3, 259) for _ in range(suffix)] for _ in range(per_group)]
    return out


@dataclasses.dataclass
class Outcome:
    start: float
    end: float
    ttft: float | None
    kind: str           # correct | clean (an OpenAI error, tokens a greedy prefix) | wrong | unclean
    detail: str = ""
    stream: bool = True


def one_request(client: httpx.Client, url: str, prompt: list[int], want: list[int], stream: bool) -> Outcome:
    out = _request(client, url, prompt, want, stream)
    return dataclasses.replace(out, stream=stream)


def _request(client: httpx.Client, url: str, prompt: list[int], want: list[int], stream: bool) -> Outcome:
    body = {"prompt": prompt, "max_tokens": len(want), "temperature": 0, "ignore_eos": True, "stream": stream,
            "return_token_ids": True}
    start, ttft, tokens, errors = time.monotonic(), None, [], []
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                try:
                    err = r.json()["error"]
                except (ValueError, KeyError, TypeError):
                    return Outcome(start, time.monotonic(), None, "unclean", f"{r.status_code} {r.text[:200]}")
                kind = "clean" if set(err) == ERROR_KEYS else "unclean"
                return Outcome(start, time.monotonic(), None, kind, f"{r.status_code} {err.get('code')}")
            if not stream:
                r.read()
                tokens = r.json()["choices"][0]["token_ids"]
                ok = tokens == want
                return Outcome(start, time.monotonic(), None, "correct" if ok else "wrong",
                               "" if ok else f"got {tokens} want {want}")
            for ids, error in stream_items(r.iter_lines()):
                if error is not None:
                    errors.append(error)
                elif ttft is None:
                    ttft = time.monotonic() - start
                tokens += ids
    except httpx.HTTPError as e:
        return Outcome(start, time.monotonic(), ttft, "unclean", repr(e))
    end = time.monotonic()
    if errors:
        clean = set(errors[0]) == ERROR_KEYS and tokens == want[:len(tokens)]
        return Outcome(start, end, ttft, "clean" if clean else "wrong", f"stream error {errors[0].get('code')}")
    return Outcome(start, end, ttft, "correct" if tokens == want else "wrong",
                   "" if tokens == want else f"got {tokens} want {want}")


class Load:
    """`clients` threads sending back to back until stop(); every answer checked. Even
    clients stream, odd ones do not. After an error a client pauses `ERROR_PAUSE_S`, as one that
    honours the 503's Retry-After would (sooner, so short fault windows still see requests):
    hundreds of instant 503s while a pool has no replica only load the 2 cores."""

    def __init__(self, url: str, prompts: list[list[int]], want: list[list[int]], clients: int = 3):
        self.url, self.prompts, self.want = url, prompts, want
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(clients)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def _client(self, c: int) -> None:
        rng = random.Random(c)
        with httpx.Client(timeout=httpx.Timeout(180)) as client:
            while not self._stop.is_set():
                i = rng.randrange(len(self.prompts))
                self.outcomes.append(one_request(client, self.url, self.prompts[i], self.want[i], c % 2 == 0))
                if self.outcomes[-1].kind != "correct":
                    self._stop.wait(ERROR_PAUSE_S)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "a client hung"
        return self.outcomes

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclasses.dataclass
class Row:
    fault: str
    sent: int
    correct: int
    clean: int
    wrong: int          # wrong tokens, or an error that is not a clean OpenAI error
    held: int
    recover_s: float | None
    note: str = ""

    HEADER = "| fault | sent | correct | failed cleanly | wrong | KV held at end | recovered in | notes |\n" \
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"

    def line(self) -> str:
        rec = "-" if self.recover_s is None else f"{self.recover_s:.1f} s"
        return (f"| {self.fault} | {self.sent} | {self.correct} | {self.clean} | {self.wrong} | {self.held} | "
                f"{rec} | {self.note} |")


def row(fault: str, outcomes: list[Outcome], held: int, since: float | None, note: str = "") -> Row:
    """`since`: when the fault began (or the link came back); recovery is the end of the first
    correct answer to a request sent after it."""
    kinds = [o.kind for o in outcomes]
    after = [o.end for o in outcomes if o.kind == "correct" and since is not None and o.start >= since]
    return Row(fault, len(kinds), kinds.count("correct"), kinds.count("clean"),
               kinds.count("wrong") + kinds.count("unclean"), held,
               (min(after) - since) if after else None, note)


def ttft_median(outcomes: list[Outcome]) -> float:
    values = [o.ttft for o in outcomes if o.ttft is not None and o.kind == "correct"]
    return statistics.median(values) if values else float("nan")


def bad(outcomes: list[Outcome]) -> list[str]:
    return [f"{o.kind}: {o.detail}" for o in outcomes if o.kind in ("wrong", "unclean")]


def handoffs(before: dict, after: dict) -> str:
    """How the handoffs between two scrapes went: their number, NIXL/UCX bytes, Ray fallbacks."""
    d = lambda name, **kw: total(after, name, **kw) - total(before, name, **kw)   # noqa: E731
    reasons = {dict(l).get("reason") for (n, l) in after if n == "kvmesh_handoff_fallbacks_total"}
    fell = {r: d("kvmesh_handoff_fallbacks_total", reason=r) for r in reasons if r}
    fell = ", ".join(f"{r} {v:.0f}" for r, v in fell.items() if v) or "none"
    mb = {t: d("kvmesh_handoff_bytes_total", transport=t) / 1e6 for t in ("nixl", "ray")}
    return (f"{d('kvmesh_handoff_seconds_count'):.0f} handoffs, NIXL/UCX {mb['nixl']:.1f} MB, "
            f"Ray {mb['ray']:.1f} MB, fallbacks: {fell}")


def clean_codes(outcomes: list[Outcome]) -> str:
    codes: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "clean":
            codes[o.detail] = codes.get(o.detail, 0) + 1
    return ", ".join(f"{n}x {c}" for c, n in codes.items()) or "none"

