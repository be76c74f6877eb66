"""Moving cache regions between workers with NIXL (UCX backend): one agent per worker.

    source (prefill)                          destination (decode)
    agent = KVTransferAgent(name, tensors)    agent = KVTransferAgent(name, tensors)
    remote = agent.describe(regions)  ──────▶ agent.read(remote, my_regions, notif=b"...")
      ... held until ...              ◀────── (the READ completes, NIXL delivers `notif`)
    agent.notifications() -> [b"..."]

A region is `(tensor index, byte offset, nbytes)` into the list of tensors the agent
registered (CacheTensors.block_regions speaks this). `RemoteKV` is plain data (agent
name, agent metadata, absolute descriptors), so it travels in any message; the
destination adds the remote agent from its metadata on first use. `NixlTransport` is
the handoff's KVTransport over one agent. Everything here works without Ray; when NIXL
is missing or fails, callers get `HandoffError` (`TransferError` is the same class) and
fall back to another transport.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvmesh.kvstore.transfer.kv_transport import HandoffError, HeldKV, KVTransport, Offer, TransferInFlight

log = logging.getLogger(__name__)

Region = tuple[int, int, int]          # (tensor index, byte offset, nbytes)
Desc = tuple[int, int, int]            # (address, nbytes, device id)
POLL_INTERVAL_S = 0.0005


TransferError = HandoffError    # a NIXL transfer could not be set up or did not complete


class NixlUnavailable(HandoffError):
    """NIXL (or its backend) cannot be loaded in this process."""


@dataclass(frozen=True)
class RemoteKV:
    """Where a source worker holds some cache bytes: enough for a peer to READ them."""
    agent_name: str
    metadata: bytes                    # nixl agent metadata (connection info)
    node_ip: str                       # the source's Ray node IP, for diagnostics and routing
    mem_type: str                      # "DRAM" | "VRAM"
    descs: tuple[Desc, ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.descs)


def coalesce(local: list[Desc], remote: list[Desc]) -> tuple[list[Desc], list[Desc]]:
    """Merge neighbouring pairs that are contiguous on both sides (fewer descriptors)."""
    out_l: list[Desc] = []
    out_r: list[Desc] = []
    for (la, n, ld), (ra, m, rd) in zip(local, remote):
        if n != m:
            raise HandoffError(f"region sizes differ: local {n} B, remote {m} B")
        if out_l and out_l[-1][0] + out_l[-1][1] == la and out_r[-1][0] + out_r[-1][1] == ra \
                and out_l[-1][2] == ld and out_r[-1][2] == rd:
            out_l[-1] = (out_l[-1][0], out_l[-1][1] + n, ld)
            out_r[-1] = (out_r[-1][0], out_r[-1][1] + n, rd)
        else:
            out_l.append((la, n, ld))
            out_r.append((ra, n, rd))
    return out_l, out_r


PROGRESS_DELAY_US = 5000   # the backend's progress thread rests this long when it found nothing to do
_config_lock = threading.Lock()


def _quiet_agent(nixl_agent, name: str, config):
    """A NIXL agent whose progress thread rests between empty polls. nixl's Python wrapper
    hard-codes a delay of 0, a busy loop that costs an idle replica ~20-30 % of a core;
    5 ms costs ~0.5 %. Transfers still progress at full speed in the calls that poll them
    (check_xfer_state on the reader, get_new_notifs on the source)."""
    import nixl._api as api
    base = api.nixlBind.nixlAgentConfig

    class RestingConfig(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, max(value, PROGRESS_DELAY_US) if key == "pthrDelay" else value)
    with _config_lock:      # the swap is visible to this construction only
        api.nixlBind.nixlAgentConfig = RestingConfig
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


class KVTransferAgent:
    """A NIXL agent with a fixed list of registered tensors (all on one device type).

    Thread-safe: one lock serialises calls into the agent (prefill serves notifications
    on its event loop while decode reads on its engine thread)."""

    def __init__(self, name: str, tensors: list[torch.Tensor], node_ip: str = "127.0.0.1",
                 backend: str = "UCX"):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or a missing shared library
            raise NixlUnavailable(f"nixl cannot be imported: {e}") from e
        if not tensors or any(not t.is_contiguous() for t in tensors):
            raise ValueError("register a non-empty list of contiguous tensors")
        self.name, self.node_ip, self.tensors = name, node_ip, tensors
        self.mem_type = "VRAM" if tensors[0].is_cuda else "DRAM"
        self._lock = threading.Lock()
        self._peers: set[str] = set()
        try:
            self._agent = _quiet_agent(nixl_agent, name, nixl_agent_config(backends=[backend]))
            self._reg = self._agent.register_memory(tensors)
            self.metadata = self._agent.get_agent_metadata()
        except Exception as e:
            raise NixlUnavailable(f"nixl agent {name!r} with backend {backend} failed to start: {e}") from e

    def _descs(self, regions: list[Region]) -> list[Desc]:
        out = []
        for i, offset, nbytes in regions:
            t = self.tensors[i]
            if offset < 0 or offset + nbytes > t.numel() * t.element_size():
                raise ValueError(f"region ({i}, {offset}, {nbytes}) is outside tensor {i}")
            out.append((t.data_ptr() + offset, nbytes, max(t.get_device(), 0)))
        return out

    def describe(self, regions: list[Region]) -> RemoteKV:
        return RemoteKV(self.name, self.metadata, self.node_ip, self.mem_type, tuple(self._descs(regions)))

    def read(self, remote: RemoteKV, regions: list[Region], notif: bytes = b"", timeout_s: float = 30.0) -> int:
        """READ `remote` into this agent's `regions` (same sizes, in order); blocks until done.
        The source receives `notif` when the transfer completes. Returns bytes moved."""
        local = self._descs(regions)
        if len(local) != len(remote.descs):
            raise HandoffError(f"{len(local)} local regions for {len(remote.descs)} remote ones")
        local, far = coalesce(local, list(remote.descs))
        with self._lock:
            try:
                if remote.agent_name not in self._peers:
                    self._agent.add_remote_agent(remote.metadata)
                    self._peers.add(remote.agent_name)
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, self.mem_type),
                    self._agent.get_xfer_descs(far, remote.mem_type), remote.agent_name, notif)
            except Exception as e:
                raise HandoffError(f"cannot set up a READ from {remote.agent_name} ({remote.node_ip}): {e}") from e
        try:
            self._wait(handle, remote, timeout_s)
        except TransferInFlight:
            raise           # the handle lives on in the error's settled()
        except BaseException:
            self._release(handle)
            raise
        self._release(handle)
        return sum(n for _, n, _ in local)

    def _release(self, handle) -> None:
        with self._lock:
            self._agent.release_xfer_handle(handle)

    def _wait(self, handle, remote: RemoteKV, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            state = self._agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                # releasing the handle does not stop the READ: its data lands in our memory when
                # the link delivers it (seen after a partition healed), so it stays pending here
                raise TransferInFlight(f"READ from {remote.agent_name} ({remote.node_ip}) timed out after "
                                       f"{timeout_s}s", self._settler(handle))
            time.sleep(POLL_INTERVAL_S)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise HandoffError(f"READ from {remote.agent_name} ({remote.node_ip}) failed: {state}")

    def _settler(self, handle) -> Callable[[], bool]:
        """settled() of a READ given up: False while it may still write; then True (once its
        handle is released)."""
        over = False

        def settled() -> bool:
            nonlocal over
            with self._lock:
                if not over and self._agent.check_xfer_state(handle) != "PROC":
                    self._agent.release_xfer_handle(handle)
                    over = True
            return over
        return settled

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from any peer."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers):
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            self._agent.deregister_memory(self._reg)


RELEASE_PREFIX = b"release:"     # the notification a completed READ sends: release:<request id>
# a READ ends this long before its offer's readable_until: clock skew between hosts + issuing it
EXPIRY_MARGIN_S = 1.0


class NixlTransport(KVTransport):
    """The handoff over NIXL: an offer describes the held regions of the source's
    registered cache; a load READs them into the destination's (one-sided, the source
    is told by the READ's notification, see `released`)."""
    name = "nixl"

    def __init__(self, agent: KVTransferAgent, fingerprint: str, timeout_s: float = 30.0):
        super().__init__(fingerprint)
        self.agent, self.timeout_s = agent, timeout_s

    def offer(self, held: HeldKV, cache, skip: int = 0) -> Offer:
        """The source frees the regions `timeout_s` after this at the earliest (unless read)."""
        remote = self.agent.describe(cache.block_regions(held.block_ids[skip:], held.slot))
        return Offer(held.request_id, self.fingerprint, len(held.block_ids), remote.nbytes, self.name, remote,
                     skipped=skip, readable_until=time.time() + self.timeout_s)

    def _read(self, offer: Offer, cache, block_ids: list[int], slot: int, reused: int) -> int:
        timeout_s = self.timeout_s
        if offer.readable_until is not None:     # end before the source may reuse the memory
            timeout_s = min(timeout_s, offer.readable_until - time.time() - min(EXPIRY_MARGIN_S, self.timeout_s / 4))
            if timeout_s <= 0:
                raise HandoffError(f"request {offer.request_id}: its offer expired before the READ could start "
                                   f"(the source may have freed the memory)")
        remote = offer.location
        if reused > offer.skipped:      # this side holds more leading blocks: READ the others + the slot
            picks = cache.region_picks(offer.num_blocks - offer.skipped, reused - offer.skipped)
            remote = dataclasses.replace(remote, descs=tuple(remote.descs[i] for i in picks))
        return self.agent.read(remote, cache.block_regions(block_ids[reused:], slot),
                               RELEASE_PREFIX + offer.request_id.encode(), timeout_s)

    def released(self) -> list[str]:
        """Request ids whose caches destinations have finished reading since the last call."""
        return [m.removeprefix(RELEASE_PREFIX).decode(errors="replace") for m in self.agent.notifications()]

    def close(self) -> None:
        self.agent.close()


def make_agent(name: str, tensors: list[torch.Tensor], node_ip: str, backend: str = "UCX"
               ) -> tuple[KVTransferAgent | None, str | None]:
    """(agent, None), or (None, why) when NIXL cannot run here."""
    try:
        return KVTransferAgent(name, tensors, node_ip, backend), None
    except NixlUnavailable as e:
        log.warning("NIXL unavailable, handoffs use Ray objects: %s", e)
        return None, str(e)
