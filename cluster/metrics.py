"""Prometheus metrics of the ingress (one private registry per ingress replica).

Latency and token counts are measured where the client sees them (the ingress). What
happens inside the pools (handoff bytes, fallbacks) arrives with each request's
chunks; worker counters (store bytes, queue lengths, free KV) come from the latest
snapshot each worker attached to a finished request.
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .messages import TransferReport, WorkerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RATE_WINDOW_S = 10.0


class WorkerSnapshots:
    """A collector over the latest WorkerStats of every worker seen: every numeric engine
    counter becomes `kvmesh_worker_<name>{pool, worker}` (running, waiting, free_blocks,
    cached_tokens, store bytes, ... whatever the engine reports)."""

    def __init__(self):
        self.latest: dict[str, WorkerStats] = {}

    def update(self, stats: WorkerStats) -> None:
        self.latest[stats.worker_id] = stats

    def collect(self):
        rows: dict[str, list[tuple[list[str], float]]] = {}
        for w in self.latest.values():
            values = {**w.engine, "nixl_bytes": w.nixl_bytes, "ray_bytes": w.ray_bytes, "fallbacks": w.fallbacks}
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    rows.setdefault(key, []).append(([w.pool, w.worker_id], float(value)))
        for key, samples in sorted(rows.items()):
            g = GaugeMetricFamily(f"kvmesh_worker_{key}", f"worker counter {key} (latest report)",
                                  labels=["pool", "worker"])
            for labels, value in samples:
                g.add_metric(labels, value)
            yield g


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmesh_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("kvmesh_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvmesh_time_per_output_token_seconds", "mean gap between output tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "prompt tokens", registry=r)
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
        self.workers = WorkerSnapshots()
        r.register(self.workers)
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

    def exposition(self) -> bytes:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._recent) / RATE_WINDOW_S)
        return generate_latest(self.registry)


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
        self.last, self.count = now, self.count + n
        self.metrics.tokens(n)

    def done(self) -> None:
        if self.first is not None and self.count > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.count - 1))
