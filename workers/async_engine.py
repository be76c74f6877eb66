"""AsyncEngine: the engine loop on a background thread, results as async streams.

    engine = AsyncEngine(EngineConfig())
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

from .engine import Engine, EngineConfig
from .handoff import HeldKV, Resume
from .parallel import RankLauncher
from .sampling import InvalidRequestError, SamplingParams
from .sequence import RequestOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the message carries the cause."""


class AsyncEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), engine: Engine | None = None,
                 launcher: RankLauncher | None = None):
        self.engine = engine or Engine(config, launcher)     # launcher: tensor_parallel_size > 1 ranks
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
                self._wake.wait()       # every inbox write and shutdown sets it: no polling when idle
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

    async def export_held(self, request_id: str) -> dict:
        return await asyncio.wrap_future(self.call(self.engine.export_held, request_id))

    async def release_held(self, request_id: str) -> None:
        await asyncio.wrap_future(self.call(self.engine.release_held, request_id))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                       hold_kv: bool = False, resume: Resume | None = None, batched: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per new token (n > 1: of each sequence, `index` says which);
        the last has all_finished=True. `batched`: yield lists of every output ready (one step of
        n sequences travels as one item). Validation
        errors (InvalidRequestError) are raised from the first iteration."""
        if self._dead:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        params.validate()
        if request_id in self._streams:  # a second stream would steal (and abort) the first one's
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._inbox.append(("add", request_id, prompt, params, {"hold_kv": hold_kv, "resume": resume}))
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

    def stats(self) -> dict:
        """Engine, memory, reuse and store counters (read without stopping the loop)."""
        e = self.engine
        r = e.prefix.stats
        out = {**e.stats, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
               "free_blocks": e.blocks.num_free, "total_blocks": e.blocks.num_blocks,
               "free_slots": e.slots.num_free, "total_slots": e.slots.num_slots,
               "preemptions": e.scheduler.preemptions, "held": len(e.held)}
        r = e.prefix.stats
        out["kv_cache_usage"] = e.blocks.num_used / max(1, e.blocks.num_blocks)
        out["queue_time"] = e.queue_time.snapshot()
        out["prefix_query_tokens"] = r.query_tokens
        out["prefix_hit_tokens"] = dict(r.tier_hit_tokens)
        out.update(reuse_hits=r.hits, reuse_hit_tokens=r.hit_tokens, reuse_bytes_loaded=r.bytes_loaded,
                   reuse_blocks_from_store=r.blocks_from_store, reuse_blocks_from_memory=r.blocks_from_memory,
                   reuse_recomputed_tokens=r.recomputed_tokens, reuse_errors=r.errors)
        if e.prefix.store is not None:
            s = e.prefix.store.stats()
            out.update(store_bytes_read=s.bytes_read, store_bytes_written=s.bytes_written, store_reads=s.reads,
                       store_writes=s.writes, store_corrupt=s.corrupt, store_bytes=s.total_bytes,
                       store_read_errors=s.read_errors, store_timeouts=s.timeouts, store_quarantined=s.quarantined)
        return out

    def shutdown(self) -> None:
        """Stop the loop, then flush the engine's write-behind persistence and close its index."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # a step is still running: closing under it would be unsafe
            log.warning("engine loop did not stop within 5 s; its pending persistence is not flushed")
            return
        self.engine.close()
