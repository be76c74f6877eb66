"""AsyncEngine: the engine loop on a background thread, results as async streams.

    engine = AsyncEngine(EngineConfig())       # data_parallel_size > 1: over a DataParallelEngine
    async for out in engine.generate("r1", "hello", SamplingParams()):
        print(out.new_token_ids)

Requests cross into the loop thread through a lock-protected inbox; outputs come back
to each request's asyncio queue with `loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import AsyncIterator

from kvmesh.kvstore.transfer.kv_transport import KVTransport, Offer
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.parallel.replica import RankLauncher
from kvmesh.workers.request import HeldKV, RequestOutput, Resume
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
from kvmesh.workers.errors import EngineDeadError

from .data_parallel import DataParallelEngine, open_engine
from .protocol import EngineProtocol
from .stats import EngineStats

log = logging.getLogger(__name__)
LANDING_POLL_S = 0.5     # while a given-up transfer may still write memory: how often to look again


class AsyncEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), engine: EngineProtocol | None = None,
                 launcher: RankLauncher | None = None):
        self.engine = engine or open_engine(config, launcher)    # launcher: ranks 1..N-1 (TP or DP)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._inbox: list[tuple] = []
        self._dead: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, *payload in inbox:
                try:
                    self._apply(kind, payload)
                except Exception:   # one bad message must not stop the loop for everyone
                    log.exception("engine inbox message %r failed", kind)
            if not self.engine.has_unfinished():
                # every inbox write and shutdown sets it: no polling when idle, except while the
                # memory of a handoff given up in flight waits for its transfer to end
                self._wake.wait(LANDING_POLL_S if self.engine.reap_landing() else None)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # the loop must never die silently
                log.exception("engine step failed")
                self._dead = e
                for rid in list(self._streams):
                    self._push(rid, e)
                return
            for out in outputs:
                self._push(out.request_id, out)

    def _apply(self, kind: str, payload: list) -> None:
        if kind == "abort":
            self.engine.abort(payload[0])
        elif kind == "call":    # runs even if the caller stopped waiting (a release must still happen)
            fut, fn, args = payload
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            if fut.set_running_or_notify_cancel():
                fut.set_result(result) if error is None else fut.set_exception(error)
            elif error is not None:
                log.warning("engine call %s failed after its caller left: %s", getattr(fn, "__name__", fn), error)
        else:
            rid, prompt, params, kw = payload
            try:
                self.engine.add_request(rid, prompt, params, **kw)
            except Exception as e:
                self._push(rid, e)

    def _push(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run `fn(*args)` on the engine thread between steps (engine state is not thread-safe)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(("call", fut, fn, args))
        self._wake.set()
        return fut

    async def held_handle(self, request_id: str) -> HeldKV:
        return await asyncio.wrap_future(self.call(self.engine.held_handle, request_id))

    async def offer_held(self, request_id: str, transport: KVTransport, skip: int = 0) -> Offer:
        return await asyncio.wrap_future(self.call(self.engine.offer_held, request_id, transport, skip))

    def is_held(self, request_id: str) -> bool:
        return self.engine.is_held(request_id)

    def release_held_soon(self, request_id: str) -> None:
        """Free a held cache from any thread without waiting (safe where no await may run)."""
        self.call(self.engine.release_held, request_id)

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def info(self) -> dict:
        """What the ingress needs to know about this engine's model and limits."""
        e = self.engine
        index = e.prefix.index
        return {"max_model_len": e.max_model_len, "vocab_size": e.args.vocab_size,
                "block_tokens": e.config.block_tokens, "fingerprint": e.fingerprint, "model_dir": str(e.model_dir),
                "index_namespace": index.namespace if index is not None else None,
                "max_schema_bytes": e.config.max_schema_bytes}

    async def release_held(self, request_id: str) -> None:
        await asyncio.wrap_future(self.call(self.engine.release_held, request_id))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                       hold_kv: bool = False, resume: Resume | None = None, batched: bool = False,
                       rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per new token (n > 1: of each sequence, `index` says which);
        the last has all_finished=True. `batched`: yield lists of every output ready (one step of
        n sequences travels as one item). `rank`: a data-parallel engine runs the request on
        this rank (None: its front routes it; ignored without data parallelism). Validation
        errors (InvalidRequestError) are raised from the first iteration."""
        if self._dead:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        params.validate()
        if request_id in self._streams:  # a second stream would steal (and abort) the first one's
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if params.guide:    # compiled in the pool (bounded), off the loop: a bad schema raises here, a 400
            await asyncio.wrap_future(self.engine.guides.compile_async(params.guide))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        kw = {"hold_kv": hold_kv, "resume": resume, "wait": False}    # never a compile on the loop thread
        if rank is not None and isinstance(self.engine, DataParallelEngine):
            kw["rank"] = rank
        with self._lock:
            self._inbox.append(("add", request_id, prompt, params, kw))
        self._wake.set()
        finished = False
        try:
            while True:
                items = [await queue.get()]
                while batched and not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    finished = finished or item.all_finished
                yield items if batched else items[0]
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, or None while it runs."""
        return self._dead

    def stats(self) -> EngineStats:
        """Engine, memory, reuse and store counters (read without stopping the loop); a
        data-parallel engine's summed over its ranks."""
        return self.engine.stats()

    def rank_stats(self) -> list[EngineStats]:
        """Each rank's stats, in rank order (one entry unless data-parallel)."""
        return list(self.engine.rank_stats)

    def shutdown(self) -> None:
        """Stop the loop, then flush the engine's write-behind persistence and close its index."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # a step is still running: closing under it would be unsafe
            log.warning("engine loop did not stop within 5 s; its pending persistence is not flushed")
            return
        self.engine.close()
