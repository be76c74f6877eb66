"""The decode side of one handoff: fill freshly allocated blocks + slot from prefill.

Order of preference: a NIXL READ straight from the prefill worker's registered memory
(which also notifies it to release); else the Ray-object copy of the same tensors
(`Handoff.payload`, or one fetched from the prefill worker after a failed READ). The
state slot always travels with the blocks: both paths move exactly
`CacheTensors.block_regions(blocks, slot)` / `gather(blocks, slot)`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from kvstore.nixl_transfer import KVTransferAgent, TransferError

from .messages import Handoff, TransferReport

log = logging.getLogger(__name__)

# fallback reasons (metric label values, kept few)
NIXL_UNAVAILABLE = "nixl_unavailable"
READ_FAILED = "read_failed"


class HandoffError(RuntimeError):
    """The cache could not be moved from prefill to decode; the request may be retried."""


class Loader:
    """`load(cache, block_ids, slot)` is the engine's Resume hook. It runs on the engine
    thread, which must survive any transfer problem, so it never raises: a failure is
    left in `error` and the decode request is aborted by its caller."""

    def __init__(self, handoff: Handoff, agent: KVTransferAgent | None, fetch_export: Callable,
                 counters: dict, timeout_s: float):
        self.handoff, self.agent, self.fetch_export = handoff, agent, fetch_export
        self.counters, self.timeout_s = counters, timeout_s
        self.prefetched = None           # a Ray ref fetched before the engine asked
        self.report: TransferReport | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._state = "pending"          # -> "loading" (decode owns the transfer) | "given_back"

    def give_back(self) -> bool:
        """The request ended before its cache was read: True if the READ never started and
        never will (prefill may free the cache now); False if it started (the READ's
        notification, or prefill's timeout, frees it)."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "given_back"
            return True

    async def prefetch(self, reply) -> None:
        self.prefetched = (await reply)[0]

    def load(self, cache, block_ids: list[int], slot: int) -> None:
        start = time.monotonic()
        h = self.handoff
        with self._lock:
            if self._state != "pending":
                self.error = "the request ended before its cache was read"
                return
            self._state = "loading"
        try:
            if len(block_ids) != h.num_blocks:
                raise HandoffError(f"decode allocated {len(block_ids)} blocks for {h.num_blocks} held by prefill")
            reason = h.fallback_reason
            ref = self.prefetched or (h.payload[0] if h.payload else None)
            if ref is None and self.agent is not None:
                try:
                    n = self.agent.read(h.source, cache.block_regions(block_ids, slot),
                                        f"release:{h.request_id}".encode(), self.timeout_s)
                    self.counters["nixl_bytes"] += n
                    self.report = TransferReport("nixl", n, time.monotonic() - start)
                    return
                except TransferError as e:
                    log.warning("request %s: NIXL READ failed, using a Ray copy: %s", h.request_id, e)
                    reason, ref = READ_FAILED, self.fetch_export(h)[0]
            elif self.prefetched is not None:
                reason = NIXL_UNAVAILABLE
            tensors = ray.get(ref, timeout=self.timeout_s)
            cache.scatter(block_ids, slot, tensors)
            n = sum(t.numel() * t.element_size() for t in tensors.values())
            self.counters["ray_bytes"] += n
            self.counters["fallbacks"] += reason is not None
            self.report = TransferReport("ray", n, time.monotonic() - start, reason)
        except Exception as e:   # noqa: BLE001 - reported through `error`, see the class docstring
            log.exception("request %s: handoff failed", h.request_id)
            self.error = f"{type(e).__name__}: {e}"
