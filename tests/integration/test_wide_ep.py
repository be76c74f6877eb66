"""Data-parallel + expert-parallel replicas over two hosts (issue 29 items 1-3; issue 47: TP inside
the DP ranks), on namespace hosts (tests/integration/onprem_hosts.py) running real Ray:

    head      Ray GCS, Serve controller, HTTP proxy, both apps' ingresses, the disaggregated
              app's prefill replica (DP=2 + EP)
    W1-W3     on two of them, one replica of each app: the decode pool's DP=2 x TP=2 + EP, one
              DP rank's TP group of 2 on each host (data_parallel_size_local 1; the group's second
              rank a local process of the DP rank's actor), and the colocated pool's DP=4 + EP, 2
              ranks on each host (data_parallel_size_local 2); a placement group of one bundle per
              host, STRICT_SPREAD; gloo and NIXL between the hosts; room for both on any two

Two apps share the hosts: `/` disaggregated (the DP prefill replica on the head, the DP x TP replica
as its decode pool) and `/colo` colocated (the DP=4 replica runs whole requests). Every answer is checked against
the cold greedy tokens of the offline single-process engine. The kill scenario first removes the
colocated app (its equality is checked already; one gang to replace, not two, keeps the suite
short), then SIGKILLs every process of a host of the decode replica under load: each open request
ends as the right tokens or a clean OpenAI error (503, or an SSE error event), never a hang; Serve
replaces the replica as a gang on the two hosts that remain; nothing is left held. The head's GCS
checks its nodes every second (Ray's default: 3 s), so a dead host is known in ~5 s, not ~15 s.
"""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import REDIS_SERVER_BINARY
from tests.integration.chaos_cluster import (
    HTTP_PORT, Load, RayOnHosts, Row, bad, clean_codes, cold_tokens, handoffs, hosts_with_ray, one_request,
    per_worker, row, scrape, serve_config, shared_prefix_prompts, total)
from tests.integration.onprem_hosts import Hosts
from tests.integration.test_onprem_cluster import require_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]     # a cluster of namespace hosts, like test_chaos.py

MAX_TOKENS = 24
LONG_TOKENS = 64
READY_WITHIN_S = 300.0
TOKEN_TIMEOUT_S = 30.0     # ingress.token_timeout_s (chaos_cluster.serve_config)
HEAD_ENV = "RAY_health_check_period_ms=1000"      # a node is dead after 5 failed checks: ~5 s
# a request open when its replica's host dies ends by then: at once, or (its retry found no live
# replica of the pool: Serve queues it until one is back) when its retry's wait reaches the token timeout
ENDED_WITHIN_S = TOKEN_TIMEOUT_S + 10
WIDE = dict(data_parallel_size=4, data_parallel_size_local=2, enable_expert_parallel=True, num_replicas=1,
            num_cpus=0.25, resources={"kvmesh_wide": 0.25})    # a host's bundle: 2 ranks, kvmesh_wide 0.5
# a host's bundle: one DP rank whose TP group holds 2 ranks' resources, kvmesh_wide 0.5
GROUPED = dict(WIDE, data_parallel_size=2, data_parallel_size_local=1, tensor_parallel_size=2)
DP_RANKS = {"decode": 2, "colocated": 4}

# run on the head: every live actor of a wide replica (the replica = rank 0, its rank actors) -> host
RANKS = """
import json, ray
from ray.util.state import list_actors
ray.init(address="auto", logging_level="ERROR")
ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
out = {}
for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000):
    if a.node_id not in ip:
        continue
    if a.class_name.startswith("ServeReplica:") and a.class_name.rsplit(":", 1)[1] in ("Decode", "Colocated"):
        out[a.name.rsplit("#", 1)[1] + ":0"] = ip[a.node_id]
    elif (a.name or "").startswith("kvmesh-rank:"):
        out[a.name.split(":", 2)[2]] = ip[a.node_id]
print("RANKS " + json.dumps(out))
"""


def apps_config(redis_url: str) -> dict:
    """The on-prem app (chaos_cluster.serve_config) with a DP prefill pool on the head and its
    decode pool DP x TP over two hosts, plus a colocated app on /colo whose pool is DP=4 over them."""
    config = serve_config(redis_url, release_timeout_s=10.0)
    disagg = config["applications"][0]
    args = disagg["args"]
    args["prefill"].update(num_replicas=1, data_parallel_size=2, enable_expert_parallel=True,
                           resources={"kvmesh_prefill": 0.5})       # the head's kvmesh_prefill 1: two ranks
    args["decode"] = {**args["decode"], **GROUPED}
    args["ingress"].update(num_cpus=0.05, token_timeout_s=TOKEN_TIMEOUT_S)
    colo = json.loads(json.dumps(disagg))
    colo.update(name="kvmesh-colo", route_prefix="/colo")
    colo["args"].pop("prefill"), colo["args"].pop("decode")
    colo["args"].update(mode="colocated", colocated={**WIDE, "engine": {"max_batched_tokens": 128}})
    config["applications"].append(colo)
    return config


class Wide:
    def __init__(self, hosts: Hosts, ray: RayOnHosts, prompts: list, want: list):
        self.hosts, self.ray, self.prompts, self.want = hosts, ray, prompts, want
        head, *self.wide = hosts.ips
        self.base = f"http://{head}:{HTTP_PORT}"
        self.urls = {"decode": self.base, "colocated": f"{self.base}/colo"}

    def ranks(self) -> dict[str, str]:
        """'{replica}:{rank}' -> host address, for every live rank of the wide replicas."""
        out = self.ray.ssh(self.ray.head, f"python -c '{RANKS}'", timeout=120)
        line = [l for l in out.splitlines() if l.startswith("RANKS ")][-1]
        return json.loads(line[len("RANKS "):])

    def serving(self, pool: str) -> dict[str, dict[int, float]]:
        """replica -> {rank: generated tokens} of `pool`'s live replicas (their /metrics)."""
        out: dict[str, dict[int, float]] = {}
        for (metric, labels), value in scrape(self.urls[pool]).items():
            labels = dict(labels)
            if metric == "kvmesh_rank_generated_tokens" and labels.get("pool") == pool:
                out.setdefault(labels["worker"], {})[int(labels["rank"])] = value
        return out

    def wait_ready(self, pools=("decode", "colocated"), within_s: float = READY_WITHIN_S,
                   old: set[str] = frozenset()) -> dict[str, str]:
        """Until each of `pools` has a live replica not in `old` with all its DP ranks up and an
        answer comes back from its app; the ranks' hosts then."""
        deadline, last = time.monotonic() + within_s, "no answer"
        while time.monotonic() < deadline:
            try:
                live = {p: set(self.serving(p)) - set(old) for p in pools}
                if all(live.values()):
                    for p in pools:
                        r = httpx.post(f"{self.urls[p]}/v1/completions", json={"prompt": "warm", "max_tokens": 2},
                                       timeout=60)
                        r.raise_for_status()
                    where = self.ranks()
                    if all(sum(k.startswith(w + ":") for k in where) == DP_RANKS[p] for p, ws in live.items()
                           for w in ws):
                        return where
                last = str(live)
            except Exception as e:        # the proxy, the ingress or a replica is not up yet
                last = repr(e)
            time.sleep(2)
        raise AssertionError(f"the wide replicas are not ready within {within_s:.0f} s: {last}")


@pytest.fixture(scope="module")
def wide():
    require_namespaces()
    if not Path(REDIS_SERVER_BINARY).exists():
        pytest.skip(f"{REDIS_SERVER_BINARY} is not installed")
    # 8 prompts over 4 prefixes of 2 blocks: requests spread over the ranks, repeats reuse
    prompts = shared_prefix_prompts(groups=4, per_group=2, prefix=256, suffix=12, seed=29)
    pool = ThreadPoolExecutor(1)
    cold = pool.submit(cold_tokens, prompts, LONG_TOKENS)
    t0 = time.monotonic()
    try:
        with hosts_with_ray(4, "kvw", "10.215", {1: "wide", 2: "wide", 3: "wide"}, HEAD_ENV, ("prefill",)) \
                as (hosts, redis, ray):
            t1 = time.monotonic()
            config = apps_config(redis.url)
            ray.serve_deploy(config)
            long = cold.result()
            w = Wide(hosts, ray, prompts, [t[:MAX_TOKENS] for t in long])
            w.long, w.config = long, config
            w.placed = w.wait_ready()
            print(f"\nhosts + Ray up in {t1 - t0:.0f} s, both apps serving {time.monotonic() - t1:.0f} s after the "
                  "deploy", file=sys.__stdout__, flush=True)
            yield w
    finally:
        pool.shutdown()


def send_all(url: str, prompts: list, want: list) -> list:
    """Every prompt at once (half streamed): the front spreads them over the ranks."""
    def one(i):
        with httpx.Client(timeout=httpx.Timeout(180)) as c:
            return one_request(c, url, prompts[i], want[i], stream=i % 2 == 0)
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, range(len(prompts))))


def test_a_dp2_x_tp2_decode_pool_and_a_dp4_colocated_pool_over_two_hosts_equal_one_process(wide):
    placed = wide.placed
    for pool, url in wide.urls.items():
        (replica,) = wide.serving(pool)
        hosts = {r: placed[f"{replica}:{r}"] for r in range(DP_RANKS[pool])}
        # colocated: ranks 0-1 on one host, 2-3 on the other; decode: a DP rank (its TP group) on each
        assert (hosts[0] == hosts[1] != hosts[2] == hosts[3]) if pool == "colocated" else hosts[0] != hosts[1], hosts
        assert set(hosts.values()) <= set(wide.wide) and len(set(hosts.values())) == 2, hosts
        before = scrape(url)
        outcomes = send_all(url, wide.prompts, wide.want) + send_all(url, wide.prompts, wide.want)
        assert [o.kind for o in outcomes] == ["correct"] * len(outcomes), bad(outcomes)
        if pool == "decode":      # every handoff from the head's prefill ranks READ over NIXL by a decode group
            after = scrape(url)
            moved = {t: total(after, "kvmesh_handoff_bytes_total", transport=t)
                     - total(before, "kvmesh_handoff_bytes_total", transport=t) for t in ("nixl", "ray")}
            assert moved["nixl"] > 0 and moved["ray"] == 0, moved
            assert total(after, "kvmesh_handoff_fallbacks_total") == 0, handoffs(before, after)
        served = wide.serving(pool)[replica]
        by_host = {h: sum(v for r, v in served.items() if hosts[r] == h) for h in set(hosts.values())}
        assert all(v > 0 for v in by_host.values()), f"{pool}: a host's ranks served nothing: {served}"
        print(f"\n{pool}: ranks {hosts}, tokens generated per rank {served}", file=sys.__stdout__, flush=True)


def test_a_wide_host_killed_mid_stream_fails_cleanly_and_the_replica_comes_back_on_the_others(wide):
    # the colocated app goes (its tokens were checked above): its replica frees room on the hosts
    wide.ray.serve_deploy({**wide.config, "applications": wide.config["applications"][:1]})
    (replica,) = old = set(wide.serving("decode"))
    victim = wide.ranks()[f"{replica}:1"]     # DP rank 1's group's host: rank 0 lives on and must fail the gang
    load = Load(wide.base, wide.prompts, wide.long, clients=2)    # long answers: streams open at the kill
    with load:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not load.outcomes:
            time.sleep(0.5)
        time.sleep(1.0)              # the clients' next requests are in flight
        t0 = time.monotonic()
        wide.hosts.kill(victim)
        placed = wide.wait_ready(pools=("decode",), old=old)
        back = time.monotonic()
        deadline = back + 60                      # until requests sent after that are answered
        while time.monotonic() < deadline and sum(o.start > back for o in load.outcomes) < 3:
            time.sleep(0.5)
    outs = load.outcomes
    cut = [o for o in outs if o.start < t0 < o.end]
    r = row("wide host killed (decode)", outs, 0, t0, f"the replica ready again {back - t0:.1f} s after the kill; "
            f"open at the kill: {len(cut)}, ended {[round(o.end - t0, 1) for o in cut]} s after it "
            f"({[o.kind for o in cut]}); clean errors: {clean_codes(outs)}")
    print("\n" + Row.HEADER + "\n" + r.line(), file=sys.__stdout__, flush=True)
    assert not bad(outs), bad(outs)[:5]
    assert cut, "the kill cut no request"
    assert all(o.end - t0 < ENDED_WITHIN_S for o in cut), \
        f"a request open at the kill hung: {[round(o.end - t0, 1) for o in cut]}"
    late = [o for o in outs if o.start > back]
    assert late and all(o.kind == "correct" for o in late), "the new replica does not serve"
    (new,) = set(wide.serving("decode")) - old
    hosts = {h for k, h in placed.items() if k.startswith(new + ":")}
    assert hosts == set(wide.wide) - {victim}, placed
    held = per_worker(scrape(wide.base), "held", "decode")
    assert sum(held.values()) == 0, held
