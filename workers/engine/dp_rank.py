"""One rank of a data-parallel replica: the messages of a tick and what every rank does with one.

A tick is one `DataParallelEngine.step()`:

    rank 0:  send Tick ─ run_tick(its own part) ─ gather_objects(Reply) -> every rank's Reply
    rank k:  recv Tick ─ run_tick(its own part) ─ gather_objects(Reply)

`run_tick` adds the rank's new requests (a guided one whose grammar is not compiled on this rank
yet waits parked, outside the step, while the rank's pool compiles it), aborts, and runs exactly
one `Engine.step()`: the ranks
agree there whether anyone has a batch; one that has none runs an empty batch through every MoE
exchange (Engine._step, Transformer.idle), so the model's collectives stay in lockstep. Ranks
1..N-1 run `run_dp_rank` in their own process (LocalProcessLauncher(main=run_dp_rank)).

Handoffs between steps are calls, which step nothing:

    rank 0:  send Call(rank, op) ─ run_call(its part) ─ gather_objects(CallReply) -> the target's answer
    rank k:  recv Call ─ run_call(its part: nothing unless it is the target) ─ gather_objects(CallReply)

A held request stays on its rank; `RankHandoff` is a rank's side of handoffs: its own NIXL
transport (`OpenNixl`: an agent per rank over the rank's own cache memory, at the rank's own
node address when the replica spans hosts, so offers name it and READs land in it), gathered
copies for Ray (GatheredTransport: a rank need not be a Ray worker; its front relays the
tensors), the reads it finished (`PollReleased`: the rank frees them itself) and the loads it
ran (Reply.loaded, so the front settles each request's load; and Reply.unread, failed READs
that are over, which the front starts again from a Ray copy).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from dataclasses import dataclass

from kvmesh.kvstore.device.block_pool import BlockPool
from kvmesh.kvstore.transfer.kv_transport import GatheredTransport, HandoffError, KVTransport, Offer, TransferInFlight, TransferReport
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.parallel.collectives import Collectives
from kvmesh.workers.parallel.replica import Stop, rank_device
from kvmesh.workers.request import RequestOutput, Resume
from kvmesh.workers.sampling.params import SamplingParams

from .engine import Engine
from .stats import EngineStats

log = logging.getLogger(__name__)


# ---- messages (one dataclass per message) -------------------------------------------------------
@dataclass(frozen=True)
class NewRequest:
    """A request the front checked (token ids) and routed to one rank. `hold_kv`: prefill role;
    `resume` (its `load` None) + `offer`: decode role, the rank loads `offer` with its own
    transports (a NIXL offer, or a Ray copy's gathered tensors)."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    hold_kv: bool = False
    resume: Resume | None = None
    offer: Offer | None = None


@dataclass(frozen=True)
class Tick:
    """Rank 0 -> all: per rank, the requests it starts and the request ids it aborts, in rank
    order; a `flush` tick makes every rank flush its write-behind instead of stepping."""
    new: tuple[tuple[NewRequest, ...], ...]
    aborts: tuple[tuple[str, ...], ...]
    flush: bool = False


@dataclass(frozen=True)
class Reply:
    """Each rank -> rank 0 after its step: its outputs, its load and what its device pool
    gained (`named`) and lost (`dropped`) since its last reply (prefix hashes, for routing)."""
    outputs: list[RequestOutput]
    stats: EngineStats
    named: list[int]
    dropped: list[int]
    loaded: list[tuple[str, TransferReport]] = dataclasses.field(default_factory=list)   # request id, report
    unread: list[str] = dataclasses.field(default_factory=list)   # NIXL READs that failed and are over


# ---- handoff calls (rank 0 -> all, between steps; the target answers) ----------------------------
@dataclass(frozen=True)
class OpenNixl:
    """Every rank: register its cache with a NIXL agent `{name}-dp{rank}`."""
    name: str
    node_ip: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class HeldHandle:
    """The holding rank: Engine.held_handle."""
    request_id: str


@dataclass(frozen=True)
class OfferHeld:
    """The holding rank: offer a held cache with its own transport of kind `transport`."""
    request_id: str
    transport: str
    skip: int = 0           # leading blocks the destination holds: left out of the offer


@dataclass(frozen=True)
class ReleaseHeld:
    """The holding rank: free a held cache."""
    request_id: str


@dataclass(frozen=True)
class PollReleased:
    """Every rank: free the held caches destinations finished reading; answer their ids."""


@dataclass(frozen=True)
class CacheDigests:
    """Every rank: its TP group's cache digests (Engine.cache_digests)."""


@dataclass(frozen=True)
class Call:
    """One handoff call for rank `rank` (None: every rank)."""
    rank: int | None
    op: OpenNixl | HeldHandle | OfferHeld | ReleaseHeld | PollReleased | CacheDigests


@dataclass(frozen=True)
class CallReply:
    """A rank's answer to a Call: its value (None: the call was for another rank) or the error
    it raised, and its stats after it (a release changes what the front reports)."""
    stats: EngineStats
    value: object = None
    error: str | None = None


class Residency:
    """The prefix hashes a rank's device pool holds, reported as changes since the last call.
    (A set difference over the pool's hashes: linear in the pool's hashed blocks per tick.)"""

    def __init__(self, pool: BlockPool):
        self.pool, self.known = pool, set()

    def changes(self) -> tuple[list[int], list[int]]:
        now = set(self.pool.by_hash)
        named, dropped = sorted(now - self.known), sorted(self.known - now)
        self.known = now
        return named, dropped


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank `rank`'s engine config: its device, its own name in the index's memory tier. With a
    TP group of T ranks inside each DP rank, DP rank d of a node takes its devices d*T .. d*T+T-1
    (its rank 0 the first of them: replica.group_device)."""
    worker = f"{config.worker_id}/dp{rank}" if config.worker_id else None
    tp = config.tensor_parallel_size
    if tp > 1 and config.device == "cuda":
        local = config.data_parallel_size_local or config.data_parallel_size
        return dataclasses.replace(config, device=f"cuda:{rank % local * tp}", worker_id=worker)
    return dataclasses.replace(config, device=rank_device(config.device, rank), worker_id=worker)


class RankHandoff:
    """A rank's side of handoffs (see the module docstring)."""

    def __init__(self, engine: Engine, rank: int, address: str | None = None):
        """`address`: this rank's own node address when it runs on another host than rank 0
        (its NIXL agent advertises that one, not rank 0's `OpenNixl.node_ip`)."""
        self.engine, self.rank, self.address = engine, rank, address
        self.nixl = None                                   # NixlTransport once OpenNixl opened one
        self.gathered = GatheredTransport(engine.fingerprint)
        self.loaded: list[tuple[str, TransferReport]] = []
        self.unread: list[str] = []
        self._lock = threading.Lock()          # loads run on the engine's loader threads
        self.kept: dict[str, object] = {}                 # rank 0: request id -> the caller's own Resume.load

    def transport(self, kind: str) -> KVTransport:
        found = {"nixl": self.nixl, "ray": self.gathered}.get(kind)
        if found is None:
            raise HandoffError(f"data-parallel rank {self.rank} has no {kind} transport")
        return found

    def resume(self, r: NewRequest) -> Resume | None:
        """The rank's Resume for `r`: its load reads `r.offer` here and reports how it went."""
        if r.resume is None:
            return None
        if r.offer is None:                                # rank 0: the caller's load (its Ray fallback too)
            return r.resume._replace(load=self.kept.pop(r.request_id))

        def load(cache, block_ids: list[int], slot: int, reused: int = 0) -> TransferReport:
            try:
                report = self.transport(r.offer.transport).load(r.offer, cache, block_ids, slot, reused)
            except HandoffError as e:    # over (not in flight): the front may start it again from a Ray copy
                if r.offer.transport == "nixl" and not isinstance(e, TransferInFlight):
                    with self._lock:
                        self.unread.append(r.request_id)
                raise
            with self._lock:
                self.loaded.append((r.request_id, report))
            return report
        return r.resume._replace(load=load)

    def reports(self, outputs: list[RequestOutput]) -> tuple[list[tuple[str, TransferReport]], list[str]]:
        """(loads run, NIXL READs failed) since the last call; a failed READ is reported with the
        step whose `outputs` end its request (a load off the step may fail before that step)."""
        ended = {o.request_id for o in outputs if o.finished}
        with self._lock:
            loaded, self.loaded = self.loaded, []
            unread = [rid for rid in self.unread if rid in ended]
            self.unread = [rid for rid in self.unread if rid not in ended and rid in self.engine.seqs]
        return loaded, unread

    def run(self, op) -> object:
        e = self.engine
        if isinstance(op, OpenNixl):
            self.nixl = e.open_nixl(f"{op.name}-dp{self.rank}", self.address or op.node_ip, op.backend, op.timeout_s)
            return self.nixl is not None
        if isinstance(op, CacheDigests):
            return e.cache_digests()
        if isinstance(op, PollReleased):
            return e.release_read(self.nixl) if self.nixl is not None else []
        if isinstance(op, HeldHandle):
            return e.held_handle(op.request_id)
        if isinstance(op, OfferHeld):
            return e.offer_held(op.request_id, self.transport(op.transport), op.skip)
        e.release_held(op.request_id)

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()


def run_call(handoff: RankHandoff, call: Call) -> CallReply:
    """Rank `handoff.rank`'s part of a call (nothing when the call is for another rank)."""
    value, error = None, None
    if call.rank is None or call.rank == handoff.rank:
        try:
            value = handoff.run(call.op)
        except Exception as e:      # the front raises it as the call's error
            error = f"{type(e).__name__}: {e}"
    return CallReply(handoff.engine.stats(), value, error)


def run_tick(engine: Engine, tick: Tick, rank: int, residency: Residency, handoff: RankHandoff) -> Reply:
    """Rank `rank`'s part of one tick (see the module docstring); a `flush` tick only flushes."""
    if tick.flush:
        engine.flush()
        return Reply([], engine.stats(), *residency.changes())
    for rid in tick.aborts[rank]:
        engine.abort(rid)
    refused = []
    for r in tick.new[rank]:
        try:
            engine.add_request(r.request_id, r.prompt, r.params, hold_kv=r.hold_kv, resume=handoff.resume(r),
                               wait=False)    # a grammar compiles off the step: the request waits for it parked
        except Exception as e:      # checked by the front already; whatever is left fails the request only
            refused.append(RequestOutput(r.request_id, r.prompt, [], [], [], "", True, "error", len(r.prompt), 0,
                                         error=f"{type(e).__name__}: {e}"))
    outputs = refused + engine.step()
    return Reply(outputs, engine.stats(), *residency.changes(), *handoff.reports(outputs))


def run_dp_rank(rank: int, world_size: int, init_method: str, config: EngineConfig) -> None:
    """Rank `rank` (> 0) of a data-parallel replica: joins the process group, builds its whole
    engine (its share of the experts), reports whether that worked, then runs rank 0's ticks
    until rank 0 stops it (or dies: then a collective raises RankFailed and this returns)."""
    comm = Collectives(rank, world_size, init_method, config.device, config.rank_timeout_s)
    engine, handoff, error = None, None, None
    try:
        try:
            engine = Engine(rank_config(config, rank), dp=comm)
            handoff = RankHandoff(engine, rank, comm.address if comm.remote else None)
        except Exception as e:     # reported to rank 0, which raises it
            error = f"{type(e).__name__}: {e}"
            log.error("data-parallel rank %d: start-up failed\n%s", rank, traceback.format_exc())
        if any(comm.gather_objects(error)):
            return
        residency = Residency(engine.blocks)
        while not isinstance(msg := comm.recv(), Stop):
            reply = run_call(handoff, msg) if isinstance(msg, Call) else run_tick(engine, msg, rank, residency, handoff)
            comm.gather_objects(reply, starting=False)
    finally:
        if handoff is not None:
            handoff.close()
        if engine is not None:
            engine.close()
        comm.close()
