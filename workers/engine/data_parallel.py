"""Data-parallel attention with expert parallelism: one replica of N whole attention engines.

    engine = open_engine(EngineConfig(data_parallel_size=2, enable_expert_parallel=True))
    engine.generate(prompts, params)           # the Engine API: add_request / step / abort / ...

Each DP rank is a whole `Engine`: its own scheduler, KV cache, state slots, prefix cache and
write-behind; attention, mHC, norms, the shared expert and dense layers are replicated, the
routed experts split (rank r owns experts [r*E/N, (r+1)*E/N)), and each MoE layer exchanges
the ranks' tokens (model/moe.py `MoE.exchanged`: all-gather of hidden states and picks with
their counts, all-reduce of the partial expert outputs). Rank 0 is this process and the front;
ranks 1..N-1 are local processes (engine/dp_rank.py; started as workers/processes.py says),
or under Serve rank actors in the replica's placement group (cluster/serve/ranks.py).
`stats()` sums the ranks; `rank_stats` has each.

The front routes each new request to one rank: the rank whose device pool holds the longest
prefix of its prompt (in whole blocks; each rank reports what its pool gained and lost every
tick), else the least loaded (running + waiting + held + just routed); n > 1 forks stay on that rank.
Store objects and prefix hashes are the single engine's (the fingerprint does not depend on
the parallel sizes): what one rank stores, any engine restores.

Handoffs (prefill / decode roles) keep the Engine API: a hold_kv request holds its blocks +
state slot on the rank it ran on, and `held_handle` / `offer_held` / `release_held` /
`is_held` / `release_read` act on that rank through handoff calls (engine/dp_rank.py). Each
rank registers its own cache with its own NIXL agent (`open_nixl`), so an offer names the
holding rank's agent and a decode engine READs straight from that rank's memory; the read's
notification reaches that rank, which frees the cache (`release_read`). Ray copies stay on
rank 0 (ranks need not be Ray workers): the holding rank gathers its blocks and the tensors
travel to rank 0, where the RayTransport puts them (`KVTransport.relay`). A resume placed on
rank j loads into rank j's blocks + slot with rank j's transports: its load must be a
`PortableLoad` (cluster.serve.transfer.Loader), whose NIXL offer rank j READs itself and whose Ray
copy rank 0 fetches and sends. A failed READ falls back to a Ray copy on any rank: on rank j
the request fails there (its memory freed once the READ is over, never before) and the front
starts it again on rank j with the copy's tensors (`PortableLoad.fallback`); when there is no
copy, the request fails with the HandoffError.

Speculative decoding: each rank drafts for its own requests with the MTP layer, whose MoE goes
through the same expert exchange (workers/spec/mtp.py: every rank makes k MTP passes whenever
any rank stepped).

Tensor parallelism inside DP ranks (tensor_parallel_size T > 1): each DP rank's Engine is the
rank 0 of a TP group of T local processes (workers/parallel/replica.py), which split its attention
heads, output groups and vocabulary and hold identical copies of its cache; the routed experts
are split over all D x T ranks, each MoE layer splitting a group's tokens over its ranks before
the exchange (model/moe.py `MoE.grouped`). Everything above is per DP rank, so per group.

Built on the CPU (gloo) or one CUDA device per rank (NCCL, untested here; DP rank d's group on
the node's devices d*T .. d*T + T-1). Refused at start-up: DP without expert parallelism.
A rank that dies or stalls raises RankFailed within rank_timeout_s; the engine stays failed.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from kvmesh.kvstore.transfer.kv_transport import HandoffError, KVTransport, Offer, PortableLoad
from kvmesh.kvstore.transfer.nixl_transfer import NixlTransport
from kvmesh.workers.checkpoint.default_model import ensure_default_model
from kvmesh.workers.checkpoint.sharding import check_sizes
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ConfigError, ModelArgs
from kvmesh.workers.parallel.collectives import Collectives, RankFailed, init_method
from kvmesh.workers.parallel.replica import Liveness, LocalProcessLauncher, RankLauncher, Stop
from kvmesh.workers.request import HeldKV, RequestOutput, Resume
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams

from .dp_rank import (CacheDigests, Call, CallReply, HeldHandle, NewRequest, OfferHeld, OpenNixl, PollReleased,
                      RankHandoff, ReleaseHeld, Reply, Residency, Tick, rank_config, run_call, run_dp_rank, run_tick)
from .engine import GRAMMAR_POLL_S, Engine
from .protocol import run_to_completion
from .stats import EngineStats, summed

log = logging.getLogger(__name__)


def open_engine(config: EngineConfig = EngineConfig(), launcher: RankLauncher | None = None):
    """The engine `config` asks for: a DataParallelEngine at data_parallel_size > 1, else an Engine.
    `launcher`: how ranks 1..N-1 start (any RankLauncher; data-parallel: one that runs the
    `main` it is given, as LocalProcessLauncher and cluster.serve.ranks.RayRankLauncher do)."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, launcher)
    return Engine(config, launcher)


def check_dp_sizes(args: ModelArgs, size: int, tp: int = 1) -> None:
    """ConfigError naming the numbers unless `size` DP ranks of `tp` ranks each can split this
    model: its routed experts over all size x tp ranks, its heads, output groups and vocabulary
    over each DP rank's tp (workers/checkpoint/sharding.py check_sizes)."""
    if args.n_routed_experts % (size * tp):
        ranks = f"data_parallel_size={size}" if tp == 1 else \
            f"data_parallel_size x tensor_parallel_size = {size} x {tp} = {size * tp}"
        raise ConfigError(f"{ranks} does not divide n_routed_experts={args.n_routed_experts} "
                          f"(each rank owns whole routed experts); use sizes whose product divides "
                          f"{args.n_routed_experts}")
    if tp > 1:
        check_sizes(args, tp, True)


class DataParallelEngine:
    """Rank 0 of a data-parallel replica and its front (see the module docstring). Not an Engine
    subclass: both satisfy engine/protocol.py's EngineProtocol."""

    def __init__(self, config: EngineConfig, launcher: RankLauncher | None = None):
        """`launcher` starts ranks 1..N-1, each running `run_dp_rank` (local processes by
        default; serving: Ray actors in the replica's placement group)."""
        self.config, self.size = config, config.data_parallel_size
        model_dir = Path(config.model) if config.model else ensure_default_model()
        check_dp_sizes(ModelArgs.from_file(model_dir / "config.json"), self.size, config.tensor_parallel_size)
        self.launcher = launcher or LocalProcessLauncher()
        if not hasattr(self.launcher, "main"):
            raise ConfigError(f"data_parallel_size={self.size}: {type(self.launcher).__name__} cannot start "
                              f"data-parallel ranks (it has no `main` to run; LocalProcessLauncher and "
                              f"kvmesh.cluster.serve.ranks.RayRankLauncher do)")
        self.launcher.main = run_dp_rank                     # each rank a whole engine, not a TP follower
        store = Collectives.host_store(self.launcher.host, self.size, config.rank_timeout_s)
        method = init_method(self.launcher.host, store)
        self.launcher.start(self.size, method, config)
        try:
            self.comm = Collectives(0, self.size, method, config.device, config.rank_timeout_s, store)
            self.local = self._start(config)
        except BaseException:
            self.launcher.stop()
            raise
        self.where: dict[str, int] = {}                       # request id -> its rank
        self.loads = [0] * self.size
        self.resident: list[set[int]] = [set() for _ in range(self.size)]
        self.residency = Residency(self.local.blocks)
        self.handoff = RankHandoff(self.local, 0)
        self.held_on: dict[str, int] = {}                     # held request id -> its rank
        self.loading: dict[str, tuple[PortableLoad, NewRequest]] = {}   # resumed on a rank > 0: its load, request
        self.rank_stats: list[EngineStats] = [self.local.stats()] * self.size
        self._clear()
        self.health = Liveness(self.launcher)

    def _start(self, config: EngineConfig) -> Engine:
        """Rank 0's engine, once every rank has built its own (a failure anywhere fails here)."""
        engine, error = None, None
        try:
            engine = Engine(rank_config(config, 0), dp=self.comm)
        except Exception as e:
            error = e
        errors = self.comm.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            engine.close()
            raise RankFailed("; ".join(f"data-parallel rank {r} failed to start: {e}" for r, e in bad))
        return engine

    def _clear(self) -> None:
        self.new: list[list[NewRequest]] = [[] for _ in range(self.size)]
        self.aborts: list[list[str]] = [[] for _ in range(self.size)]

    # ---- the Engine's attributes a caller reads ------------------------------------------------
    @property
    def tokenizer(self):
        return self.local.tokenizer

    @property
    def args(self) -> ModelArgs:
        return self.local.args

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def fingerprint(self) -> str:
        return self.local.fingerprint              # every rank's: it does not depend on the parallel sizes

    @property
    def model_dir(self) -> Path:
        return self.local.model_dir

    @property
    def prefix(self):
        """Rank 0's prefix cache: its hasher, and the index every rank publishes to."""
        return self.local.prefix

    @property
    def guides(self):
        """Rank 0's guide compiler: a schema compiles (and fails) here first; each rank compiles its own."""
        return self.local.guides

    def reap_landing(self) -> bool:
        """Rank 0's (Engine.reap_landing); the other ranks reap theirs in every tick."""
        return self.local.reap_landing()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    hold_kv: bool = False, resume: Resume | None = None, wait: bool = True,
                    rank: int | None = None) -> int:
        """Queue a request on `rank` (the ingress saw that rank hold its prefix), else on the rank
        `route` picks; returns that rank. It starts there on the next step. `hold_kv` / `resume`:
        Engine.add_request's, on that rank (a resume on rank j > 0 needs a PortableLoad).

        `wait`: a grammar is compiled on rank 0 first, so a bad schema raises here (a 400);
        False: the caller checked it already (AsyncEngine compiles it on rank 0 before adding).
        The rank that runs the request compiles its own copy in its own pool and parks the
        request until it is ready (engine/grammar_wait.py): no rank compiles inside the lockstep
        step. A request routed off rank 0 thus compiles twice (each cached); shipping rank 0's
        compiled grammar instead would put megabytes into every rank's tick."""
        if request_id in self.where or request_id in self.held_on:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        ids = self.local.prepare(prompt, params)
        if params.guide and wait:
            self.local.guides.compile(params.guide)
        if rank is not None and not 0 <= rank < self.size:
            raise InvalidRequestError(f"rank {rank}: this engine has data-parallel ranks 0..{self.size - 1}")
        rank = self.route(ids) if rank is None else rank
        offer = None
        if resume is not None and rank == 0:     # rank 0 runs the caller's load itself (Ray fallback too)
            self.handoff.kept[request_id] = resume.load
        elif resume is not None:
            if not isinstance(resume.load, PortableLoad):
                raise HandoffError(f"request {request_id}: data-parallel rank {rank} loads a handed-off cache with "
                                   f"its own transports, and this Resume.load is no PortableLoad")
            offer = resume.load.portable()
        new = NewRequest(request_id, ids, params, hold_kv, resume._replace(load=None) if resume else None, offer)
        if offer is not None:
            self.loading[request_id] = (resume.load, new)
        self.new[rank].append(new)
        self.where[request_id] = rank
        self.loads[rank] += params.n
        return rank

    def route(self, ids: list[int]) -> int:
        """The rank whose device pool holds the longest prefix of `ids` (whole blocks, the
        last token excluded: it is always computed), else the least loaded; ties: lowest rank."""
        bt = self.config.block_tokens
        hashes = self.local.prefix.hasher.hashes(ids[:(len(ids) - 1) // bt * bt])
        hits = [next((i for i, h in enumerate(hashes) if h not in held), len(hashes)) for held in self.resident]
        return min(range(self.size), key=lambda r: (-hits[r], self.loads[r], r))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (waiting, running, or held for a handoff)."""
        rank = self.where.pop(request_id, None)
        if rank is None:
            self.release_held(request_id)
            return
        queued = [r for r in self.new[rank] if r.request_id == request_id]
        if queued:
            self.new[rank].remove(queued[0])
            self.handoff.kept.pop(request_id, None)
            self.loading.pop(request_id, None)
        else:
            self.aborts[rank].append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.where) or any(self.aborts)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One tick on every rank (engine/dp_rank.py); every rank's outputs. RankFailed (within
        rank_timeout_s) when a rank died or stalled; the engine is unusable after it."""
        if not any(self.new) and not any(self.aborts) and self._only_parked():
            time.sleep(GRAMMAR_POLL_S)      # nothing to step until a grammar is ready: no busy ticks
        tick = Tick(tuple(map(tuple, self.new)), tuple(map(tuple, self.aborts)))
        self._clear()
        return self._tick(tick)

    def _only_parked(self) -> bool:
        """As of the last tick, no rank has a request to step, and some wait for their grammar or
        their prefix's reads."""
        ranks = self.rank_stats
        return all(s.running + s.waiting == 0 for s in ranks) and any(s.grammar.waiting or s.restoring for s in ranks)

    def flush(self) -> None:
        """Every rank's persisted blocks and checkpoints durable in the store (a flush tick)."""
        none = ((),) * self.size
        self._tick(Tick(none, none, flush=True))

    def _exchange(self, message: Tick | Call, mine) -> list:
        """Send `message` to every rank; every rank's answer (`mine()`: rank 0's), in rank order."""
        self.health.check()
        try:
            self.comm.send(message)
            return self.comm.gather_objects(mine(), starting=False)
        except RankFailed as e:
            self.health.failed(e)
            raise

    def _tick(self, tick: Tick) -> list[RequestOutput]:
        replies: list[Reply] = self._exchange(tick, lambda: run_tick(self.local, tick, 0, self.residency,
                                                                       self.handoff))
        outputs = []
        for rank, reply in enumerate(replies):
            self.resident[rank].difference_update(reply.dropped)
            self.resident[rank].update(reply.named)
            self._note(rank, reply.stats)
            for rid, report in reply.loaded:
                self.loading.pop(rid)[0].settle(report)
            for out in reply.outputs:
                if out.held:
                    self.held_on[out.request_id] = rank
            outputs += [o for o in reply.outputs if not (o.request_id in reply.unread and self._again(o, rank))]
        for out in outputs:
            if out.finished and out.all_finished:
                self.where.pop(out.request_id, None)
                self.loading.pop(out.request_id, None)
        return outputs

    def _again(self, failed: RequestOutput, rank: int) -> bool:
        """A READ on `rank` failed (and is over): queue the request there again with the Ray
        copy instead; False (its error output stands) when there is none."""
        load, new = self.loading[failed.request_id]
        try:
            offer = load.fallback()
        except HandoffError as e:
            log.warning("request %s: %s", failed.request_id, e)
            return False
        self.new[rank].append(dataclasses.replace(new, offer=offer))
        self.loads[rank] += new.params.n
        return True

    def _note(self, rank: int, s: EngineStats) -> None:
        """A rank's stats and load now. A held cache counts: it occupies its rank's memory until
        read, so a prefill replica spreads them over its ranks."""
        self.rank_stats[rank] = s
        self.loads[rank] = s.load + s.held + sum(r.params.n for r in self.new[rank])

    # ---- handoffs (see the module docstring) ---------------------------------------------------
    def _call(self, rank: int | None, op) -> list[CallReply]:
        """Run a handoff call on `rank` (None: every rank), between steps; rank 0's runs here."""
        call = Call(rank, op)
        replies = [run_call(self.handoff, call)] if rank == 0 else \
            self._exchange(call, lambda: run_call(self.handoff, call))
        for r, reply in enumerate(replies):
            self._note(r, reply.stats)
        bad = [(r, c.error) for r, c in enumerate(replies) if c.error]
        if bad:
            raise HandoffError("; ".join(f"data-parallel rank {r}: {e}" for r, e in bad))
        return replies

    def _holder(self, request_id: str) -> int:
        rank = self.held_on.get(request_id)
        if rank is None:
            raise HandoffError(f"this engine does not hold request {request_id}")
        return rank

    def open_nixl(self, name: str, node_ip: str, backend: str, timeout_s: float) -> NixlTransport | None:
        """Every rank registers its cache with its own NIXL agent (`{name}-dp{rank}`); rank 0's
        transport (None when NIXL cannot run here; a rank where it cannot refuses NIXL offers)."""
        self._call(None, OpenNixl(name, node_ip, backend, timeout_s))
        return self.handoff.nixl

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held_on

    def held_handle(self, request_id: str) -> HeldKV:
        """The holding rank's HeldKV (its block ids and slot)."""
        rank = self._holder(request_id)
        return self._call(rank, HeldHandle(request_id))[rank].value

    def offer_held(self, request_id: str, transport: KVTransport, skip: int = 0) -> Offer:
        """The holding rank offers its cache with its own transport of `transport`'s kind (NIXL:
        its agent; Ray: its gathered tensors, which `transport` relays here)."""
        rank = self._holder(request_id)
        if rank == 0:
            return self.local.offer_held(request_id, transport, skip)
        return transport.relay(self._call(rank, OfferHeld(request_id, transport.name, skip))[rank].value)

    def release_held(self, request_id: str) -> None:
        rank = self.held_on.pop(request_id, None)
        if rank is not None:
            self._call(rank, ReleaseHeld(request_id))

    def release_read(self, transport: NixlTransport) -> list[str]:
        """Every rank frees the held caches destinations finished reading from its agent
        (`transport`: rank 0's, from open_nixl); their request ids."""
        read = [rid for c in self._call(None, PollReleased()) for rid in c.value]
        for rid in read:
            self.held_on.pop(rid, None)
        return read

    def cache_digests(self) -> list[list[str]]:
        """Per DP rank, its TP group's cache digests (Engine.cache_digests)."""
        return [c.value for c in self._call(None, CacheDigests())]

    def stats(self) -> EngineStats:
        """The replica's stats: every rank's as of the last step, summed (`rank_stats`: each
        rank's, in rank order)."""
        return summed(self.rank_stats)

    def close(self) -> None:
        if self.health.dead is None:
            try:
                self.comm.send(Stop("engine closed"), starting=True)
            except RankFailed:
                pass
        self.handoff.close()
        self.local.close()
        self.launcher.stop()
        self.comm.close()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """All prompts to completion, outputs in input order (engine/protocol.py `run_to_completion`)."""
        return run_to_completion(self, prompts, params)
