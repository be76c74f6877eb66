"""One engine across several ranks (tensor / expert parallelism), the rank-0-leads protocol.

    Engine(EngineConfig(tensor_parallel_size=2))   # rank 0 here, rank 1 a local process (workers/processes.py)

Rank 0 is the engine: scheduler, prefix cache, store, index, sampling, handoffs. Every rank
holds its shard of the model (`model.Shard`) and a **full, identical copy of the cache**:
V4's compressed KV, indexer keys and SWA ring are shared by all query heads, so nothing in the
cache splits by head, and store objects, prefix hashes and handoffs are the same whatever the
parallel size (rank 0 persists and hands off its copy).

The copies stay identical because every write to the cache is either
* the forward itself (every rank runs it on the same `StepInput`), or
* a `CacheTensors` call rank 0 makes outside the forward (restore loads, reset / copy / load of
  a slot, forks, speculative rollback, handoff loads). Rank 0's engine sees the cache through
  `MirroredCache`, which applies each such call and records it; the list goes to the other
  ranks with the next step, which apply it before running the forward.

    rank 0:   schedule (restores: recorded) ─ send Step(ops, step) ─ forward ─ sample ─ send Draft(plan) ─ MTP
    rank k:                                   recv Step ─ apply ops ─ forward (its shard)   recv Draft ─ MTP

With speculative decoding the step keeps its last streams (`Step.keep_streams`) and rank 0 sends
the MTP layer's passes for the next step's drafts (`Draft`, workers/spec/mtp.py), which every rank
runs on its shard of the layer and its own copy of the layer's ring.

Inside a data-parallel replica (tensor_parallel_size T with data_parallel_size D) each DP rank's
engine is the rank 0 of such a group, its followers local processes (a group never spans
nodes). Every rank of every group also joins the replica's expert group (`ExpertGroup`: D x T
ranks, keys "experts/" on the DP replica's store), over which the routed experts are split and
each MoE layer exchanges tokens (model/moe.py `MoE.grouped`). A DP rank with no batch while
another has one runs the exchanges empty: rank 0 sends `Step(idle=True)` (and `Draft(None, k)`
for k idle MTP passes) so that its followers join them too; with EPLB every rank counts and
rebalances after each engine step (`Balance`).

A rank that dies or stalls turns the next collective (or `RankLauncher.check`) into
`RankFailed` within `rank_timeout_s`.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.device.layout import CacheLayout
from kvmesh.kvstore.device.mirror import MirroredCache
from kvmesh.workers.checkpoint.default_model import ensure_default_model
from kvmesh.workers.checkpoint.loader import load_model
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.shard import Shard
from kvmesh.workers.model.step import StepInput
from kvmesh.workers.parallel.expert_balance import balancer as make_balancer, start_placement
from kvmesh.workers.processes import start_child
from kvmesh.workers.spec.mtp import DraftPlan, MTPPasses

from .collectives import Collectives, RankFailed, init_method

__all__ = ["RankFailed", "RankLauncher", "LocalProcessLauncher", "run_rank",
           "Leader", "Liveness", "Draft", "ExpertGroup"]

log = logging.getLogger(__name__)


class RankLauncher(Protocol):
    """Starts the ranks 1..N-1 of one replica (a local process each, or Ray actors). A launcher
    that can start data-parallel ranks also has `main`, what each rank runs (run_rank unless
    the engine's builder sets another: DataParallelEngine sets run_dp_rank)."""
    host: str      # the address rank 0 binds the process group on (its node IP)

    def start(self, world_size: int, init_method: str, config: EngineConfig) -> None:
        """Start ranks 1..world_size-1; each runs main(rank, world_size, init_method, config)."""

    def check(self) -> None:
        """Raise RankFailed if a rank has died."""

    def stop(self) -> None:
        """Stop every rank (idempotent)."""


class LocalProcessLauncher:
    """Ranks as processes on this machine (workers.processes: forks of a fork server that has
    imported torch and the rank code; CUDA: rank r on cuda:r). Each runs
    `main(rank, world_size, init_method, config)`: `run_rank` (tensor parallelism) unless the
    engine's builder passes another (data-parallel attention: a whole engine per rank)."""
    host = "127.0.0.1"

    def __init__(self, threads: int | None = None, main: Callable[[int, int, str, EngineConfig], None] | None = None,
                 device_of: Callable[[str, int], str] | None = None):
        """`device_of(device, rank)`: rank r's device (default `rank_device`; a TP group inside
        a DP rank: `group_device`)."""
        self.threads, self.procs, self.main = threads, [], main or run_rank
        self.device_of = device_of or rank_device

    def start(self, world_size: int, init_method: str, config: EngineConfig) -> None:
        for rank in range(1, world_size):
            cfg = dataclasses.replace(config, device=self.device_of(config.device, rank))
            self.procs.append(start_child(_process_main, (rank, world_size, init_method, cfg, self.threads, self.main),
                                          f"kvmesh-rank{rank}"))

    def check(self) -> None:
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive():
                raise RankFailed(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")

    def stop(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []


def rank_device(device: str, rank: int) -> str:
    """Rank r's device on one node: cuda:r for "cuda"; an explicit index or the CPU as given."""
    return f"cuda:{rank}" if device == "cuda" else device


def group_device(device: str, rank: int) -> str:
    """Rank r of a TP group whose rank 0 runs on `device`: the r-th device after it on CUDA
    (cuda:B -> cuda:B+r), the CPU as given."""
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + rank}"
    return device


@dataclass(frozen=True)
class ExpertGroup:
    """A data-parallel replica's expert group (tensor parallelism inside its DP ranks): every rank
    of every TP group, D x T of them, the TP group of DP rank d being ranks d*T .. d*T + T-1.
    It forms on the DP replica's store (`init_method`), under its own keys."""
    init_method: str
    dp_rank: int
    tp_size: int
    size: int

    def join(self, tp_rank: int, device: str, timeout_s: float, store=None) -> Collectives:
        """This rank's member of the group (only reductions: no control channel)."""
        return Collectives(self.dp_rank * self.tp_size + tp_rank, self.size, self.init_method, device, timeout_s,
                           store, name="experts/", control=False)


def _process_main(rank: int, world_size: int, init_method: str, config: EngineConfig,
                  threads: int | None, main) -> None:
    # daemonic so that rank 0's exit ends it (the parent's flag does that), yet a rank starts
    # children of its own (a data-parallel rank's grammar compilers), which a daemon may not
    multiprocessing.current_process().daemon = False
    if threads:
        torch.set_num_threads(threads)
    main(rank, world_size, init_method, config)


# ---- messages from rank 0 (one dataclass per message) ------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """Sent once at start-up: the cache every rank allocates (rank 0's sizes, so all agree)."""
    layout: CacheLayout
    num_blocks: int
    num_slots: int
    swa_blocks: bool


@dataclass(frozen=True)
class Step:
    """One forward: first the cache calls rank 0 made since the last step, in order.
    `keep_streams`: keep the step and its last streams for the Draft that follows; `idle`
    (inside a DP replica): no batch here, run the MoE exchanges empty (Transformer.idle)."""
    ops: list[tuple[str, tuple]]
    step: StepInput | None
    keep_streams: bool = False
    idle: bool = False


@dataclass(frozen=True)
class Draft:
    """The MTP layer's passes after the last step (speculative decoding), run on every rank;
    `plan` None (inside a DP replica): `idle` passes with nothing to draft (MTPPasses.idle)."""
    plan: DraftPlan | None
    idle: int = 0


@dataclass(frozen=True)
class Digest:
    """Every rank answers its cache's digest (CacheTensors.digest), after the pending cache calls."""
    ops: list[tuple[str, tuple]]


@dataclass(frozen=True)
class Balance:
    """EPLB inside a DP replica: the engine step is over, count its load (and rebalance when due)."""


@dataclass(frozen=True)
class Stop:
    reason: str = ""


# ---- rank 0 ------------------------------------------------------------------------------------
class Liveness:
    """Whether a replica's ranks still run: the first RankFailed sticks (the engine is unusable
    after it), and `check` raises it again, or the launcher's news of a dead rank."""

    def __init__(self, launcher: RankLauncher):
        self.launcher, self.dead = launcher, None

    def check(self) -> None:
        if self.dead is not None:
            raise RankFailed(f"this engine's ranks failed earlier: {self.dead}")
        try:
            self.launcher.check()
        except RankFailed as e:
            self.dead = e
            raise

    def failed(self, error: RankFailed) -> None:
        self.dead = self.dead or error


class Leader(Liveness):
    """Rank 0's side of a replica: starts the other ranks, sends them each step."""

    def __init__(self, config: EngineConfig, launcher: RankLauncher, experts: ExpertGroup | None = None,
                 experts_store=None):
        """`experts`: this group is one DP rank of a replica; every rank joins the replica's
        expert group (`self.experts`; `experts_store`: this process's client of its store)."""
        super().__init__(launcher)
        self.size = config.tensor_parallel_size
        store = Collectives.host_store(launcher.host, self.size, config.rank_timeout_s)
        method = init_method(launcher.host, store)
        launcher.start(self.size, method, config)
        self.experts: Collectives | None = None
        try:
            self.comm = Collectives(0, self.size, method, config.device, config.rank_timeout_s, store)
            if experts is not None:
                self.experts = experts.join(0, config.device, config.rank_timeout_s, experts_store)
        except BaseException:
            launcher.stop()
            raise
        self.mirror: MirroredCache | None = None

    def ready(self, cache: CacheTensors) -> MirroredCache:
        """Start-up done on rank 0: tell the ranks the cache sizes, wait until all have loaded
        their shard and allocated their cache; RankFailed naming a rank that could not."""
        self.comm.send(CacheSpec(cache.layout, cache.num_blocks, cache.num_slots, cache.swa_blocks), starting=True)
        errors = self.comm.gather_objects(None)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise RankFailed("; ".join(f"rank {r} failed to start: {e}" for r, e in bad))
        self.mirror = MirroredCache(cache)
        return self.mirror

    def forward(self, step: StepInput, keep_streams: bool = False) -> None:
        """Before rank 0 runs `step` (CPU tensors): the other ranks get the pending cache calls
        and the step (`keep_streams`: a Draft follows it)."""
        self._send(Step(self.mirror.take(), step, keep_streams))

    def draft(self, plan: DraftPlan) -> None:
        """Before rank 0 runs the MTP passes of `plan`: the other ranks get it."""
        self._send(Draft(plan))

    def idle(self) -> None:
        """Inside a DP replica, before rank 0 runs an empty batch through the exchanges."""
        self._send(Step(self.mirror.take(), None, idle=True))

    def idle_passes(self, passes: int) -> None:
        """Inside a DP replica, before rank 0 runs `passes` MTP passes with nothing to draft."""
        if passes > 0:
            self._send(Draft(None, passes))

    def cache_digests(self) -> list[str]:
        """Every rank's cache digest, in rank order: the same on all of them (module docstring)."""
        self._send(Digest(self.mirror.take()))
        return self.comm.gather_objects(self.mirror.real.digest(), starting=False)

    def balance(self) -> None:
        """EPLB inside a DP replica: before rank 0 ends its step's count."""
        self._send(Balance())

    def _send(self, message: Step | Draft | Balance | Digest) -> None:
        self.check()
        try:
            self.comm.send(message)
        except RankFailed as e:
            self.dead = e
            raise

    def close(self, reason: str = "engine closed") -> None:
        if self.dead is None:
            try:
                self.comm.send(Stop(reason), starting=True)
            except RankFailed:
                pass
        self.launcher.stop()
        self.comm.close()
        if self.experts is not None:
            self.experts.close()


# ---- ranks 1..N-1 ------------------------------------------------------------------------------
def run_rank(rank: int, world_size: int, init_method: str, config: EngineConfig,
             experts: ExpertGroup | None = None) -> None:
    """Rank `rank` of a replica: joins the process group, loads its shard and its own cache
    replica, then follows rank 0's steps until rank 0 stops it (or dies: then it raises).
    `experts`: the replica is one DP rank's TP group; this rank also joins the expert group."""
    comm = Collectives(rank, world_size, init_method, config.device, config.rank_timeout_s)
    group = None
    try:
        model, error, balancer = None, None, None
        try:
            shard = Shard(rank, world_size, config.enable_expert_parallel, comm=comm)
            model_dir = Path(config.model) if config.model else ensure_default_model()
            if experts is not None:
                group = experts.join(rank, config.device, config.rank_timeout_s)
                shard = grouped_shard(config, model_dir, comm, group)
            _, model = load_model(model_dir, config.dtype, config.device, config.kernel_backend, shard)
            if group is not None:
                balancer = make_balancer(config, model, group)          # None without EPLB
        except Exception as e:     # reported to rank 0, which raises it
            error = f"{type(e).__name__}: {e}"
            log.error("rank %d: loading failed\n%s", rank, traceback.format_exc())
        spec = comm.recv()
        if isinstance(spec, Stop):
            return
        cache = None
        if model is not None:
            cache = CacheTensors(spec.layout, spec.num_blocks, spec.num_slots, model.head.weight.dtype,
                                 config.device, spec.swa_blocks)
        if any(comm.gather_objects(error)):
            return
        follow(comm, model, cache, config.device, balancer)
    finally:
        comm.close()
        if group is not None:
            group.close()


def grouped_shard(config: EngineConfig, model_dir, comm, experts: Collectives) -> Shard:
    """Rank comm.rank of a DP rank's TP group: attention split over the group, whole routed
    experts of the `experts` group's D x T ranks (EPLB: as the start-up placement lays them)."""
    return Shard(comm.rank, comm.size, True, comm=comm, dp_rank=experts.rank, dp_size=experts.size,
                 exchange=experts, placement=start_placement(config, model_dir))


def follow(comm: Collectives, model, cache: CacheTensors, device: str, balancer=None) -> None:
    """Run rank 0's steps and MTP passes (its own MTP ring, like rank 0's drafter's) until Stop."""
    passes = MTPPasses(model, cache.num_slots) if len(model.mtp) else None
    last = None                                      # (step, streams) a Draft runs on
    while True:
        msg = comm.recv()
        if isinstance(msg, Stop):
            return
        if isinstance(msg, Balance):
            balancer.end_step()
            continue
        if isinstance(msg, Digest):
            for name, args in msg.ops:
                getattr(cache, name)(*args)
            comm.gather_objects(cache.digest(), starting=False)
            continue
        if isinstance(msg, Draft):
            if msg.plan is None:
                passes.idle(msg.idle)
            else:
                passes.run(msg.plan, *last)
            continue
        for name, args in msg.ops:
            getattr(cache, name)(*args)
        if msg.idle:
            model.idle()
        elif msg.step is not None:
            step = msg.step.to(device)
            if msg.keep_streams:
                last = (step, model(step, cache, keep_streams=True)[1])
            else:
                model(step, cache)
