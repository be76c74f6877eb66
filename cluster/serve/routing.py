"""Choosing a replica inside a pool: a Ray Serve request router, run in the caller.

Prefill: the replica that holds the longest prefix of the prompt in memory (the
ingress reads it from the prefix index and passes it as `hint=RouteHint(...)`), ties
and misses broken by load. Decode: by load and free KV memory. A `require_worker`
hint pins a follow-up call to the replica that holds the request's state.

A worker id is its Serve replica's unique id, so identity needs no stats round trip;
load and free KV come from each replica's `record_routing_stats()`:
    {"load": running + waiting requests, "free_kv": free fraction of blocks and slots,
     "rank_loads": each data-parallel rank's running + waiting (one entry without DP)}

Data-parallel replicas: each rank is a cache location of its own in the index,
`{worker_id}/dp{rank}` (workers/engine/dp_rank.py). The router scores a replica by the most
blocks any of its ranks holds; the chosen replica reads the same hint and hands its front
the rank that holds the most (`rank_hint`), or none, and the front routes by its own view
(longest prefix in a rank's device pool, else the least loaded rank).
"""
from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.messages import RouteHint

NO_HINT = RouteHint()
RANK_MARK = "/dp"          # "{worker_id}/dp{rank}": a data-parallel rank's name in the prefix index


def location(holder: str) -> tuple[str, int | None]:
    """A prefix-index memory holder -> (worker id, data-parallel rank; None: the whole replica)."""
    worker, mark, rank = holder.rpartition(RANK_MARK)
    return (worker, int(rank)) if mark and rank.isdigit() else (holder, None)


def replica_blocks(prefix_blocks: dict[str, int]) -> dict[str, int]:
    """Worker id -> the most leading prompt blocks it (any of its ranks) holds in memory."""
    out: dict[str, int] = {}
    for holder, n in prefix_blocks.items():
        worker = location(holder)[0]
        out[worker] = max(out.get(worker, 0), n)
    return out


def rank_hint(hint: RouteHint, worker_id: str) -> int | None:
    """The rank of `worker_id` that alone holds the longest prefix in memory; None when no rank
    holds any, or several hold as much (the front then breaks the tie by load)."""
    held = {r: n for holder, n in hint.prefix_blocks.items() if n > 0
            for w, r in [location(holder)] if w == worker_id and r is not None}
    best = max(held.values(), default=0)
    top = [r for r, n in held.items() if n == best]
    return top[0] if len(top) == 1 else None


def route_hint(pending: PendingRequest | None) -> RouteHint:
    hint = pending.kwargs.get("hint") if pending is not None else None
    return hint if isinstance(hint, RouteHint) else NO_HINT


def worker_id_of(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def rank_replicas(replicas: list[tuple[str, float, float]], hint: RouteHint, kv_weight: float
                  ) -> list[str]:
    """Order (worker_id, load, free_kv) best first: longest in-memory prefix, then the
    lowest load + kv_weight * used KV fraction; equal scores in random order."""
    shuffled = random.sample(replicas, len(replicas))
    blocks = replica_blocks(hint.prefix_blocks)

    def key(r):
        wid, load, free_kv = r
        return (-blocks.get(wid, 0), load + kv_weight * (1.0 - free_kv))
    return [wid for wid, _, _ in sorted(shuffled, key=key)]


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Ranks every candidate (singleton ranks, best first); Serve's selector then takes the
    first one whose queue has room, backing off when all are full."""

    def initialize_state(self, kv_weight: float = 1.0, **_: object) -> None:
        self.kv_weight = kv_weight

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
        rows = []
        for wid, r in by_id.items():
            stats = r.routing_stats or {}
            queued = self._replica_queue_len_cache.get(r.replica_id)
            load = queued if queued is not None else stats.get("load", 0)
            rows.append((wid, float(load) / max(1, r.max_ongoing_requests), float(stats.get("free_kv", 1.0))))
        return [[by_id[wid]] for wid in rank_replicas(rows, hint, getattr(self, "kv_weight", 1.0))]
