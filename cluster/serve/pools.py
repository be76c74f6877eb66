"""The worker pools: Serve deployments that each own one AsyncEngine.

    Colocated.generate(req)           prompt -> every token (one worker does both)
    Prefill.prefill(req) -> Handoff   prompt -> first token; the cache stays held
    Decode.decode(req, handoff)       pulls the held cache (NIXL READ or Ray object), streams the rest

Each class is plain Python; `kvmesh.cluster.app` turns it into a deployment with the pool's
options. A worker's id is its Serve replica id (the router pins follow-ups by it).

A data-parallel prefill or decode replica (engine/data_parallel.py) keeps this code: each rank
registers its own cache with its own NIXL agent (`kvmesh-{pool}-{worker}-dp{rank}`), a held
cache stays on its rank until that rank's agent hears the READ's notification (the release
loop's `release_read` polls every rank), a `release` (the engine frees it on its rank), or the
timeout, and Ray copies go through rank 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import ray
from ray import serve

from kvmesh.kvstore.transfer.kv_transport import KVTransport, Offer
from kvmesh.kvstore.transfer.nixl_transfer import NixlTransport
from kvmesh.workers.engine.async_engine import AsyncEngine
from kvmesh.workers.request import Resume

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.messages import Chunk, GenRequest, Handoff, RouteHint, WorkerStats
from kvmesh.cluster.serve import replica_logs
from kvmesh.cluster.serve.grammar_gate import GrammarGate
from kvmesh.cluster.serve.routing import NO_HINT, detached, rank_hint
from kvmesh.cluster.serve.transfer import NIXL_UNAVAILABLE, HandoffError, Loader, RayTransport

log = logging.getLogger(__name__)
RELEASE_POLL_S = 0.005
DRAIN_HELD_S = 4.0          # within app.py's graceful_shutdown_timeout_s


class _Worker:
    POOL = ""

    def __init__(self, config: ServeConfig):
        replica_logs.install()      # a refusal is one WARNING line, a cancel no error
        self.config = config
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        pool = getattr(config, self.POOL)
        self.dp_ranks = pool.data_parallel_size
        self.launcher = None
        if pool.ranks > 1:     # ranks 1..N-1 (TP or DP): actors in this replica's placement group
            from kvmesh.cluster.serve.ranks import RayRankLauncher
            self.launcher = RayRankLauncher(pool.rank_bundle(), f"kvmesh-rank:{self.POOL}:{self.worker_id}",
                                            pool.ranks_per_bundle)
        engine_config = config.pool_engine(pool, self.worker_id)
        self.engine = AsyncEngine(engine_config, launcher=self.launcher)
        self.counters = {"nixl_bytes": 0, "ray_bytes": 0, "fallbacks": 0, "held_timeouts": 0,
                         "handoff_reused_blocks": 0, "handoff_saved_bytes": 0}
        self.ray = RayTransport(self.engine.fingerprint, config.handoff.release_timeout_s)
        # serving slots, and a grammar's compile waited for outside them (grammar_gate.py)
        self.gate = GrammarGate(self.engine.engine.guides, pool.max_ongoing_requests, pool.max_grammar_waiting,
                                pool.grammar_waiting_per_client, config.ingress.retry_after_s)

    def _nixl(self) -> tuple[NixlTransport | None, str | None]:
        """(the NIXL transport or None, the fallback label handoffs carry when NIXL was wanted but
        is off). Data-parallel: every rank opens its own; this is rank 0's."""
        h = self.config.handoff
        if h.transport != "nixl":
            return None, None
        nixl = self.engine.call(self.engine.engine.open_nixl, f"kvmesh-{self.POOL}-{self.worker_id}",
                                ray.util.get_node_ip_address(), h.nixl_backend, h.release_timeout_s).result()
        return (nixl, None) if nixl is not None else (None, NIXL_UNAVAILABLE)

    def info(self, hint: RouteHint | None = None) -> dict:
        return {**self.engine.info(), "pool": self.POOL, "worker_id": self.worker_id,
                "held": self.engine.stats().held, "node_id": ray.get_runtime_context().get_node_id()}

    def record_routing_stats(self) -> dict:
        s = self.engine.stats()
        return {"load": s.load, "free_kv": s.free_kv, "rank_loads": [r.load for r in self.engine.rank_stats()]}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the P/D planner reads (cluster/serve/autoscale.py), pushed to Serve's controller: the
        engine's monotonic sums and its gauges (a data-parallel replica's summed over its ranks)."""
        s = self.engine.stats()
        c, q = s.counters, s.queue_time
        return {"prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
                "queue_time_sum": q["sum"], "queue_time_count": q["count"],
                "queued_prompt_tokens": s.queued_prompt_tokens, "running": s.running, "waiting": s.waiting,
                **{k: float(v) for k, v in dataclasses.asdict(s.planner).items()}}

    def check_health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop died: {self.engine.dead!r}")
        if self.launcher is not None:     # a rank that died while the engine idles
            self.launcher.check()

    def stats(self, hint: RouteHint | None = None) -> WorkerStats:
        """Live counters (the ingress scrapes every replica for /metrics, pinned by `hint`); a
        data-parallel replica's summed over its ranks, and each rank's in `ranks`."""
        ranks = self.engine.rank_stats()
        return WorkerStats(self.POOL, self.worker_id, self.engine.stats(), **self.counters,
                           serving=self.gate.serving, grammar_gate_waiting=self.gate.grammar_waiting,
                           grammar_busy_refusals=self.gate.refused, ranks=tuple(ranks) if len(ranks) > 1 else ())

    def _chunks(self, outs, transfer=None):
        """One Chunk, or a list of them when a step produced several (n > 1): one stream item."""
        chunks = [self._chunk(o, transfer if i == 0 else None) for i, o in enumerate(outs)]
        return chunks[0] if len(chunks) == 1 else chunks

    def _chunk(self, out, transfer=None) -> Chunk:
        n = len(out.new_token_ids)
        return Chunk(list(out.new_token_ids), list(out.logprobs[len(out.logprobs) - n:]) if n else [],
                     out.finished, out.finish_reason, out.prompt_tokens, out.cached_tokens, transfer,
                     self.stats() if out.all_finished else None, out.index, list(out.top_logprobs),
                     out.all_finished, out.prompt_logprobs)


class _WholeRequests:
    """`generate`: a request's prompt and every token on this worker (Colocated; Decode when
    the ingress keeps a prompt off the prefill pool)."""

    async def generate(self: _Worker, req: GenRequest, hint: RouteHint | None = None):
        rank = rank_hint(hint or NO_HINT, self.worker_id, self.dp_ranks)      # data-parallel: the rank holding the prefix
        async with self.gate.admitted(req):
            async for outs in self.engine.generate(req.request_id, req.prompt, req.params, batched=True, rank=rank):
                yield self._chunks(outs)


class Colocated(_WholeRequests, _Worker):
    POOL = "colocated"


class Prefill(_Worker):
    """Runs prompts, holds each request's blocks + state slot until decode has read them
    (NIXL notification `release:<id>`), an explicit `release` (decode ended before its READ, or
    the request ended before decode was called: the ingress's dispatcher), or `release_timeout_s`
    (a peer that crashed: counted, /metrics `kvmesh_worker_held_timeouts`). A prefill call
    cancelled while it waits or runs frees what it holds (the ingress cancels it when its client
    goes away)."""
    POOL = "prefill"

    def __init__(self, config: ServeConfig):
        super().__init__(config)
        self.nixl, self.fallback = self._nixl()
        self.held: dict[str, float] = {}        # request id -> release deadline
        self._reaper: asyncio.Task | None = None
        self._held_changed: asyncio.Event | None = None

    async def prefill(self, req: GenRequest, hint: RouteHint | None = None) -> Handoff:
        """Every exit but a handoff that decode can still claim (NIXL: registered with a
        release deadline; Ray: exported) frees the held cache, cancellation included."""
        self._start_reaper()
        async with self.gate.admitted(req):
            return await self._prefill(req, hint)

    async def _prefill(self, req: GenRequest, hint: RouteHint | None) -> Handoff:
        handed_over = False
        try:
            last = None
            rank = rank_hint(hint or NO_HINT, self.worker_id, self.dp_ranks)      # data-parallel: the rank holding the prefix
            async for out in self.engine.generate(req.request_id, req.prompt, req.params, hold_kv=True, rank=rank):
                last = out
            base = dict(request_id=req.request_id, prompt_len=last.prompt_tokens, first=last.first,
                        finished=not last.held, finish_reason=last.finish_reason, cached_tokens=last.cached_tokens,
                        worker_id=self.worker_id, worker=self.stats(), siblings=tuple(last.siblings),
                        prompt_logprobs=last.prompt_logprobs)
            if not last.held:
                return Handoff(**base)
            held = await self.engine.held_handle(req.request_id)
            base["rng_state"], base["mtp"] = held.rng_state, held.mtp
            if self.nixl is not None:
                handoff = Handoff(**base, offer=await self.engine.offer_held(req.request_id, self.nixl))
                self._hold(req.request_id)
                handed_over = True
                return handoff
            offer = await self._export(req.request_id)
            return Handoff(**base, offer=dataclasses.replace(offer, fallback_reason=self.fallback))
        finally:
            if not handed_over:     # no await here: this also runs when the call was cancelled
                self.held.pop(req.request_id, None)
                self.engine.release_held_soon(req.request_id)

    async def __del__(self):
        """Serve's graceful stop (a scale-down): routing already left this replica and its calls
        have returned; wait a little for decode to read (or release) what it still holds, so a
        drained prefill replica fails no handoff (Serve stops it after graceful_shutdown_timeout_s)."""
        deadline = time.monotonic() + min(self.config.handoff.release_timeout_s, DRAIN_HELD_S)
        while self.held and time.monotonic() < deadline:
            await asyncio.sleep(RELEASE_POLL_S)

    def _hold(self, request_id: str) -> None:
        self.held[request_id] = time.monotonic() + self.config.handoff.release_timeout_s
        self._held_changed.set()

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._held_changed = asyncio.Event()
            self._reaper = asyncio.create_task(self._release_loop())

    async def export(self, request_id: str, hint: RouteHint | None = None, skip: int = 0) -> Offer:
        """The held cache as a Ray-object offer (decode's fallback after a failed READ), without
        the first `skip` blocks (decode holds them); releases it."""
        if not self.engine.is_held(request_id):
            raise HandoffError(f"prefill worker {self.worker_id} does not hold request {request_id}")
        self.held.pop(request_id, None)
        return await self._export(request_id, skip)

    async def release(self, request_id: str, hint: RouteHint | None = None) -> None:
        self.held.pop(request_id, None)
        await self.engine.release_held(request_id)

    async def _export(self, request_id: str, skip: int = 0) -> Offer:
        try:
            offer = await self.engine.offer_held(request_id, self.ray, skip)
        finally:
            await self.engine.release_held(request_id)
        self.counters["ray_bytes"] += offer.nbytes
        return offer

    async def _release_loop(self) -> None:
        while True:
            if not self.held:       # idle: sleep until a handoff is held (no polling)
                self._held_changed.clear()
                await self._held_changed.wait()
            await asyncio.sleep(RELEASE_POLL_S)
            try:
                for rid in await self._release_read():
                    self.held.pop(rid, None)
                now = time.monotonic()
                for rid in [r for r, deadline in self.held.items() if deadline < now]:
                    log.warning("request %s: decode never read its cache; released after timeout", rid)
                    self.counters["held_timeouts"] += 1
                    await self.release(rid)
            except Exception:
                log.exception("prefill release loop")


    async def _release_read(self) -> list[str]:
        """Free (on the engine thread) the held caches decode finished reading; their ids."""
        if self.nixl is None:
            return []
        return await asyncio.wrap_future(self.engine.call(self.engine.engine.release_read, self.nixl))


class Decode(_WholeRequests, _Worker):
    """Continues handed-off requests (`decode`), and runs a whole request itself (`generate`)
    when the ingress decides its prompt is not worth a handoff (dispatch.py: conditional
    disaggregation)."""
    POOL = "decode"

    def __init__(self, config: ServeConfig, prefill):
        super().__init__(config)
        self.prefill = prefill
        self.nixl, _ = self._nixl()
        self.transports: dict[str, KVTransport] = {t.name: t for t in (self.nixl, self.ray) if t is not None}

    async def decode(self, req: GenRequest, handoff: Handoff, hint: RouteHint | None = None):
        offer = handoff.offer
        if offer is None:
            raise HandoffError(f"request {req.request_id}: prefill finished it, there is no cache to continue")
        self.ray.check(offer)       # another model / layout: refused before anything is allocated
        loader = Loader(offer, self.transports, lambda _, reused: self._fetch_export(handoff, reused), self.counters)
        if offer.transport not in self.transports:
            await loader.prefetch(self._fetch_export_async(handoff))
        resume = Resume(handoff.first, loader, handoff.cached_tokens, handoff.rng_state, handoff.siblings,
                        handoff.mtp)
        first = True
        rank = rank_hint(hint or NO_HINT, self.worker_id, self.dp_ranks)      # data-parallel: the rank holding the prefix, else the front picks
        try:
            async with self.gate.admitted(req, refuse=False):      # prefill admitted it: never a 429 here
                async for outs in self.engine.generate(req.request_id, req.prompt, req.params, resume=resume,
                                                       batched=True, rank=rank):
                    failed = next((o for o in outs if o.error), None)
                    if failed is not None:      # the load raised at admission: the engine failed this request
                        raise HandoffError(f"request {req.request_id}: the cache could not be moved: {failed.error}")
                    yield self._chunks(outs, loader.report if first else None)
                    first = False
        finally:    # ended before the READ started: hand the held cache back now, not at the timeout
            if offer.transport == "nixl" and loader.give_back():     # (detached: this call may be cancelled)
                detached(lambda: self.prefill.release.remote(handoff.request_id,
                                                             hint=RouteHint(require_worker=handoff.worker_id)))

    def _fetch_export(self, handoff: Handoff, reused: int) -> Offer:
        """From the engine thread: ask the prefill worker holding `handoff` for a Ray copy
        (without the `reused` blocks this worker holds)."""
        return detached(lambda: self.prefill.export.remote(
            handoff.request_id, hint=RouteHint(require_worker=handoff.worker_id), skip=reused)
        ).result(timeout_s=self.config.handoff.release_timeout_s)

    async def _fetch_export_async(self, handoff: Handoff) -> Offer:
        return await detached(lambda: self.prefill.export.remote(handoff.request_id,
                                                                 hint=RouteHint(require_worker=handoff.worker_id)))
