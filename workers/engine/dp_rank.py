"""One rank of a data-parallel replica: the messages of a tick and what every rank does with one.

A tick is one `DataParallelEngine.step()`:

    rank 0:  send Tick ─ run_tick(its own part) ─ gather_objects(Reply) -> every rank's Reply
    rank k:  recv Tick ─ run_tick(its own part) ─ gather_objects(Reply)

`run_tick` adds the rank's new requests, aborts, and runs exactly one `Engine.step()`: the ranks
agree there whether anyone has a batch; one that has none runs an empty batch through every MoE
exchange (Engine._step, Transformer.idle), so the model's collectives stay in lockstep. Ranks
1..N-1 run `run_dp_rank` in their own process (LocalProcessLauncher(main=run_dp_rank)).
"""
from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass

from kvstore.block_pool import BlockPool
from workers.engine_config import EngineConfig
from workers.parallel.collectives import Collectives
from workers.parallel.replica import Stop, rank_device
from workers.request import RequestOutput
from workers.sampling.params import SamplingParams

from .engine import Engine
from .stats import EngineStats

log = logging.getLogger(__name__)


# ---- messages (one dataclass per message) -------------------------------------------------------
@dataclass(frozen=True)
class NewRequest:
    """A request the front checked (token ids) and routed to one rank."""
    request_id: str
    prompt: list[int]
    params: SamplingParams


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
    """Rank `rank`'s engine config: its device, its own name in the index's memory tier."""
    worker = f"{config.worker_id}/dp{rank}" if config.worker_id else None
    return dataclasses.replace(config, device=rank_device(config.device, rank), worker_id=worker)


def run_tick(engine: Engine, tick: Tick, rank: int, residency: Residency) -> Reply:
    """Rank `rank`'s part of one tick (see the module docstring); a `flush` tick only flushes."""
    if tick.flush:
        engine.flush()
        return Reply([], engine.stats(), *residency.changes())
    for rid in tick.aborts[rank]:
        engine.abort(rid)
    refused = []
    for r in tick.new[rank]:
        try:
            engine.add_request(r.request_id, r.prompt, r.params)
        except Exception as e:      # checked by the front already; whatever is left fails the request only
            refused.append(RequestOutput(r.request_id, r.prompt, [], [], [], "", True, "error", len(r.prompt), 0,
                                         error=f"{type(e).__name__}: {e}"))
    outputs = refused + engine.step()
    return Reply(outputs, engine.stats(), *residency.changes())


def run_dp_rank(rank: int, world_size: int, init_method: str, config: EngineConfig) -> None:
    """Rank `rank` (> 0) of a data-parallel replica: joins the process group, builds its whole
    engine (its share of the experts), reports whether that worked, then runs rank 0's ticks
    until rank 0 stops it (or dies: then a collective raises RankFailed and this returns)."""
    comm = Collectives(rank, world_size, init_method, config.device, config.rank_timeout_s)
    engine, error = None, None
    try:
        try:
            engine = Engine(rank_config(config, rank), dp=comm)
        except Exception as e:     # reported to rank 0, which raises it
            error = f"{type(e).__name__}: {e}"
            log.error("data-parallel rank %d: start-up failed\n%s", rank, traceback.format_exc())
        if any(comm.gather_objects(error)):
            return
        residency = Residency(engine.blocks)
        while not isinstance(tick := comm.recv(), Stop):
            comm.gather_objects(run_tick(engine, tick, rank, residency), starting=False)
    finally:
        if engine is not None:
            engine.close()
        comm.close()
