"""Prometheus metrics of the deployment, served at the ingress's /metrics.

Latency and token counts are measured where the client sees them (the ingress). What
happens inside the pools (handoff bytes, fallbacks) arrives with each request's chunks.
Each ingress replica records into a registry of its own; a scrape, whichever replica the
proxy gives it to, asks every ingress replica for its series and serves their sum
(`merge_families`), so the totals are the deployment's with any number of ingress replicas
(`kvmesh_ingress_replicas_scraped` says how many answered). Worker state is read the same way,
at scrape time from every live replica of every pool (`scrape_pools`), so gauges are current and
a replica that is gone drops out. Replicas are found through Serve's router for each deployment
(routing.live_replica_ids), never by Serve's private actor names. Names follow vLLM's (`kvmesh:` for `vllm:`) where vLLM has the metric,
so its dashboards translate:

| kvmesh                                      | vLLM                                   |
| kvmesh:num_requests_running / _waiting      | vllm:num_requests_running / _waiting   |
| kvmesh:kv_cache_usage_perc                  | vllm:kv_cache_usage_perc (0..1)        |
| kvmesh:prefix_cache_queries_total           | vllm:prefix_cache_queries (tokens)     |
| kvmesh:prefix_cache_hits_total{tier}        | vllm:prefix_cache_hits (tokens), by tier|
| kvmesh:request_queue_time_seconds           | vllm:request_queue_time_seconds        |
| kvmesh_time_to_first_token_seconds          | vllm:time_to_first_token_seconds       |
| kvmesh:inter_token_latency_seconds          | vllm:inter_token_latency_seconds       |
| kvmesh:e2e_request_latency_seconds          | vllm:e2e_request_latency_seconds       |
| kvmesh:request_prompt_tokens / _generation_ | vllm:request_prompt_tokens / _generation_tokens |
| kvmesh_prompt_tokens_total / _generated_... | vllm:prompt_tokens / generation_tokens |

A data-parallel replica reports its ranks summed in the series above, and each rank on its
own as `kvmesh_rank_<name>{pool, worker, rank}` (every numeric engine counter, and
`kvmesh_rank_prefix_hit_tokens{..., tier}`): which rank holds what, and how loaded each is.
"""
from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import deque
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvmesh.workers.engine.stats import StoreCounters

from kvmesh.cluster.messages import RouteHint, TransferReport, WorkerStats
from kvmesh.cluster.serve.routing import detached, live_replica_ids
from kvmesh.kvstore.log_once import LogOnce

log = logging.getLogger(__name__)
_missed = LogOnce(log)      # a replica that misses scrapes: warned once, debug after
SCRAPE_TIMEOUT_S = 5.0      # per replica; under Prometheus's default scrape_timeout (10 s)
EVENT_VIEW_PREFIX = "kvmesh_kv_event"      # each ingress replica's own view of the KV event stream

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RATE_WINDOW_S = 10.0


class WorkerSnapshots:
    """A collector over the live WorkerStats of every replica, read at scrape time:
    vLLM-named gauges, counters and the queue-time histogram per {pool, worker}, and every
    other numeric engine counter as `kvmesh_worker_<name>{pool, worker}`."""

    def __init__(self):
        self.latest: dict[str, WorkerStats] = {}
        self._source: Callable[[], Awaitable[list[WorkerStats]]] | None = None

    def attach(self, source: Callable[[], Awaitable[list[WorkerStats]]]) -> None:
        self._source = source

    def update(self, stats: WorkerStats) -> None:
        if self._source is None:       # without a live source, the latest report stands in
            self.latest[stats.worker_id] = stats

    async def refresh(self) -> None:
        if self._source is not None:
            self.latest = {w.worker_id: w for w in await self._source()}

    def collect(self):
        workers = list(self.latest.values())
        yield from self._vllm_named(workers)
        yield self._scrubbed(workers)
        yield from _numeric_gauges("kvmesh_worker_", "worker counter", ["pool", "worker"], [
            ([w.pool, w.worker_id], {**w.engine.as_dict(), "nixl_bytes": w.nixl_bytes, "ray_bytes": w.ray_bytes,
                                     "fallbacks": w.fallbacks, "held_timeouts": w.held_timeouts,
                                     "handoff_reused_blocks": w.handoff_reused_blocks,
                                     "handoff_saved_bytes": w.handoff_saved_bytes, "serving": w.serving,
                                     "grammar_gate_waiting": w.grammar_gate_waiting,
                                     "grammar_busy_refusals": w.grammar_busy_refusals}) for w in workers])
        ranks = [([w.pool, w.worker_id, str(r)], engine) for w in workers for r, engine in enumerate(w.ranks)]
        if not ranks:
            return
        yield from _numeric_gauges("kvmesh_rank_", "data-parallel rank counter", ["pool", "worker", "rank"],
                                   [(ids, engine.as_dict()) for ids, engine in ranks])
        hits = GaugeMetricFamily("kvmesh_rank_prefix_hit_tokens", "prompt tokens a data-parallel rank restored, "
                                 "by tier", labels=["pool", "worker", "rank", "tier"])
        for ids, engine in ranks:
            for tier, n in engine.reuse.hit_tokens_by_tier.items():
                hits.add_metric(ids + [tier], float(n))
        yield hits

    @staticmethod
    def _scrubbed(workers: list[WorkerStats]) -> CounterMetricFamily:
        """Objects the background store scrub checked (kvstore/store/scrub.py), by what became of them."""
        family = CounterMetricFamily("kvmesh_store_scrub_objects", "store objects the background scrub checked: "
                                     "ok, removed (unusable) or quarantined (unusable, not removable)",
                                     labels=["pool", "worker", "result"])
        for w in workers:
            for result, n in (w.engine.store or StoreCounters()).scrub_objects.items():
                family.add_metric([w.pool, w.worker_id, result], float(n))
        return family

    @staticmethod
    def _vllm_named(workers: list[WorkerStats]):
        labels = ["pool", "worker"]
        gauges = {"kvmesh:num_requests_running": (lambda e: e.running, "requests in the engine's running batch"),
                  "kvmesh:num_requests_waiting": (lambda e: e.waiting, "requests waiting for admission"),
                  "kvmesh:kv_cache_usage_perc": (lambda e: e.kv_cache_usage, "fraction of KV blocks in use (0..1)"),
                  "kvmesh:kv_cache_free_blocks": (lambda e: e.free_blocks, "free (or evictable) KV blocks")}
        for name, (value, doc) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            for w in workers:
                g.add_metric([w.pool, w.worker_id], float(value(w.engine)))
            yield g
        queries = CounterMetricFamily("kvmesh:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("kvmesh:prefix_cache_hits", "prompt tokens restored, by the tier they came "
                                   "from (device pool, host memory, shared store)", labels=labels + ["tier"])
        store = CounterMetricFamily("kvmesh:store_bytes", "bytes read from / written to the shared store",
                                    labels=labels + ["direction"])
        nixl = CounterMetricFamily("kvmesh:nixl_bytes", "KV bytes this worker read over NIXL", labels=labels)
        queue = HistogramMetricFamily("kvmesh:request_queue_time_seconds", "arrival to first scheduled step",
                                      labels=labels)
        for w in workers:
            e, ids = w.engine, [w.pool, w.worker_id]
            queries.add_metric(ids, float(e.reuse.query_tokens))
            for tier, n in e.reuse.hit_tokens_by_tier.items():
                hits.add_metric(ids + [tier], float(n))
            io = e.store or StoreCounters()       # no shared store: nothing read or written
            store.add_metric(ids + ["read"], float(io.bytes_read))
            store.add_metric(ids + ["write"], float(io.bytes_written))
            nixl.add_metric(ids, float(w.nixl_bytes))
            q = e.queue_time
            queue.add_metric(ids, [(_le(b), float(c)) for b, c in q["buckets"]], q["sum"])
        yield from (queries, hits, store, nixl, queue)


def _numeric_gauges(prefix: str, doc: str, labels: list[str], sources: list[tuple[list[str], dict]]):
    """One gauge family `{prefix}{key}` per numeric key of the sources' maps, a sample per source."""
    rows: dict[str, list[tuple[list[str], float]]] = {}
    for ids, values in sources:
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.setdefault(key, []).append((ids, float(value)))
    for key, samples in sorted(rows.items()):
        g = GaugeMetricFamily(f"{prefix}{key}", f"{doc} {key} (read at scrape)", labels=labels)
        for ids, value in samples:
            g.add_metric(ids, value)
        yield g


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


async def each_replica(handle, method: str, identify: Callable[[object], str | None],
                       timeout_s: float = SCRAPE_TIMEOUT_S, skip: str | None = None) -> dict[str, object]:
    """{replica id: `method`'s answer} from every replica Serve routes `handle`'s deployment to
    (routing.live_replica_ids: the router's own replica set, no private actor names), each call
    pinned to its replica by a `require_worker` hint. `identify(answer)` names the replica that
    answered: an answer from another one (a pin the router could not honour) is dropped, never
    counted twice. A replica that does not answer within timeout_s is left out, with a warning
    (once per replica). `skip`: a replica not to call (the caller itself, which reads its own)."""
    app, name = handle.app_name, handle.deployment_name
    ids = live_replica_ids(app, name)
    if not ids:     # no call went through this process's router for it yet: the first makes it,
        deadline = time.monotonic() + timeout_s             # then Serve's update names the replicas
        try:
            await asyncio.wait_for(_await(detached(getattr(handle, method).remote)), timeout_s)
        except Exception as e:
            log.debug("metrics: %s.%s did not answer: %r", name, method, e)
        while not (ids := live_replica_ids(app, name)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        ids = ids or []
    calls = [(wid, detached(lambda wid=wid: getattr(handle, method).remote(hint=RouteHint(require_worker=wid))))
             for wid in ids if wid != skip]
    results = await asyncio.gather(*(asyncio.wait_for(_await(c), timeout_s) for _, c in calls),
                                   return_exceptions=True)
    out = {}
    for (wid, _), r in zip(calls, results):
        if isinstance(r, BaseException):
            _missed(f"{name}:{wid}", "metrics: replica %s of %s did not answer a scrape within %.0f s (%s): "
                    "its series are left out of this one", wid, name, timeout_s, type(r).__name__)
        elif identify(r) != wid:
            _missed(f"{name}:{wid}:routed", "metrics: a scrape of replica %s of %s was answered by %s: "
                    "left out", wid, name, identify(r))
        else:
            out[wid] = r
    return out


async def scrape_pools(pools: dict, timeout_s: float = SCRAPE_TIMEOUT_S) -> list[WorkerStats]:
    """Every live replica of every pool's counters (each_replica)."""
    answers = await asyncio.gather(*(each_replica(h, "stats", _stats_worker, timeout_s) for h in pools.values()))
    return [r for got in answers for r in got.values()]


def pool_replica_states(pools: dict) -> dict[str, dict[str, int]]:
    """{pool: {state: replicas}} of the pools' deployments, from Serve's controller (blocking: a
    call to it; `pools` maps a pool's name to its deployment handle)."""
    from ray import serve
    out: dict[str, dict[str, int]] = {}
    apps = serve.status().applications
    for pool, handle in pools.items():
        app = apps.get(handle.app_name)
        deployment = app.deployments.get(handle.deployment_name) if app else None
        out[pool] = {str(getattr(k, "value", k)): int(n) for k, n in (deployment.replica_states if deployment else {}).items()}
    return out


def _stats_worker(answer: object) -> str | None:
    return answer.worker_id if isinstance(answer, WorkerStats) else None


def merge_families(replicas: list[list[Metric]]) -> list[Metric]:
    """The ingress replicas' families as one: each sample summed over the replicas (a counter or
    histogram of the deployment is the sum of its replicas'; so are in-flight and rate gauges),
    except the KV event index's (`kvmesh_kv_event*`), where every replica follows the same stream:
    the largest (the most caught-up view). `_created` samples are left out (no sum is meaningful)."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for families in replicas:
        for f in families:
            if f.name not in merged:
                merged[f.name] = Metric(f.name, f.documentation, f.type, f.unit)
                values[f.name] = {}
            combine = max if f.name.startswith(EVENT_VIEW_PREFIX) else operator.add
            acc = values[f.name]
            for sample in f.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                acc[key] = combine(acc[key], sample.value) if key in acc else sample.value
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(merged.values())


async def _await(response):
    return await response


async def _none():
    return None


class _Families:
    """Fixed families, as generate_latest reads a registry."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return iter(self._families)


class RoutingCounters:
    """A collector over the ingress's prefix locator, read at scrape time: how each hint was made
    (`kvmesh_route_hints_total{source=...}`: "events", from the KV events in memory; "index", by an index
    lookup; "index_slow" / "index_busy", none, the lookup outlasting its budget or every lookup thread
    busy, so routed by load) and the event index's counters (events applied, resyncs, snapshots, publishers expired,
    publishers known, those waiting for a snapshot, distinct blocks by tier)."""

    def __init__(self):
        self.locator = None

    def attach(self, locator) -> None:
        self.locator = locator

    def collect(self):
        if self.locator is None:
            return
        hints = CounterMetricFamily("kvmesh_route_hints", "routing hints by where they came from", labels=["source"])
        for source, n in self.locator.hints.items():
            hints.add_metric([source], n)
        yield hints
        events = self.locator.events
        if events is None:
            return
        s = events.stats
        for name, help_, value in (("kv_events", "KV events applied", s.events),
                                   ("kv_event_resyncs", "publishers resynced (a gap or a late join)", s.gaps),
                                   ("kv_event_snapshots", "snapshots applied", s.snapshots),
                                   ("kv_event_expired", "publishers forgotten after silence", s.expired)):
            yield CounterMetricFamily(f"kvmesh_{name}", help_, value=value)
        yield GaugeMetricFamily("kvmesh_kv_event_publishers", "engine ranks the event index knows",
                                value=len(events.loads()))
        yield GaugeMetricFamily("kvmesh_kv_event_resyncing", "engine ranks waiting for their snapshot (known "
                                "to hold nothing until it comes)", value=events.resyncing())
        blocks = GaugeMetricFamily("kvmesh_kv_event_blocks", "distinct blocks the event index knows, by tier",
                                   labels=["tier"])
        for tier, n in events.tier_sizes().items():
            blocks.add_metric([tier], float(n))
        yield blocks


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmesh_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("kvmesh_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvmesh:inter_token_latency_seconds", "gap between successive output chunks "
                             "per token", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvmesh:e2e_request_latency_seconds", "arrival to the last token",
                             buckets=LATENCY_BUCKETS + (60.0, 120.0), registry=r)
        self.request_prompt = Histogram("kvmesh:request_prompt_tokens", "prompt tokens per request",
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation = Histogram("kvmesh:request_generation_tokens", "output tokens per request",
                                            buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("kvmesh_time_per_output_token_seconds", "mean gap between output tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "prompt tokens", registry=r)
        self.prefill_route = Counter("kvmesh_prefill_route", "where a disaggregated deployment ran each prompt: "
                                     "prefill_pool (then a handoff), decode_short (its uncached part was short) or "
                                     "decode_queue (the prefill pool's queue was long)", ["route"], registry=r)
        self.generated_tokens = Counter("kvmesh_generated_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("kvmesh_cached_tokens", "prompt tokens reused instead of computed",
                                     registry=r)
        self.tokens_per_s = Gauge("kvmesh_generated_tokens_per_second",
                                  f"generated tokens per second over the last {RATE_WINDOW_S:.0f}s", registry=r)
        self.handoff_bytes = Counter("kvmesh_handoff_bytes", "prefill->decode bytes by transport", ["transport"],
                                     registry=r)
        self.handoff_seconds = Histogram("kvmesh_handoff_seconds", "prefill->decode transfer time",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.fallbacks = Counter("kvmesh_handoff_fallbacks", "handoffs that fell back to Ray objects",
                                 ["reason"], registry=r)
        self.queue_depth = Gauge("kvmesh_queue_depth", "requests in flight at this ingress per pool", ["pool"],
                                 registry=r)
        self.retries = Counter("kvmesh_retries", "requests re-run after a worker failed", registry=r)
        self.workers = WorkerSnapshots()        # read at scrape, not summed: each replica's own series
        self.routing = RoutingCounters()
        r.register(self.routing)
        self._recent: deque[tuple[float, int]] = deque()

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def transfer(self, report: TransferReport) -> None:
        self.handoff_bytes.labels(report.transport).inc(report.nbytes)
        self.handoff_seconds.observe(report.seconds)
        if report.fallback_reason:
            self.fallbacks.labels(report.fallback_reason).inc()

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens.inc(n)
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def families(self) -> list[Metric]:
        """This ingress replica's own series, read now (what `exposition` sums over the replicas)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._recent) / RATE_WINDOW_S)
        return list(self.registry.collect())

    async def exposition(self, ingress: Callable[[], Awaitable[dict[str, list[Metric]]]] | None = None,
                         pools: Callable[[], Awaitable[dict[str, dict[str, int]]]] | None = None,
                         planner: Callable[[], Awaitable[dict | None]] | None = None) -> bytes:
        """The text of /metrics: every ingress replica's series summed (`ingress()`: each replica's
        `families()`; None, or no answer: this replica's alone), then the workers' (WorkerSnapshots),
        then each pool's replicas by state as Serve's controller counts them (`pools()`:
        {pool: {state: n}}, starting ones included, which no worker scrape can see), then the P/D
        planner's decisions (`planner()`: its last published snapshot, cluster/serve/autoscale.py)."""
        replicas, _, states, plan = await asyncio.gather(ingress() if ingress else _none(), self.workers.refresh(),
                                                         pools() if pools else _none(),
                                                         planner() if planner else _none())
        replicas = list((replicas or {}).values()) or [self.families()]
        scraped = GaugeMetricFamily("kvmesh_ingress_replicas_scraped", "ingress replicas whose series this "
                                    "scrape summed", value=len(replicas))
        extra = [scraped]
        if states:
            family = GaugeMetricFamily("kvmesh_pool_replicas", "replicas of each pool by state (Serve's "
                                       "controller: STARTING, RUNNING, STOPPING, ...)", labels=["pool", "state"])
            for pool, by_state in states.items():
                for state, n in by_state.items():
                    family.add_metric([pool, state], float(n))
            extra.append(family)
        if plan:
            extra += planner_families(plan)
        return generate_latest(_Families(merge_families(replicas) + extra + list(self.workers.collect())))


def planner_families(plan: dict) -> list[Metric]:
    """The P/D planner's snapshot as series: decisions by pool and reason, and per pool the replicas it
    targets and the replicas the load needs (before hysteresis and budgets)."""
    decisions = CounterMetricFamily("kvmesh_planner_decisions", "the P/D planner's decisions by pool and reason "
                                    "(cluster/serve/planner.py REASONS)", labels=["pool", "reason"])
    for pool, reasons in plan.get("reasons", {}).items():
        for reason, n in reasons.items():
            decisions.add_metric([pool, reason], float(n))
    target = GaugeMetricFamily("kvmesh_planner_target_replicas", "replicas the planner's last decision set "
                               "(dry-run: would set)", labels=["pool"])
    need = GaugeMetricFamily("kvmesh_planner_needed_replicas", "replicas the load needs, before hysteresis and "
                             "budgets", labels=["pool"])
    for pool, n in plan.get("targets", {}).items():
        target.add_metric([pool], float(n))
    for pool, n in plan.get("needs", {}).items():
        need.add_metric([pool], float(n))
    dry = GaugeMetricFamily("kvmesh_planner_dry_run", "1 when the planner only logs its decisions",
                            value=1.0 if plan.get("dry_run") else 0.0)
    return [decisions, target, need, dry]


class RequestTimer:
    """Per-request latency: TTFT at the first token, mean TPOT at the end."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.start = metrics, time.monotonic()
        self.first: float | None = None
        self.last = self.start
        self.count = 0

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - self.last) / n)
        self.last, self.count = now, self.count + n
        self.metrics.tokens(n)

    def done(self, prompt_tokens: int = 0) -> None:
        if self.first is not None and self.count > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.count - 1))
        if self.first is not None:
            self.metrics.e2e.observe(self.last - self.start)
            self.metrics.request_prompt.observe(prompt_tokens)
            self.metrics.request_generation.observe(self.count)
