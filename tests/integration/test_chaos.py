"""Faults at cluster scale on namespace hosts (issue 23): a decode host and a prefill host
killed, a partition and a lossy slow link between the prefill and decode hosts, Redis
restarted empty, the KV event stream lost, a decode host that joins late; after Redis, the stream
and the kills, the router's event index recovers too (in sync, the dead ranks expired, a repeat
routed from events to the replica that holds it). One cluster for the module
(tests/integration/chaos_cluster.py), the scenarios in file order, each under a steady load
of greedy streamed requests with shared long prefixes, every answer checked against the cold
greedy tokens; each prints one row of the table in docs/testing.md. The network is restored
after each scenario; namespaces, rules, qdiscs, Ray and Redis go at the end, also on failure.
"""
from __future__ import annotations

import dataclasses
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import REDIS_SERVER_BINARY, PrivateRedis
from tests.integration.chaos_cluster import (
    HTTP_PORT,
    Load,
    RayOnHosts,
    Row,
    bad,
    clean_codes,
    cold_tokens,
    forget_leases,
    handoffs,
    hosts_with_ray,
    one_request,
    per_worker,
    row,
    scrape,
    serve_config,
    shared_prefix_prompts,
    total,
    ttft_median,
)
from tests.integration.onprem_hosts import Hosts
from tests.integration.test_onprem_cluster import require_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]     # a cluster of namespace hosts, like test_onprem_cluster.py

IN_FLIGHT = ("running", "waiting")     # a replica's requests a host kill may cut (/metrics per-worker gauges)
RELEASE_TIMEOUT_S = 4.0         # handoff.release_timeout_s: the NIXL READ's and the held cache's timeout
MAX_TOKENS = 16
LONG_TOKENS = 96
READY_WITHIN_S = 300.0
IDLE_WITHIN_S = RELEASE_TIMEOUT_S + 30
# a request cut by a partition ends at most two handoff timeouts (its READ's, then its retry's)
# after the link comes back, plus slack for 2 busy cores: it fails or finishes, it never hangs
# to the token timeout. (A decode engine runs its READs one at a time on its thread, so the
# requests behind a cut READ wait for its timeout too.)
HEALED_WITHIN_S = 2 * RELEASE_TIMEOUT_S + 8
LOSS = 0.05                     # a twentieth of the packets between prefill and decode hosts dropped
EXPIRE_S = 10.0                 # kvstore/kv_events.EXPIRE_S: a silent publisher is forgotten after it
EVENTS_S = 2.0                  # publishers beat every second: what the router has heard by then
LOST_S = 4.0                    # the event stream unusable: under EXPIRE_S, the ranks stay known
# after LOST_S of failures a publisher backs off <= 1.6 s (0.1 s doubling per failed beat), then its
# next beat shows the gap and the one after answers the snapshot request: all in sync by then
RESYNCED_S = 5.0
RANKS_PER_HOST = 1              # serve_config: one replica per host, no data parallelism


class Cluster:
    def __init__(self, hosts: Hosts, ray: RayOnHosts, redis: PrivateRedis, prompts: dict, want: dict):
        self.hosts, self.ray, self.redis = hosts, ray, redis
        self.prompts, self.want = prompts, want
        head, p1, p2, d1, d2 = hosts.ips
        self.url = f"http://{head}:{HTTP_PORT}"
        self.prefill, self.decode = [p1, p2], [d1, d2]
        self.rows: list[Row] = []

    def load(self, clients: int = 3, kind: str = "short") -> Load:
        """kind: short (16 tokens), long (96-token streams: open long enough to be cut) or
        fresh (1,024 uncached prompt tokens: long prefills)."""
        return Load(self.url, self.prompts[kind], self.want[kind], clients)

    def workers(self, pool: str) -> dict[str, float]:
        return per_worker(scrape(self.url), "running", pool)

    def settle(self) -> int:
        """Wait until every worker is idle with all its KV free; what is still taken then: the
        prefill handoffs held, requests running or waiting, blocks and state slots in use on
        either side (cached prefix blocks are free: evictable)."""
        deadline = time.monotonic() + IDLE_WITHIN_S
        while True:
            m = scrape(self.url)
            left = kv_taken(m)
            if left == 0 or time.monotonic() > deadline:
                if left:
                    print("KV still taken:", {f"{p}:{name}": per_worker(m, name, p) for p in ("prefill", "decode")
                                              for name in ("held", "running", "waiting", "free_blocks",
                                                           "total_blocks", "free_slots", "total_slots")},
                          file=sys.__stdout__, flush=True)
                return left
            time.sleep(1)

    def record(self, r: Row) -> Row:
        self.rows.append(r)
        print(f"\n{Row.HEADER}\n{r.line()}", file=sys.__stdout__, flush=True)
        return r

    def links(self, *rule: str) -> None:
        """The same iptables rule on every prefill host, for each decode host, both ways."""
        for p in self.prefill:
            for d in self.decode:
                self.hosts.netns(p, "iptables", "-A", "OUTPUT", "-d", d, *rule)
                self.hosts.netns(p, "iptables", "-A", "INPUT", "-s", d, *rule)

    def restore_network(self) -> None:
        for ip in self.prefill + self.decode:
            self.hosts.netns(ip, "iptables", "-F")
            self.hosts.netns(ip, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def kill_when_busy(self, ip: str, pool: str, states: tuple[str, ...] = IN_FLIGHT,
                       within_s: float = 30.0) -> str:
        """SIGKILL every process of host `ip` as soon as its `pool` replica has requests in one of
        `states` (so the kill cuts them); what it had in flight then. The decode scenario waits for
        `running` ones, streams in progress: once, a kill with 2 running or waiting on the decode host
        cut no stream and caused no retry (all 26 answers correct; the cause is not known)."""
        mine = [w for w, (_, host) in self.ray.replicas().items() if host == ip]
        deadline, busy = time.monotonic() + within_s, 0
        while time.monotonic() < deadline and not busy:
            m = scrape(self.url)
            busy = sum(per_worker(m, name, pool).get(w, 0) for w in mine for name in states)
        self.hosts.kill(ip)
        return f"{busy:.0f} {'/'.join(states)} on it"


def not_correct(outcomes: list) -> list[str]:
    """What went otherwise than a correct answer, for an assertion's message."""
    return [f"{o.kind}: {o.detail}" for o in outcomes if o.kind != "correct"][:8]


def kv_taken(metrics: dict) -> int:
    """Over the live workers of both pools: handoffs held + requests running or waiting +
    KV blocks and state slots in use."""
    def pool_sum(name: str) -> int:
        return int(sum(sum(per_worker(metrics, name, p).values()) for p in ("prefill", "decode")))
    return (pool_sum("held") + pool_sum("running") + pool_sum("waiting") + pool_sum("total_blocks")
            - pool_sum("free_blocks") + pool_sum("total_slots") - pool_sum("free_slots"))


def loopback_bits_per_s(nbytes: int = 64 << 20) -> float:
    """This machine's loopback TCP rate, measured: the reference the slow link is cut from."""
    server = socket.create_server(("127.0.0.1", 0))
    chunk = bytes(1 << 20)

    def sink():
        conn, _ = server.accept()
        while conn.recv(1 << 20):
            pass
        conn.close()
    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(server.getsockname()) as c:
        start = time.monotonic()
        for _ in range(nbytes // len(chunk)):
            c.sendall(chunk)
    t.join()
    server.close()
    return nbytes * 8 / (time.monotonic() - start)


def wait_ready(cluster: Cluster, prefill: int, decode: int, within_s: float = READY_WITHIN_S) -> None:
    """Until /metrics shows that many live replicas per pool, with a request now and then (one
    run saw a running prefill replica left out of /metrics for minutes, until traffic came)."""
    deadline, last = time.monotonic() + within_s, "no answer"
    while time.monotonic() < deadline:
        try:
            live = {p: len(cluster.workers(p)) for p in ("prefill", "decode")}
            if live["prefill"] >= prefill and live["decode"] >= decode:
                return
            last = str(live)
            httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=30)
        except Exception as e:        # the proxy / ingress is not up yet
            last = repr(e)
        time.sleep(2)
    raise AssertionError(f"cluster not ready within {within_s:.0f} s: {last}")


@pytest.fixture(scope="module")
def cluster():
    require_namespaces()
    for tool in ("iptables", "tc"):
        if not shutil.which(tool):
            pytest.skip(f"chaos tests need `{tool}` (scripts/setup.sh installs iptables)")
    if not Path(REDIS_SERVER_BINARY).exists():
        pytest.skip(f"{REDIS_SERVER_BINARY} is not installed")
    shared = shared_prefix_prompts(groups=3, per_group=3, prefix=256, suffix=12)
    fresh = shared_prefix_prompts(groups=1, per_group=12, prefix=256, suffix=1024, seed=24)
    probe = shared_prefix_prompts(groups=2, per_group=1, prefix=256, suffix=12, seed=25)   # one per probe
    pool = ThreadPoolExecutor(1)    # the cold answers (~20 s of a core) come while the cluster comes up
    cold = pool.submit(lambda: (cold_tokens(shared, LONG_TOKENS), cold_tokens(fresh + probe, MAX_TOKENS)))
    try:
        with hosts_with_ray(5, "kvc", "10.214", {1: "prefill", 2: "prefill", 3: "decode", 4: "decode"}) \
                as (hosts, redis, ray):
            ray.serve_deploy(serve_config(redis.url, RELEASE_TIMEOUT_S))
            long, fresh_want = cold.result()
            prompts = {"short": shared, "long": shared, "fresh": fresh, "probe": probe}
            want = {"short": [w[:MAX_TOKENS] for w in long], "long": long, "fresh": fresh_want[:len(fresh)],
                    "probe": fresh_want[len(fresh):]}
            c = Cluster(hosts, ray, redis, prompts, want)
            wait_ready(c, 2, 2)
            yield c
            print("\n" + Row.HEADER + "\n" + "\n".join(r.line() for r in c.rows), file=sys.__stdout__, flush=True)
    finally:
        pool.shutdown()


def run_load(cluster: Cluster, before_s: float, fault, after_s: float, clients: int = 3, kind: str = "short"):
    """Load for `before_s`, then `fault()` (returns when the fault is over: the time then, or
    None), then load for `after_s` more. Returns (outcomes, fault start, fault end, what
    fault() said, /metrics before)."""
    before = scrape(cluster.url)
    said = []
    with cluster.load(clients, kind) as load:
        time.sleep(before_s)
        t0 = time.monotonic()
        said.append(fault())
        t1 = time.monotonic()
        time.sleep(after_s)
    return load.outcomes, t0, t1, said[0], before


def event_counts(m: dict) -> dict[str, float]:
    """The ingress's KV event counters and its route hints by source, from one scrape."""
    out = {name: total(m, f"kvmesh_{name}") for name in ("kv_event_resyncs_total", "kv_event_snapshots_total",
                                                         "kv_event_expired_total", "kv_event_publishers")}
    out.update({f"hints_{src}": total(m, "kvmesh_route_hints_total", source=src) for src in ("events", "index")})
    out["resyncing"] = total(m, "kvmesh_kv_event_resyncing")
    return out


def wait_for(url: str, what: str, ok, within_s: float) -> dict[str, float]:
    """Scrape `url` until `ok(event_counts)`; those counts (AssertionError naming `what` after `within_s`)."""
    deadline = time.monotonic() + within_s
    while True:
        counts = event_counts(scrape(url))
        if ok(counts):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {within_s:.0f} s: {counts}")
        time.sleep(0.5)


def probe(cluster: Cluster, i: int) -> None:
    """Probe prompt `i` (a prefix no other request has), its answer checked: one prefill replica
    now holds its blocks."""
    with httpx.Client(timeout=120) as http:
        o = one_request(http, cluster.url, cluster.prompts["probe"][i], cluster.want["probe"][i], stream=False)
    assert o.kind == "correct", o


def prefill_hits(m: dict) -> dict[tuple[str, str], float]:
    """(prefill worker, tier) -> prompt tokens it restored from that tier."""
    return {(dict(labels)["worker"], dict(labels)["tier"]): v for (name, labels), v in m.items()
            if name == "kvmesh:prefix_cache_hits_total" and dict(labels).get("pool") == "prefill"}


def repeat_goes_to_its_holder(cluster: Cluster, i: int) -> str:
    """Probe `i` again, idle and with the memory leases deleted from the index: routed by the KV
    events alone (no index lookup), it must land on the prefill replica that holds its blocks, so
    its whole hit comes from that replica's device pool (on the other it would come from the
    store); answer checked. What happened, for the row."""
    forget_leases(cluster.redis.url)
    before = scrape(cluster.url)
    probe(cluster, i)
    after = scrape(cluster.url)
    hits, was = prefill_hits(after), prefill_hits(before)
    gained = {k: v - was.get(k, 0) for k, v in hits.items() if v > was.get(k, 0)}
    routed = {k: event_counts(after)[k] - event_counts(before)[k] for k in ("hints_events", "hints_index")}
    assert routed == {"hints_events": 1, "hints_index": 0}, routed
    assert len(gained) == 1 and next(iter(gained))[1] == "device", (gained, event_counts(after))
    return f"repeat routed by events to its holder ({next(iter(gained.values())):.0f} device-pool tokens)"


def test_redis_restarted_empty_mid_load_fails_no_request_and_the_index_refills(cluster):
    import redis as redis_py
    client = redis_py.Redis(host=cluster.redis.host, port=cluster.redis.port, socket_timeout=5)
    wait_ready(cluster, 2, 2)

    def restart():
        keys = client.dbsize()
        cluster.redis.restart()         # nothing persisted: it comes back empty
        return keys
    outcomes, t0, t1, keys_before, before = run_load(cluster, 4, restart, 8)
    info, refilled = client.info("stats"), client.dbsize()
    client.close()
    held = cluster.settle()
    r = cluster.record(row("Redis restarted empty", outcomes, held, t1,
                           f"index keys {keys_before} before, {refilled} after; {info['keyspace_misses']} "
                           f"misses / {info['keyspace_hits']} hits since the restart; "
                           f"{handoffs(before, scrape(cluster.url))}"))
    assert not bad(outcomes), bad(outcomes)[:5]
    assert r.correct == r.sent > 0 and r.clean == 0, not_correct(outcomes)
    assert keys_before > 0 and refilled > 0, "writes to the index did not resume after the restart"
    assert info["keyspace_misses"] > 0, "no lookup reached the restarted index"
    assert held == 0
    # the router recovers: events flow again into the restarted Redis and route a repeat to its holder
    wait_for(cluster.url, "events after the restart", lambda c: c["kv_event_publishers"] == 4, EXPIRE_S)
    probe(cluster, 0)
    time.sleep(EVENTS_S)
    print(repeat_goes_to_its_holder(cluster, 0), file=sys.__stdout__, flush=True)


def test_the_kv_event_stream_lost_mid_load_costs_no_answer_and_the_router_resyncs(cluster):
    """Every namespace's event stream replaced by a string for LOST_S (each XADD and XREAD fails:
    what the ranks publish then is lost, a probe's blocks among it), then deleted: the publishers'
    next numbers show the gap, the router resyncs them by snapshot and routes the probe's repeat
    to its holder from events again."""
    client = redis_py_client(cluster)
    wait_ready(cluster, 2, 2)
    streams = list(client.scan_iter(match="kvmesh:*:events"))
    assert streams, "no KV event stream in the index's Redis"
    counts = event_counts(scrape(cluster.url))

    def lose():
        try:
            with client.pipeline() as pipe:       # MULTI: no XADD lands between the two
                for key in streams:
                    pipe.delete(key).set(key, "lost")
                pipe.execute()
            probe(cluster, 1)                     # computed while its stored events cannot be sent
            time.sleep(LOST_S)
        finally:
            client.delete(*streams)
    outcomes, t0, t1, _, before = run_load(cluster, 1, lose, 2)

    def resynced(c: dict) -> bool:       # ... by snapshot, every rank in sync again
        return (time.monotonic() > t1 + RESYNCED_S and c["resyncing"] == 0
                and c["kv_event_resyncs_total"] > counts["kv_event_resyncs_total"]
                and c["kv_event_snapshots_total"] > counts["kv_event_snapshots_total"])
    after = wait_for(cluster.url, "a resync by snapshot", resynced, 3 * EXPIRE_S)
    client.close()
    held = cluster.settle()
    r = cluster.record(row(f"KV event stream lost {LOST_S:.0f} s", outcomes, held, t1,
                           f"{after['kv_event_resyncs_total'] - counts['kv_event_resyncs_total']:.0f} resyncs, "
                           f"{after['kv_event_snapshots_total'] - counts['kv_event_snapshots_total']:.0f} "
                           f"snapshots; {handoffs(before, scrape(cluster.url))}"))
    assert not bad(outcomes), bad(outcomes)[:5]
    assert r.correct == r.sent > 0 and held == 0, (held, not_correct(outcomes))
    print(repeat_goes_to_its_holder(cluster, 1), file=sys.__stdout__, flush=True)


def redis_py_client(cluster: Cluster):
    import redis as redis_py
    return redis_py.Redis(host=cluster.redis.host, port=cluster.redis.port, socket_timeout=5)


def test_lossy_slow_link_between_prefill_and_decode_keeps_every_answer_correct(cluster):
    wait_ready(cluster, 2, 2)
    rate = loopback_bits_per_s() / 100
    fault_s, before_s = 12, 6          # before: the throughput and TTFT the row compares with

    def lossy_slow():
        try:
            cluster.links("-m", "statistic", "--mode", "random", "--probability", str(LOSS), "-j", "DROP")
            for ip in cluster.prefill + cluster.decode:
                cluster.hosts.netns(ip, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                                    f"{int(rate)}bit", "burst", "64kb", "latency", "100ms")
            time.sleep(fault_s)
        finally:
            cluster.restore_network()
    outcomes, t0, t1, _, before = run_load(cluster, before_s, lossy_slow, 1)
    base = [o for o in outcomes if o.end < t0]
    lossy = [o for o in outcomes if o.start >= t0 and o.end <= t1]
    held = cluster.settle()
    note = (f"{rate / 1e6:.0f} Mbit/s (loopback / 100) + {LOSS:.0%} loss: {len(lossy) / (t1 - t0):.2f} req/s "
            f"(before: {len(base) / t0_span(base):.2f}), median TTFT {ttft_median(lossy) * 1000:.0f} ms "
            f"(before: {ttft_median(base) * 1000:.0f} ms); {handoffs(before, scrape(cluster.url))}")
    r = cluster.record(row("lossy slow link P<->D", outcomes, held, None, note))
    assert not bad(outcomes), bad(outcomes)[:5]
    assert r.correct == r.sent and lossy, "every answer must be correct on a lossy link"
    assert held == 0


def t0_span(outcomes) -> float:
    return max(o.end for o in outcomes) - min(o.start for o in outcomes) if outcomes else float("nan")


def test_partition_between_prefill_and_decode_fails_handoffs_in_time_and_heals_without_restart(cluster):
    wait_ready(cluster, 2, 2)
    partition_s = 3 * RELEASE_TIMEOUT_S

    def partition():
        try:
            cluster.links("-j", "DROP")
            time.sleep(partition_s)
        finally:
            cluster.restore_network()
    outcomes, t0, t1, _, before = run_load(cluster, 3, partition, 12)
    held = cluster.settle()
    after = scrape(cluster.url)
    timeouts = total(after, "kvmesh_worker_held_timeouts") - total(before, "kvmesh_worker_held_timeouts")
    retries = total(after, "kvmesh_retries_total") - total(before, "kvmesh_retries_total")
    cut = [o for o in outcomes if o.start < t1 and o.end > t0]
    longest = max((o.end - max(o.start, t0) for o in cut), default=0.0)
    cluster.record(row(f"partition P-/-D {partition_s:.0f} s (iptables DROP)", outcomes, held, t1,
                           f"{retries:.0f} retries, {timeouts:.0f} held caches released by timeout, clean "
                           f"errors: {clean_codes(outcomes)}; longest wait after the cut {longest:.1f} s; "
                           f"{handoffs(before, after)}"))
    assert not bad(outcomes), bad(outcomes)[:5]
    assert longest < partition_s + HEALED_WITHIN_S, longest
    assert retries + timeouts > 0, "the partition cut no handoff"
    after_heal = [o for o in outcomes if o.start > t1 + 2]
    assert after_heal and all(o.kind == "correct" for o in after_heal), "not healed without a restart"
    assert held == 0


def by_mode(outcomes, t0: float) -> str:
    """What became of the requests open when the host died, streamed and not."""
    parts = []
    for stream, name in ((True, "streams"), (False, "non-streamed")):
        open_ = [o for o in outcomes if o.stream == stream and o.start < t0 < o.end]
        done = sum(o.kind == "correct" for o in open_)
        parts.append(f"{name} open at the kill: {done} finished elsewhere, {len(open_) - done} clean errors")
    return "; ".join(parts)


def kill_host_under_load(cluster: Cluster, pool: str, fault: str, before_s: float, clients: int, kind: str,
                         states: tuple[str, ...] = IN_FLIGHT):
    """Kill the first host of `pool` (every process, SIGKILL) while its replica has requests in
    `states`, under load; (outcomes, its row, the retries it caused)."""
    hosts = cluster.prefill if pool == "prefill" else cluster.decode
    victim = hosts[0]
    ranks = RANKS_PER_HOST
    known = event_counts(scrape(cluster.url))
    outcomes, t0, _, busy, before = run_load(cluster, before_s, lambda: cluster.kill_when_busy(victim, pool, states), 12,
                                             clients=clients, kind=kind)
    hosts.remove(victim)
    held = cluster.settle()
    retries = total(scrape(cluster.url), "kvmesh_retries_total") - total(before, "kvmesh_retries_total")
    r = cluster.record(row(fault, outcomes, held, t0, f"{busy}; {retries:.0f} retried on the other {pool} replica; "
                                                      f"{by_mode(outcomes, t0)}; clean errors: {clean_codes(outcomes)}"))
    assert not bad(outcomes), bad(outcomes)[:5]
    late = [o for o in outcomes if r.recover_s is not None and o.start > t0 + r.recover_s]
    assert late and all(o.kind == "correct" for o in late), f"the remaining {pool} replica does not serve"
    assert held == 0
    # the router forgot the killed ranks (silent EXPIRE_S): nothing of theirs is left to route to
    wait_for(cluster.url, "the killed ranks expired", lambda c: (
        c["kv_event_publishers"] == known["kv_event_publishers"] - ranks
        and c["kv_event_expired_total"] >= known["kv_event_expired_total"] + ranks), EXPIRE_S + 10)
    return outcomes, r, retries


def test_prefill_host_killed_mid_prefill_retries_on_the_other_or_503s(cluster):
    wait_ready(cluster, 2, 2)
    # 1,024 uncached prompt tokens per request: the kill finds requests in prefill
    kill_host_under_load(cluster, "prefill", "prefill host killed (SIGKILL all) mid-prefill", 0.5, 4, "fresh")


def test_decode_host_killed_with_streams_open_ends_or_finishes_them_and_the_other_serves(cluster):
    wait_ready(cluster, 1, 2)
    # 96-token answers: the kill finds streams open; a retry resumes one as a greedy continuation
    _, r, retries = kill_host_under_load(cluster, "decode", "decode host killed (SIGKILL all), streams open", 3, 3,
                                         "long", states=("running",))
    assert retries + r.clean > 0, "the kill cut no stream"


def test_a_decode_host_that_joins_late_takes_requests(cluster):
    wait_ready(cluster, 1, 1)
    old = set(cluster.workers("decode"))
    joined = {}

    def join():
        ip = cluster.hosts.add_host()
        cluster.ray.join(ip, "decode")      # Serve places the pool's missing replica there
        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline:
            served = per_worker(scrape(cluster.url), "generated_tokens", "decode")
            fresh = [w for w, v in served.items() if w not in old and v > 0]
            if fresh:
                joined.update(ip=ip, worker=fresh[0], at=time.monotonic())
                return
            time.sleep(1)
        raise AssertionError("no new decode replica served a request")
    outcomes, t0, _, _, before = run_load(cluster, 2, join, 5)
    held = cluster.settle()
    where = cluster.ray.replicas()
    r = cluster.record(dataclasses.replace(
        row("decode host joins late", outcomes, held, None,
            f"new replica on {where.get(joined['worker'])}; from creating the host to that replica's first "
            f"tokens; {handoffs(before, scrape(cluster.url))}"), recover_s=joined["at"] - t0))
    assert not bad(outcomes), bad(outcomes)[:5]
    assert where[joined["worker"]] == ("Decode", joined["ip"]), where
    assert r.correct == r.sent and held == 0, (held, not_correct(outcomes))
