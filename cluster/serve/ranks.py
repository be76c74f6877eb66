"""The ranks of a tensor- or data-parallel replica as Ray actors in the replica's own placement group.

    Serve replica = rank 0 (bundle 0): scheduler + engine; hosts the process group on its node IP
      ├─ _Rank actor, bundle 1: main(1, N, init_method, config)   (blocks until shutdown)
      └─ ...           bundle N-1
    placement group: N bundles (PoolConfig.rank_bundle), STRICT_PACK: one node

A data-parallel replica over several nodes (data_parallel_size_local L < N) has a bundle per
node instead, each with L ranks' resources, STRICT_SPREAD (PoolConfig.placement): rank r's actor
goes in bundle r // L, so ranks 0..L-1 share rank 0's node and each other node holds L ranks.
The process group forms at rank 0's node IP; every rank listens on its own host's address
(workers/parallel/collectives.py `local_address`), and a rank on another host opens its NIXL
agent there. A host that dies takes its ranks: the replica fails as a whole (below).

`main` is what each rank runs: `run_rank` (a tensor-parallel follower) unless the engine's builder
sets another, as `DataParallelEngine` does (`run_dp_rank`: a whole attention engine per rank).

`RayRankLauncher` is the engine's `RankLauncher` (workers/parallel/replica.py). The rank actors are
owned by the replica, so they die with it; a rank that dies on its own ends its `run` call,
which `check()` turns into RankFailed (the engine also hears it as a failed collective).
The replica then fails its requests, its health check fails and Serve replaces it —
placement group, ranks and all.
"""
from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvmesh.workers.parallel.collectives import RankFailed
from kvmesh.workers.parallel.replica import run_rank

log = logging.getLogger(__name__)
CHECK_PERIOD_S = 0.25    # `check` runs before every step; a dead rank also fails the step's collective at once


class NoPlacementGroup(RuntimeError):
    """A tensor- or data-parallel replica was started outside a placement group with a bundle per rank."""


@ray.remote(max_restarts=0)
class _Rank:
    """One rank r > 0 of a replica: `run` is the rank's whole life."""

    def run(self, main, rank: int, world_size: int, init_method: str, config) -> None:
        main(rank, world_size, init_method, config)


class RayRankLauncher:
    """Starts ranks 1..N-1 of the calling Serve replica in bundles 1..N-1 of its placement group;
    rank r's actor is named `{name}:{r}` (`ray list actors` shows whose rank it is)."""

    def __init__(self, bundle: dict[str, float], name: str, ranks_per_bundle: int = 1):
        self.bundle, self.name, self.main = dict(bundle), name, run_rank
        self.per_bundle = ranks_per_bundle      # PoolConfig.ranks_per_bundle
        self.host = ray.util.get_node_ip_address()
        self.actors: list = []
        self.runs: list = []
        self._checked = 0.0

    def start(self, world_size: int, init_method: str, config) -> None:
        pg = get_current_placement_group()
        need = -(-world_size // self.per_bundle)
        if pg is None or len(pg.bundle_specs) < need:
            have = 0 if pg is None else len(pg.bundle_specs)
            raise NoPlacementGroup(
                f"{world_size} ranks need the replica in a placement group of {need} "
                f"bundles ({self.per_bundle} rank(s) each); it has {have}: deploy the pool through cluster.app "
                "(PoolConfig.deployment_options sets placement_group_bundles)")
        b = self.bundle
        options = dict(num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                       resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")})
        for rank in range(1, world_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank // self.per_bundle)
            actor = _Rank.options(scheduling_strategy=strategy, name=f"{self.name}:{rank}", **options).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(self.main, rank, world_size, init_method, config))

    def check(self) -> None:
        """RankFailed if a rank's `run` ended: it died, raised, or returned before `stop`."""
        if not self.runs or time.monotonic() - self._checked < CHECK_PERIOD_S:
            return
        self._checked = time.monotonic()
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                raise RankFailed(f"rank {rank} of this replica failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from e
            raise RankFailed(f"rank {rank} of this replica stopped on its own")

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:      # already gone
                log.debug("rank actor kill: %s", e)
        self.actors, self.runs = [], []
