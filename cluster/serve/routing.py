"""Choosing a replica inside a pool: a Ray Serve request router, run in the caller.

Every (replica, rank) is scored: the longest prefix of the prompt that rank holds in memory
(the ingress passes it as `hint=RouteHint(...)`, read from the KV event index, else from the
prefix index), then its load. A replica's score is its best rank's; ties and misses are broken
by load and free KV memory. Decode: by its least loaded rank and free KV memory. A
`require_worker` hint pins a follow-up call to the replica that holds the request's state.

A worker id is its Serve replica's unique id, so identity needs no stats round trip;
load and free KV come from each replica's `record_routing_stats()`:
    {"load": running + waiting requests, "free_kv": free fraction of blocks and slots,
     "rank_loads": each data-parallel rank's running + waiting (one entry without DP)}
and, fresher, each rank's load pushed with its KV events (`RouteHint.loads`). Neither is polled
per request.

Data-parallel replicas: each rank is a cache location of its own, `{worker_id}/dp{rank}`
(workers/engine/dp_rank.py). The chosen replica reads the same hint and hands its front the
rank that alone holds the longest prefix (`rank_hint`); on a tie or a miss the front breaks it
by its own, live view (longest prefix in a rank's device pool, else the least loaded rank).
"""
from __future__ import annotations

import contextvars
import random
from dataclasses import replace
from typing import Callable, NamedTuple, TypeVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvmesh.cluster.messages import RouteHint

NO_HINT = RouteHint()
RANK_MARK = "/dp"          # "{worker_id}/dp{rank}": a data-parallel rank's name in the prefix index
T = TypeVar("T")


def detached(call: Callable[[], T]) -> T:
    """`call()` (a handle's `.remote(...)`, or starting a task) outside the Serve request being
    served, in an empty context, so that it is a request of its own. kvmesh makes every handle
    call this way, for two reasons:

    * Serve gives every call a request makes that request's internal id, and a router matches the
      replica it chose to the pending call by that id: calls made at once from one request (a
      batch's prompts, a scrape of every replica) collide, and one is sent to the replica chosen
      for another (a `require_worker` pin broken) or never sent;
    * Serve cancels a request's calls when the request is cancelled (its client went away); a
      call that frees what the client held, or must run to do so, has to outlive the client. The
      dispatcher cancels the others itself."""
    return contextvars.Context().run(call)


def location(holder: str) -> tuple[str, int | None]:
    """A prefix-index memory holder -> (worker id, data-parallel rank; None: the whole replica)."""
    worker, mark, rank = holder.rpartition(RANK_MARK)
    return (worker, int(rank)) if mark and rank.isdigit() else (holder, None)


def rank_hint(hint: RouteHint, worker_id: str, ranks: int) -> int | None:
    """The rank of `worker_id` (a replica of `ranks` data-parallel ranks) that alone holds the
    longest prefix in memory; None when no rank stands out: the front then chooses by its own,
    live view of its ranks' loads, fresher than the loads pushed with KV events (a request that
    just started on a rank shows there at once, in its pushed load only at its next event)."""
    if ranks <= 1:
        return None
    score = {r: hint.prefix_blocks.get(f"{worker_id}{RANK_MARK}{r}", 0) for r in range(ranks)}
    best = max(score.values())
    top = [r for r, n in score.items() if n == best]
    return top[0] if best > 0 and len(top) == 1 else None


def rank_cost(hint: RouteHint, loc: str, stats_load: float) -> float:
    """Tokens a request would wait for and compute on rank `loc` (needs `hint.block_tokens`): its
    queued tokens (pushed; a rank not heard from: `stats_load` requests of a block each) plus the
    prompt blocks it does not hold."""
    queued = hint.loads.get(loc, stats_load * hint.block_tokens)
    return queued + (hint.prompt_blocks - hint.prefix_blocks.get(loc, 0)) * hint.block_tokens


def decode_hint(prefix: RouteHint, fresh: RouteHint) -> RouteHint:
    """The hint for a decode call: the request's prefix hint (decode ranks publish what their
    pools hold, as prefill's do, so a P/D repeat is scored by the blocks each decode rank already
    has and the handoff moves only the rest), with the loads pushed since it was read (`fresh`,
    the locator's `load_hint`) when there are any."""
    return replace(prefix, loads=fresh.loads) if fresh.loads and prefix.block_tokens else prefix


def route_hint(pending: PendingRequest | None) -> RouteHint:
    hint = pending.kwargs.get("hint") if pending is not None else None
    return hint if isinstance(hint, RouteHint) else NO_HINT


def worker_id_of(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


class Candidate(NamedTuple):
    """A replica as the router sees it: its queue as a fraction of its room, its free KV
    fraction, and each data-parallel rank's load from its routing stats (() without DP)."""
    worker_id: str
    load: float
    free_kv: float
    rank_loads: tuple[float, ...] = ()


def best_rank(c: Candidate, hint: RouteHint, room: float = 1.0) -> tuple[float, ...]:
    """The sort key of `c`'s best rank, lowest first. With pushed loads (`hint.block_tokens`):
    (`rank_cost`,). Else (-leading prompt blocks held, load / `room`), the load a rank's routing
    stats' (a replica without DP: its queue fraction `c.load`)."""
    if hint.block_tokens:
        if len(c.rank_loads) <= 1:
            return (rank_cost(hint, c.worker_id, c.load * room),)
        return (min(rank_cost(hint, f"{c.worker_id}{RANK_MARK}{r}", n) for r, n in enumerate(c.rank_loads)),)
    if len(c.rank_loads) <= 1:
        return -hint.prefix_blocks.get(c.worker_id, 0), c.load
    return min((-hint.prefix_blocks.get(f"{c.worker_id}{RANK_MARK}{r}", 0), n / room)
               for r, n in enumerate(c.rank_loads))


def rank_replicas(replicas: list[Candidate], hint: RouteHint, kv_weight: float, room: float = 1.0
                  ) -> list[str]:
    """Order replicas best first by their best rank (`best_rank`), then kv_weight * used KV
    fraction (added to the load without pushed loads); equal scores in random order. `room`: a
    replica's max ongoing requests (rank loads are counts). One key per candidate and one sort:
    with hundreds of ranks this is the router's whole cost after the hint."""
    if hint.block_tokens:       # best_rank's rank_cost, inlined for the common one-rank replica
        queued, held, bt = hint.loads.get, hint.prefix_blocks.get, hint.block_tokens
        whole = hint.prompt_blocks * bt
        keys = [(queued(c.worker_id, c.load * room * bt) + whole - held(c.worker_id, 0) * bt
                 if len(c.rank_loads) <= 1 else best_rank(c, hint, room)[0],
                 kv_weight * (1.0 - c.free_kv), random.random()) for c in replicas]
    else:
        keys = []
        for c in replicas:
            rank = best_rank(c, hint, room)
            keys.append((rank[0], rank[1] + kv_weight * (1.0 - c.free_kv), random.random()))
    return [replicas[i].worker_id for i in sorted(range(len(replicas)), key=keys.__getitem__)]


_ROUTERS: dict[tuple[str, str], "KVAwareRouter"] = {}     # (app, deployment) -> this process's router for it


def live_replica_ids(app: str, deployment: str) -> list[str] | None:
    """The replicas Serve routes `deployment`'s calls from this process to, by id, as this
    process's router for it knows them (RequestRouter.curr_replicas, Serve's public router API);
    None while the process has made no call through it (Serve makes a router on a handle's first)."""
    router = _ROUTERS.get((app, deployment))
    return None if router is None else [rid.unique_id for rid in list(router.curr_replicas)]


class KVAwareRouter(RequestRouter):
    """Ranks every candidate (singleton ranks, best first); Serve's selector then takes the
    first one whose queue has room, backing off when all are full. `deployment` (the router's
    kwargs) registers it for `live_replica_ids`: how /metrics reaches every replica.

    No FIFOMixin: with it Serve hands the replica chosen for one request to the *oldest* pending
    request of the router, so with several pending at once a `require_worker` pin (a release of a
    held cache, a scrape of one replica, a data-parallel rank's follow-up) or a prefix hint could
    land on another replica. RequestRouter's own matching gives each request the replica chosen
    for it; requests are still routed in arrival order (one routing task each, FIFO)."""

    def initialize_state(self, kv_weight: float = 1.0, deployment: str | None = None, **_: object) -> None:
        self.kv_weight = kv_weight
        if deployment:
            # Serve ships this class pickled by value, so this method's globals are a copy: the
            # registry is reached through the imported module, the one live_replica_ids reads
            from kvmesh.cluster.serve import routing
            routing._ROUTERS[(self.app_name, deployment)] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # else Serve spins when all are full
        if not candidate_replicas:
            return []
        hint = route_hint(pending_request)
        by_id = {worker_id_of(r): r for r in candidate_replicas}
        if hint.require_worker in by_id:
            return [[by_id[hint.require_worker]]]
        rows, room = [], 1
        for wid, r in by_id.items():
            stats = r.routing_stats or {}
            queued = self._replica_queue_len_cache.get(r.replica_id)
            load = queued if queued is not None else stats.get("load", 0)
            room = max(1, r.max_ongoing_requests)
            rows.append(Candidate(wid, float(load) / room, float(stats.get("free_kv", 1.0)),
                                  tuple(float(n) for n in stats.get("rank_loads", ()))))
        return [[by_id[wid]] for wid in rank_replicas(rows, hint, getattr(self, "kv_weight", 1.0), room)]
