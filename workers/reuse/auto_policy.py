"""The adaptive part of `swa_policy: auto`: the checkpoint period, re-chosen as the engine runs.

It measures what the cost model needs — prefill tokens/s and the fixed cost of a forward
step (a least-squares fit over the engine's steps), the store's read and write bandwidth (from restores and the write-behind thread)
— records each request's block chain, and every `every` requests asks
`kvmesh.kvstore.policy.cost.PeriodTuner` for the period that stores least within a whisker of the best
TTFT on the recent requests. Branch-point checkpoints and unread-first eviction are not
here: they hold for any auto period (`PrefixCache`, `ObjectStore`).
"""
from __future__ import annotations

import dataclasses
import time

from kvmesh.kvstore.policy.cost import Hardware, PeriodTuner
from kvmesh.kvstore.device.layout import CacheLayout
from kvmesh.kvstore.policy.trace import TraceRequest

# Until measured: figures of a slow CPU and a local disk; replaced by measurements as they come.
DEFAULT_HW = Hardware(prefill_tokens_per_s=2_000.0, store_read_bps=1e9, store_write_bps=5e8)


class AutoPeriod:
    def __init__(self, layout: CacheLayout, every: int = 64, window: int = 256, hw: Hardware = DEFAULT_HW,
                 capacity_bytes: int | None = None):
        hw = dataclasses.replace(hw, capacity_bytes=capacity_bytes)
        self.tuner = PeriodTuner(layout, hw, every=every, window=window)
        self.hw = hw
        self.steps = [0, 0.0, 0.0, 0.0, 0.0]   # n, Σ tokens, Σ seconds, Σ tokens², Σ tokens·seconds
        self.reads = [0, 0.0]        # bytes, seconds
        self.writes = [0, 0.0]
        self.choices: dict[int, int] = {}   # requests seen -> period chosen then

    @property
    def period(self) -> int:
        return self.tuner.period

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One forward step: `tokens` run in `seconds` (fits seconds = step_s + tokens / tps)."""
        for i, v in enumerate((1, tokens, seconds, tokens * tokens, tokens * seconds)):
            self.steps[i] += v

    def _fit_steps(self) -> tuple[float, float] | None:
        """(step_s, tokens/s) by least squares over the steps seen, once they vary in size."""
        n, sx, sy, sxx, sxy = self.steps
        var = n * sxx - sx * sx
        if n < 8 or var <= 0:
            return None
        slope = (n * sxy - sx * sy) / var
        if slope <= 0:
            return None
        return max((sy - slope * sx) / n, 0.0), 1.0 / slope

    def observe_store(self, read: tuple[int, float], written: tuple[int, float]) -> None:
        """Totals so far: (bytes, seconds) read by restores and written by the store."""
        self.reads, self.writes = list(read), list(written)

    def measured(self) -> Hardware:
        def rate(pair, default):
            return pair[0] / pair[1] if pair[0] and pair[1] > 0 else default
        h = self.hw
        step_s, tps = self._fit_steps() or (h.step_s, h.prefill_tokens_per_s)
        return Hardware(tps, rate(self.reads, h.store_read_bps), rate(self.writes, h.store_write_bps),
                        h.capacity_bytes, step_s=step_s)

    def observe_request(self, hashes: list[int], prompt_tokens: int) -> None:
        """A request arrived with these full-block prefix hashes; maybe re-choose the period."""
        self.tuner.observe(TraceRequest(time.monotonic(), tuple(hashes), prompt_tokens, 0))
        if self.tuner.due():
            self.tuner.update_hardware(self.measured())
            self.choices[self.tuner.count] = self.tuner.choose()
