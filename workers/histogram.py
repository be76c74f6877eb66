"""A cumulative latency histogram kept inside the engine (plain Python: no Prometheus or
Ray below cluster/); the ingress exports each worker's as a Prometheus histogram."""
from __future__ import annotations

import bisect

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = QUEUE_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count)...], "sum", "count"} (Prometheus' shape)."""
        cum, rows = 0, []
        for bound, n in zip(list(self.bounds) + [float("inf")], self.counts):
            cum += n
            rows.append((bound, cum))
        return {"buckets": rows, "sum": self.sum, "count": cum}
