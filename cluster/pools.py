"""The worker pools: Serve deployments that each own one AsyncEngine.

    Colocated.generate(req)           prompt -> every token (one worker does both)
    Prefill.prefill(req) -> Handoff   prompt -> first token; the cache stays held
    Decode.decode(req, handoff)       pulls the held cache (NIXL READ or Ray object), streams the rest

Each class is plain Python; `cluster.app` turns it into a deployment with the pool's
options. A worker's id is its Serve replica id (the router pins follow-ups by it).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import ray
from ray import serve

from kvstore.nixl_transfer import make_agent
from workers.async_engine import AsyncEngine
from workers.engine import Engine
from workers.handoff import Resume

from .config import ServeConfig
from .messages import Chunk, GenRequest, Handoff, RouteHint, WorkerStats
from .transfer import NIXL_UNAVAILABLE, HandoffError, Loader

log = logging.getLogger(__name__)
RELEASE_POLL_S = 0.005


class _Worker:
    POOL = ""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        pool = getattr(config, self.POOL)
        self.launcher = None
        if pool.tensor_parallel_size > 1:     # ranks 1..N-1: actors in this replica's placement group
            from .ranks import RayRankLauncher
            self.launcher = RayRankLauncher(pool.rank_bundle(), f"kvmesh-rank:{self.POOL}:{self.worker_id}")
        engine_config = config.pool_engine(pool, self.worker_id)
        self.engine = AsyncEngine(engine_config, engine=Engine(engine_config, launcher=self.launcher))
        self.counters = {"nixl_bytes": 0, "ray_bytes": 0, "fallbacks": 0}
        e = self.engine.engine
        self.layout_id = hashlib.sha256(repr((e.layout, str(e.cache.layers[0].ring.dtype))).encode()).hexdigest()[:16]

    def _make_agent(self):
        """(NIXL agent or None, the fallback label handoffs carry when NIXL was wanted but is off)."""
        if self.config.handoff.transport != "nixl":
            return None, None
        agent, why = make_agent(f"kvmesh-{self.POOL}-{self.worker_id}", self.engine.engine.cache.all_tensors(),
                                ray.util.get_node_ip_address(), self.config.handoff.nixl_backend)
        return agent, (NIXL_UNAVAILABLE if agent is None else None)

    def info(self, hint: RouteHint | None = None) -> dict:
        e = self.engine.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.args.vocab_size,
                "block_tokens": e.config.block_tokens, "fingerprint": getattr(e, "fingerprint", None),
                "model_dir": str(e.model_dir), "pool": self.POOL, "worker_id": self.worker_id,
                "held": len(e.held),
                "node_id": ray.get_runtime_context().get_node_id()}

    def record_routing_stats(self) -> dict:
        s = self.engine.stats()
        free_kv = min(s["free_blocks"] / max(1, s["total_blocks"]), s["free_slots"] / max(1, s["total_slots"]))
        return {"load": s["running"] + s["waiting"], "free_kv": free_kv}

    def check_health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop died: {self.engine.dead!r}")
        if self.launcher is not None:     # a rank that died while the engine idles
            self.launcher.check()

    def stats(self, hint: RouteHint | None = None) -> WorkerStats:
        """Live counters (the ingress scrapes every replica for /metrics, pinned by `hint`)."""
        return WorkerStats(self.POOL, self.worker_id, self.engine.stats(), **self.counters)

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


class Colocated(_Worker):
    POOL = "colocated"

    async def generate(self, req: GenRequest, hint: RouteHint | None = None):
        async for outs in self.engine.generate(req.request_id, req.prompt, req.params, batched=True):
            yield self._chunks(outs)


class Prefill(_Worker):
    """Runs prompts, holds each request's blocks + state slot until decode has read them
    (NIXL notification `release:<id>`), an explicit release, or `release_timeout_s`."""
    POOL = "prefill"

    def __init__(self, config: ServeConfig):
        super().__init__(config)
        self.agent, self.fallback = self._make_agent()
        self.held: dict[str, float] = {}        # request id -> release deadline
        self._reaper: asyncio.Task | None = None
        self._held_changed: asyncio.Event | None = None

    async def prefill(self, req: GenRequest, hint: RouteHint | None = None) -> Handoff:
        """Every exit but a handoff that decode can still claim (NIXL: registered with a
        release deadline; Ray: exported) frees the held cache, cancellation included."""
        self._start_reaper()
        handed_over = False
        try:
            last = None
            async for out in self.engine.generate(req.request_id, req.prompt, req.params, hold_kv=True):
                last = out
            base = dict(request_id=req.request_id, prompt_len=last.prompt_tokens, first_token=last.token_ids[0],
                        first_logprob=last.logprobs[0], finished=last.finish_reason != "held",
                        finish_reason=last.finish_reason, cached_tokens=last.cached_tokens,
                        worker_id=self.worker_id, fingerprint=self.layout_id, worker=self.stats(),
                        first_top=tuple(last.top_logprobs[0]) if last.top_logprobs else (),
                        siblings=tuple(last.siblings), prompt_logprobs=last.prompt_logprobs,
                        first_finish=last.first_finish)
            if last.finish_reason != "held":
                return Handoff(**base)
            held = await self.engine.held_handle(req.request_id)
            base["rng_state"] = held.rng_state
            if self.agent is not None:
                regions = self.engine.engine.cache.block_regions(held.block_ids, held.slot)
                handoff = Handoff(**base, num_blocks=len(held.block_ids), source=self.agent.describe(regions))
                self._hold(req.request_id)
                handed_over = True
                return handoff
            payload = await self._export(req.request_id)
            return Handoff(**base, num_blocks=len(held.block_ids), payload=payload, fallback_reason=self.fallback)
        finally:
            if not handed_over:     # no await here: this also runs when the call was cancelled
                self.held.pop(req.request_id, None)
                self.engine.call(self.engine.engine.release_held, req.request_id)

    def _hold(self, request_id: str) -> None:
        self.held[request_id] = time.monotonic() + self.config.handoff.release_timeout_s
        self._held_changed.set()

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._held_changed = asyncio.Event()
            self._reaper = asyncio.create_task(self._release_loop())

    async def export(self, request_id: str, hint: RouteHint | None = None):
        """The held cache as a Ray object (decode's fallback after a failed READ); releases it."""
        if request_id not in self.engine.engine.held:
            raise HandoffError(f"prefill worker {self.worker_id} does not hold request {request_id}")
        self.held.pop(request_id, None)
        return await self._export(request_id)

    async def release(self, request_id: str, hint: RouteHint | None = None) -> None:
        self.held.pop(request_id, None)
        await self.engine.release_held(request_id)

    async def _export(self, request_id: str):
        tensors = await self.engine.export_held(request_id)
        await self.engine.release_held(request_id)
        self.counters["ray_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        return [ray.put(tensors)]       # in a list so the ref travels (is not resolved) in the reply

    async def _release_loop(self) -> None:
        while True:
            if not self.held:       # idle: sleep until a handoff is held (no polling)
                self._held_changed.clear()
                await self._held_changed.wait()
            await asyncio.sleep(RELEASE_POLL_S)
            try:
                for msg in self.agent.notifications() if self.agent else []:
                    rid = msg.decode(errors="replace").removeprefix("release:")
                    if self.held.pop(rid, None) is not None:
                        await self.engine.release_held(rid)
                now = time.monotonic()
                for rid in [r for r, deadline in self.held.items() if deadline < now]:
                    log.warning("request %s: decode never read its cache; released after timeout", rid)
                    await self.release(rid)
            except Exception:
                log.exception("prefill release loop")


class Decode(_Worker):
    POOL = "decode"

    def __init__(self, config: ServeConfig, prefill):
        super().__init__(config)
        self.prefill = prefill
        self.agent, _ = self._make_agent()

    async def decode(self, req: GenRequest, handoff: Handoff, hint: RouteHint | None = None):
        if handoff.fingerprint != self.layout_id:
            raise HandoffError(f"cache layout {handoff.fingerprint} from prefill does not match decode's "
                               f"{self.layout_id}: deploy both pools with the same engine settings")
        loader = Loader(handoff, self.agent, self._fetch_export, self.counters,
                        self.config.handoff.release_timeout_s)
        if handoff.source is not None and self.agent is None:
            await loader.prefetch(self._fetch_export_async(handoff))
        resume = Resume(handoff.first_token, handoff.first_logprob, loader.load, handoff.cached_tokens,
                        handoff.rng_state, handoff.siblings, handoff.first_top, handoff.first_finish)
        first = True
        try:
            async for outs in self.engine.generate(req.request_id, req.prompt, req.params, resume=resume,
                                                   batched=True):
                if loader.error is not None:
                    raise HandoffError(f"request {req.request_id}: the cache could not be moved: {loader.error}")
                yield self._chunks(outs, loader.report if first else None)
                first = False
        finally:    # ended before the READ started: hand the held cache back now, not at the timeout
            if handoff.source is not None and loader.give_back():
                self.prefill.release.remote(handoff.request_id, hint=RouteHint(require_worker=handoff.worker_id))

    def _fetch_export(self, handoff: Handoff):
        """From the engine thread: ask the prefill worker holding `handoff` for a Ray copy."""
        return self.prefill.export.remote(handoff.request_id, hint=RouteHint(require_worker=handoff.worker_id)
                                          ).result(timeout_s=self.config.handoff.release_timeout_s)

    async def _fetch_export_async(self, handoff: Handoff):
        return await self.prefill.export.remote(handoff.request_id, hint=RouteHint(require_worker=handoff.worker_id))
