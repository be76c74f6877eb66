"""The prefill -> decode handoff of one request's cache: one interface, any transport.

    source (prefill engine thread)            destination (decode engine thread)
    offer = transport.offer(held, cache) ───▶ report = transport.load(offer, cache, block_ids, slot, reused)
      ... blocks + slot stay held until the destination has read them (or a timeout) ...

An `Offer` is plain data (it travels in the cluster's Handoff message): which request, the
source engine's fingerprint, how many blocks, and where the bytes are (a NIXL remote
description, a Ray object, ...). `load` fills blocks + a state slot the destination has
allocated, exactly `CacheTensors.block_regions(block_ids, slot)` / `gather(block_ids, slot)`,
so the state slot always travels with the blocks. A destination that already holds the first
`reused` blocks (its prefix cache: the same prefix hashes) moves only the rest + the slot: a
NIXL READ of those regions only; a gathered copy made with `offer(..., skip=k)` leaves the
first k blocks out of the copy itself (k <= reused). Both methods raise `HandoffError` and
nothing else; a destination whose engine fingerprint differs refuses the offer. A load that
gave up while its bytes may still arrive raises `TransferInFlight`: its blocks + slot stay
out of use until the transfer is over.

Implementations: `kvmesh.kvstore.transfer.nixl_transfer.NixlTransport` (a NIXL READ, no Ray),
`GatheredTransport` (the tensors in the offer itself) and `kvmesh.cluster.serve.transfer.RayTransport`
(the same tensors in a Ray object). A data-parallel engine moves a load to the rank it places
the request on as a `PortableLoad` (engine/dp_rank.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:     # types only: the ingress reads offers and reports without torch
    import torch

    from kvmesh.kvstore.device.cache_tensors import CacheTensors


class HandoffError(RuntimeError):
    """The cache could not be moved from prefill to decode; the request may be retried."""


class TransferInFlight(HandoffError):
    """A READ was given up (it timed out) while its data can still land in the destination's
    memory: UCX cannot cancel it, and a cut link delivers it once it heals. The blocks and slot
    it reads into must not be reused until `settled()` returns True (the READ is over)."""

    def __init__(self, message: str, settled: Callable[[], bool]):
        super().__init__(message)
        self.settled = settled


class HeldKV(NamedTuple):
    """A prefilled request whose blocks and state slot stay allocated until released."""
    request_id: str
    block_ids: list[int]
    slot: int
    num_tokens: int          # prompt tokens in the cache (the first output token is not)
    tokens: list[int]        # prompt + first token
    rng_state: torch.Tensor | None = None   # the request's sampler state after the first token
    fingerprint: str = ""    # the holding engine's model fingerprint (kvstore.hashing)
    mtp: Any = None          # the draft layer's small per-request state (workers.request.MTPHandoff): it
                             # travels in the handoff message, not through a transport


@dataclass(frozen=True)
class Offer:
    """Where one held request's cache can be read from."""
    request_id: str
    fingerprint: str                # the source engine's: a destination with another one refuses it
    num_blocks: int
    nbytes: int
    transport: str                  # the KVTransport.name that made it ("nixl" | "ray")
    location: Any                   # nixl: RemoteKV; ray: [ObjectRef] (a list, so the ref travels unresolved),
                                    # or the gathered tensors themselves (GatheredTransport)
    fallback_reason: str | None = None   # set when the preferred transport could not be used
    skipped: int = 0                # leading blocks left out of `location` (the destination holds them)
    # wall-clock time (time.time()) after which the source may free and reuse the memory: a
    # one-sided READ must be over by then, or it reads another request's cache
    readable_until: float | None = None


@dataclass(frozen=True)
class TransferReport:
    """How one handoff moved the cache from prefill to decode."""
    transport: str                  # "nixl" | "ray"
    nbytes: int
    seconds: float
    fallback_reason: str | None = None   # set when NIXL was wanted but the Ray path was used
    reused_blocks: int = 0          # leading blocks the destination already held: not moved
    saved_bytes: int = 0            # their bytes


class KVTransport(ABC):
    """Moves held caches between engines that share a fingerprint.

    Subclasses implement `offer` and `_read`; `load` checks the offer (fingerprint, block
    count, transport) and turns any failure into HandoffError. Both run on an engine thread
    (between steps), so they may touch the cache tensors."""
    name = ""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    @abstractmethod
    def offer(self, held: HeldKV, cache: CacheTensors, skip: int = 0) -> Offer:
        """Source side: make `held`'s blocks + slot readable by a destination (all but the
        first `skip` blocks, which the destination holds)."""

    @abstractmethod
    def _read(self, offer: Offer, cache: CacheTensors, block_ids: list[int], slot: int, reused: int) -> int:
        """Fill block_ids[reused:] + slot from `offer`; returns the bytes moved."""

    def load(self, offer: Offer, cache: CacheTensors, block_ids: list[int], slot: int,
             reused: int = 0) -> TransferReport:
        """Destination side: fill the freshly allocated `block_ids` + `slot` from `offer`;
        `block_ids[:reused]` already hold the first `reused` blocks (nothing moves for them)."""
        self.check(offer)
        if not offer.skipped <= reused <= offer.num_blocks:
            raise HandoffError(f"request {offer.request_id}: the destination holds {reused} of the "
                               f"{offer.num_blocks} blocks and the offer leaves out the first {offer.skipped}")
        if offer.transport != self.name:
            raise HandoffError(f"request {offer.request_id}: a {offer.transport} offer reached the {self.name} "
                               f"transport")
        if len(block_ids) != offer.num_blocks:
            raise HandoffError(f"request {offer.request_id}: {len(block_ids)} blocks allocated for the "
                               f"{offer.num_blocks} offered")
        start = time.monotonic()
        try:
            nbytes = self._read(offer, cache, block_ids, slot, reused)
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(f"request {offer.request_id}: {self.name} load failed: {type(e).__name__}: {e}") from e
        return TransferReport(self.name, nbytes, time.monotonic() - start, offer.fallback_reason, reused,
                              reused * cache.block_nbytes)

    def check(self, offer: Offer) -> None:
        """Refuse an offer from an engine with another fingerprint (model, weights, dtypes, layout)."""
        if offer.fingerprint != self.fingerprint:
            raise HandoffError(f"request {offer.request_id}: the cache was offered by an engine with fingerprint "
                               f"{offer.fingerprint[:16]}, this one is {self.fingerprint[:16]}: run both pools "
                               f"with the same model and engine settings")

    def relay(self, offer: Offer) -> Offer:
        """An offer of this kind that another process made (a data-parallel rank), made good
        here (by default as it is; RayTransport puts gathered tensors in the object store)."""
        return offer

    def close(self) -> None:
        """Free what the transport registered (nothing by default)."""


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class GatheredTransport(KVTransport):
    """The handoff as a copy in the offer itself: `location` is `CacheTensors.gather` of the
    blocks + slot, and a load scatters it. For processes that share no object store: a
    data-parallel rank that is not a Ray worker offers and loads Ray copies this way, its front
    moving the tensors over the replica's channel (RayTransport.relay, Loader.portable)."""
    name = "ray"

    def offer(self, held: HeldKV, cache: CacheTensors, skip: int = 0) -> Offer:
        tensors = cache.gather(held.block_ids[skip:], held.slot)
        return Offer(held.request_id, self.fingerprint, len(held.block_ids), tensor_bytes(tensors), self.name,
                     tensors, skipped=skip)

    def tensors(self, offer: Offer) -> dict[str, torch.Tensor]:
        """The offer's gathered tensors."""
        return offer.location

    def _read(self, offer: Offer, cache: CacheTensors, block_ids: list[int], slot: int, reused: int) -> int:
        tensors = self.tensors(offer)
        cache.scatter(block_ids[reused:], slot, cache.skip_blocks(tensors, reused - offer.skipped))
        return tensor_bytes(tensors)


class PortableLoad(ABC):
    """A `Resume.load` hook that a data-parallel front can hand to another rank: `portable()`
    claims the load once and returns an offer made of plain data (a NIXL offer as it is, a Ray
    copy as its gathered tensors), which that rank loads with its own transports; the rank's
    report comes back to `settle`. Called itself, it loads here (`load(cache, block_ids, slot)`)."""

    @abstractmethod
    def __call__(self, cache: CacheTensors, block_ids: list[int], slot: int, reused: int = 0) -> TransferReport:
        """Load here, with this process's transports and fallbacks (`reused`: KVTransport.load)."""

    @abstractmethod
    def portable(self) -> Offer:
        """The offer another process loads instead (HandoffError if the load ended already)."""

    @abstractmethod
    def settle(self, report: TransferReport) -> None:
        """How the other process's load went."""

    @abstractmethod
    def fallback(self) -> Offer:
        """After the portable NIXL offer's READ failed in the other process (and is over): a
        copy made portable the same way (HandoffError when there is none)."""
