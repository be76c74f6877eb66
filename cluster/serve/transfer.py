"""The handoff's transports in the cluster: NIXL (kvstore.transfer.nixl_transfer) and Ray objects.

    prefill worker                                   decode worker
    offer = await engine.offer_held(rid, transport)  ──▶ Loader(offer, ...).load(cache, block_ids, slot, reused)

Order of preference on the decode side: a NIXL READ straight from the prefill worker's
registered memory (which also notifies it to release); else the Ray-object copy of the same
tensors (the offer itself when prefill had no NIXL, or one fetched from the prefill worker
after a failed READ; never after a READ that timed out, whose bytes may still land). Every
failure is a HandoffError (kvstore.transfer.kv_transport).

Decode-side reuse: the decode engine passes `reused`, the leading prompt blocks its own device
pool already holds (same prefix hashes); the READ moves only the others + the state slot, and
the Ray copy fetched after a failed READ leaves them out too (`fetch_ray(offer, reused)`). A
Ray offer made before decode was known (prefill without NIXL, or decode without NIXL) carries
every block: decode writes only the ones it lacks. Each report says how many blocks were
reused and their bytes (/metrics `kvmesh_worker_handoff_reused_blocks`, `..._saved_bytes`).

With a data-parallel engine the cache sits on one rank of the replica, and the ranks may not be
Ray workers (offline they are plain local processes), so Ray objects stay on rank 0, the
front: a held cache on rank k is gathered there and its tensors travel to rank 0 over the
replica's channel, where `RayTransport.relay` puts them; a Ray offer for rank j is fetched on
rank 0 (`Loader.portable`) and its tensors travel to rank j. NIXL needs no relay: each rank
registers its own memory with its own agent, so offers name rank k's agent and READs land in
rank j's memory. A READ that failed on rank j > 0 (and is over) falls back too: rank 0 fetches
the Ray copy (`Loader.fallback`) and the request starts again on rank j with its tensors.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

import ray

from kvmesh.kvstore.transfer.kv_transport import (GatheredTransport, HandoffError, KVTransport, Offer, PortableLoad, TransferInFlight,
                                  TransferReport)

__all__ = ["HandoffError", "Loader", "RayTransport", "NIXL_UNAVAILABLE", "READ_FAILED"]
log = logging.getLogger(__name__)

# fallback reasons (metric label values, kept few)
NIXL_UNAVAILABLE = "nixl_unavailable"
READ_FAILED = "read_failed"


class RayTransport(GatheredTransport):
    """The handoff as a Ray object: an offer is a CPU copy of the blocks + slot (`gather`)
    in the object store; a load gets it and scatters it into the allocated blocks + slot."""
    name = "ray"

    def __init__(self, fingerprint: str, timeout_s: float = 30.0):
        super().__init__(fingerprint)
        self.timeout_s = timeout_s

    def offer(self, held, cache, skip: int = 0) -> Offer:
        return self.relay(super().offer(held, cache, skip))

    def relay(self, offer: Offer) -> Offer:
        """A gathered offer (a data-parallel rank's) as a Ray object."""
        if isinstance(offer.location, dict):
            offer = dataclasses.replace(offer, location=[ray.put(offer.location)])
        return offer

    def tensors(self, offer: Offer) -> dict:
        return ray.get(offer.location[0], timeout=self.timeout_s)


class Loader(PortableLoad):
    """The decode side of one handoff. The loader itself is the engine's Resume hook
    (`load(cache, block_ids, slot, reused)`), run on the engine thread: it loads `offer` with
    the transport of its kind, and when a NIXL READ fails, a Ray copy that `fetch_ray(offer,
    reused)` asks the prefill worker for (without the `reused` blocks decode holds). It raises
    HandoffError only (the engine then fails this request alone); `report` says how it went. A
    data-parallel engine placing the request on rank j > 0 takes `portable()` instead and
    `settle`s with that rank's report."""

    def __init__(self, offer: Offer, transports: dict[str, KVTransport],
                 fetch_ray: Callable[[Offer, int], Offer] | None,
                 counters: dict):
        self.offer, self.transports, self.fetch_ray, self.counters = offer, transports, fetch_ray, counters
        self.report: TransferReport | None = None
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
        """This worker cannot read NIXL: load the Ray copy `reply` (awaitable Offer) brings instead."""
        self.offer = dataclasses.replace(await reply, fallback_reason=NIXL_UNAVAILABLE)

    def _claim(self) -> Offer:
        with self._lock:
            if self._state != "pending":
                raise HandoffError(f"request {self.offer.request_id}: it ended before its cache was read")
            self._state = "loading"
        self.transports["ray"].check(self.offer)       # another engine's cache is refused before any copy
        return self.offer

    def portable(self) -> Offer:
        """The offer for a data-parallel rank: NIXL as it is (the rank READs with its own agent;
        if that fails, `fallback`), a Ray copy fetched here, its tensors in the offer."""
        offer = self._claim()
        return offer if offer.transport != "ray" else self._gathered(offer)

    def fallback(self) -> Offer:
        """A data-parallel rank's READ failed: prefill's Ray copy, its tensors in the offer."""
        if self.offer.transport != "nixl" or self.fetch_ray is None:
            raise HandoffError(f"request {self.offer.request_id}: no Ray copy to fall back to")
        return self._gathered(self._fetch(self.offer, "on a data-parallel rank"))

    def _fetch(self, offer: Offer, why, reused: int = 0) -> Offer:
        """Prefill's Ray copy of `offer` after a READ failed (`why`), without the first `reused` blocks."""
        try:
            return dataclasses.replace(self.fetch_ray(offer, reused), fallback_reason=READ_FAILED)
        except Exception as e:
            raise HandoffError(f"request {offer.request_id}: NIXL READ failed ({why}) and no Ray copy came from "
                               f"prefill: {type(e).__name__}: {e}") from e

    def _gathered(self, offer: Offer) -> Offer:
        try:
            return dataclasses.replace(offer, location=self.transports["ray"].tensors(offer))
        except Exception as e:
            raise HandoffError(f"request {offer.request_id}: the Ray copy could not be fetched: "
                               f"{type(e).__name__}: {e}") from e

    def settle(self, report: TransferReport) -> None:
        self.counters[f"{report.transport}_bytes"] += report.nbytes
        self.counters["fallbacks"] += report.fallback_reason is not None
        self.counters["handoff_reused_blocks"] += report.reused_blocks
        self.counters["handoff_saved_bytes"] += report.saved_bytes
        self.report = report

    def load(self, cache, block_ids: list[int], slot: int, reused: int = 0) -> TransferReport:
        offer = self._claim()
        try:
            report = self._transport(offer).load(offer, cache, block_ids, slot, reused)
        except HandoffError as e:
            # a READ still in flight may yet write these blocks: a Ray copy there would be overwritten
            if offer.transport != "nixl" or self.fetch_ray is None or isinstance(e, TransferInFlight):
                raise
            log.warning("request %s: NIXL READ failed, using a Ray copy: %s", offer.request_id, e)
            offer = self._fetch(offer, e, reused)
            report = self._transport(offer).load(offer, cache, block_ids, slot, reused)
        self.settle(report)
        return report

    __call__ = load

    def _transport(self, offer: Offer) -> KVTransport:
        transport = self.transports.get(offer.transport)
        if transport is None:
            raise HandoffError(f"request {offer.request_id}: this worker has no {offer.transport} transport")
        return transport
