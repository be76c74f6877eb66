"""From one generation request to a stream of Chunks, across the pools.

    colocated:      Colocated.generate ───────────────────────────────▶ chunks
    disaggregated:  Prefill.prefill ─▶ Handoff (first token) ─▶ Decode.decode ─▶ chunks

A worker that dies, stalls past `token_timeout_s`, or fails a handoff does not hang
the client: the request is re-run (up to `max_retries`) as a continuation — the prompt
plus the tokens already sent, for the tokens still owed — so a greedy stream completes
exactly as it would have; after that, `WorkerFailed` (a clean error) is raised. An n > 1
request is retried the same way until its first tokens are sent (they wait for decode's
first chunk), and ends with `WorkerFailed` after that. A request that failed for its own
content (InvalidRequestError: a 400) is never retried.

Conditional disaggregation: a prompt whose uncached part is short (`direct_max_tokens`, after
the prefix hint: the longest prefix a decode replica holds), or one that arrives while
`direct_queue` prompts are in flight to the prefill pool, is run whole on the decode replica the
router picks (`Decode.generate`): no prefill call, no handoff (Dynamo's disaggregated router
decides the same way). /metrics `kvmesh_prefill_route_total{route}` counts each route taken.

A request that ends early (its client went away, a stop string matched) releases what it holds on
the pools at once; a timeout (`handoff.release_timeout_s`) stays only for a peer that crashed.
Between prefill's answer and decode's READ the cache is held on the prefill worker (a NIXL offer):

    ended before decode was called       the ingress asks that worker (pinned, `require_worker`)
                                         to release it: no one else has the offer
    ended while decode's call is out     decode owns the offer: its call is not cancelled before
    (queued, or running but no chunk     its first chunk (the load is done then, and the READ's
    yet)                                 notification frees prefill's copy) and cancelled at it,
                                         in the background; a decode that ends before its READ
                                         gives the cache back itself (pools.Decode)
    ended while prefill ran or waited    the prefill call is cancelled (queued: it never runs;
                                         running: it frees what it held); if it answered anyway,
                                         its cache is released as above

The ingress never releases a cache once decode may read it: prefill would free memory a READ is
still copying (decode's prefix cache would keep the torn blocks), and whether a cancelled decode
call already started cannot be known from here. These calls are made `detached` from the
request, so that Serve does not cancel them with it.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

from ray.exceptions import RayActorError

from kvmesh.workers.errors import EngineDeadError, RankFailed

from kvmesh.cluster.messages import Chunk, GenRequest, Handoff, RouteHint
from kvmesh.cluster.serve.metrics import Metrics
from kvmesh.cluster.serve.routing import decode_hint, detached, live_replica_ids
from kvmesh.cluster.errors import WorkerFailed, WorkerStalled
from kvmesh.cluster.serve.transfer import HandoffError

log = logging.getLogger(__name__)


# a worker process died, a rank of a tensor-parallel worker died (its engine is dead until
# Serve replaces it), a handoff failed, or no token came in time
RETRYABLE = (RayActorError, RankFailed, EngineDeadError, HandoffError, WorkerStalled)


def continuation(req: GenRequest, sent: list[int]) -> GenRequest:
    """The same request, resumed after the tokens already sent to the client."""
    if not sent:
        return req
    p = req.params
    params = replace(p, max_tokens=p.max_tokens - len(sent), min_tokens=max(0, p.min_tokens - len(sent)))
    return GenRequest(f"{req.request_id}-r{len(sent)}", req.prompt + sent, params, req.client)


def first_chunks(handoff: Handoff) -> list[Chunk]:
    """The first token of each of the request's sequences, as prefill sampled them."""
    first, last = handoff.first, len(handoff.siblings)
    chunks = [Chunk([first.token], [first.logprob], first.finish is not None, first.finish,
                    handoff.prompt_len, handoff.cached_tokens, top_logprobs=[list(first.top)],
                    all_finished=handoff.finished and not last, prompt_logprobs=handoff.prompt_logprobs)]
    for fork in handoff.siblings:   # the forks' first tokens
        chunks.append(Chunk([fork.token], [fork.logprob], fork.finish is not None, fork.finish, handoff.prompt_len,
                            handoff.cached_tokens, index=fork.index, top_logprobs=[list(fork.top)],
                            all_finished=handoff.finished and fork.index == last))
    return chunks


def prefill_budget_s(prompt_tokens: int, token_timeout_s: float, s_per_1k_tokens: float) -> float:
    """How long the first token may take: the inter-token timeout plus a share per prompt token."""
    return token_timeout_s + prompt_tokens / 1000 * s_per_1k_tokens


async def no_hint(_prompt: list[int]) -> RouteHint:
    return RouteHint()


class Dispatcher:
    def __init__(self, mode: str, pools: dict, metrics: Metrics, token_timeout_s: float, max_retries: int,
                 prefix_hint: Callable[[list[int]], Awaitable[RouteHint]] | None = None, prefill_s_per_1k_tokens: float = 0.0,
                 load_hint: Callable[[], RouteHint] | None = None, direct_max_tokens: int = 0,
                 direct_queue: int = 0, block_tokens: Callable[[], int] = lambda: 0):
        self.mode, self.pools, self.metrics = mode, pools, metrics
        self.direct_max_tokens, self.direct_queue = direct_max_tokens, direct_queue
        self.block_tokens = block_tokens      # the prefix hint's block size (0: unknown, nothing counts cached)
        self.token_timeout_s, self.max_retries = token_timeout_s, max_retries
        self.prefill_s_per_1k_tokens = prefill_s_per_1k_tokens
        self.prefix_hint = prefix_hint or no_hint       # async: it must never block the ingress's loop
        self.load_hint = load_hint or RouteHint     # decode: the ranks' loads pushed since the prefix hint
        self.in_flight = {name: 0 for name in pools}
        self._background: set[asyncio.Task] = set()   # releases and decode calls a request that ended left behind

    async def stream(self, req: GenRequest) -> AsyncIterator[Chunk]:
        sent: list[int] = []
        for attempt in range(self.max_retries + 1):
            again = continuation(req, sent)
            if attempt and not sent:    # a fresh id: the failed attempt's cache may still be held under the old
                again = replace(again, request_id=f"{req.request_id}-a{attempt}")
            attempt_chunks = self._attempt(again)
            try:
                async for chunk in attempt_chunks:
                    sent += chunk.token_ids
                    yield replace(chunk, prompt_tokens=len(req.prompt),
                                  cached_tokens=min(chunk.cached_tokens, len(req.prompt)))
                return
            except RETRYABLE as e:
                log.warning("request %s attempt %d failed after %d tokens: %s", req.request_id, attempt + 1,
                            len(sent), e)
                # n > 1 forks cannot resume as one continuation once tokens were sent
                if attempt == self.max_retries or (sent and req.params.n > 1):
                    raise WorkerFailed(f"the worker serving this request failed ({type(e).__name__}) and "
                                       f"{self.max_retries} retries did not complete it") from e
                self.metrics.retries.inc()
            finally:        # closed at a yield (the client left): the attempt frees what it holds now
                await attempt_chunks.aclose()

    async def _attempt(self, req: GenRequest) -> AsyncIterator[Chunk]:
        hint = await self.prefix_hint(req.prompt)
        budget = prefill_budget_s(len(req.prompt), self.token_timeout_s, self.prefill_s_per_1k_tokens)
        if self.mode == "colocated":
            async for chunk in self._stream("colocated", detached(lambda: self.pools["colocated"].options(
                                                stream=True).generate.remote(req, hint=hint)), budget):
                yield chunk
            return
        route = self._prefill_route(req.prompt, hint)
        self.metrics.prefill_route.labels(route).inc()
        if route != "prefill_pool":     # the whole request on a decode replica: no handoff
            async for chunk in self._stream("decode", detached(lambda: self.pools["decode"].options(
                    stream=True).generate.remote(req, hint=decode_hint(hint, self.load_hint()))), budget):
                yield chunk
            return
        with self._counted("prefill"):
            handoff = await self._first(detached(lambda: self.pools["prefill"].prefill.remote(req, hint=hint)), budget)
        if handoff.worker is not None:
            self.metrics.workers.update(handoff.worker)
        firsts = first_chunks(handoff)
        if handoff.finished:
            for chunk in firsts:
                yield chunk
            return
        # the cache is held on the prefill worker until decode reads it (a Ray offer holds nothing there)
        holds = handoff.offer is not None and getattr(handoff.offer, "transport", None) == "nixl"
        decode = chunks = None
        try:
            # n > 1 cannot resume as a continuation once tokens were sent: its first tokens wait for
            # decode's first chunk, so a decode that fails before it leaves the request retryable.
            held = firsts if req.params.n > 1 else []
            for chunk in firsts if not held else []:
                yield chunk
            decode = detached(lambda: self.pools["decode"].options(stream=True).decode.remote(
                req, handoff, hint=decode_hint(hint, self.load_hint())))
            chunks = self._stream("decode", decode, settle_first=holds)
            async for chunk in chunks:
                for first in held:
                    yield first
                held = []
                if chunk.transfer is not None:
                    self.metrics.transfer(chunk.transfer)
                yield chunk
        finally:
            if chunks is not None:      # left at a yield: decode's call is settled now, not when collected
                await chunks.aclose()
            elif holds:     # ended before decode was called: no one else can read or free the cache
                self._release_held(handoff)

    def _prefill_route(self, prompt: list[int], hint: RouteHint) -> str:
        """prefill_pool, decode_short or decode_queue (the module docstring)."""
        if self.direct_max_tokens and len(prompt) - self._cached_on_decode(hint) <= self.direct_max_tokens:
            return "decode_short"
        if self.direct_queue and self.in_flight["prefill"] >= self.direct_queue:
            return "decode_queue"
        return "prefill_pool"

    def _cached_on_decode(self, hint: RouteHint) -> int:
        """Prompt tokens the decode replica best placed for it holds, per the hint (0 without one)."""
        block, handle = self.block_tokens(), self.pools["decode"]
        ids = live_replica_ids(handle.app_name, handle.deployment_name) if block and hint.prefix_blocks else None
        if not ids:
            return 0
        return block * max((n for where, n in hint.prefix_blocks.items() if where.split("/")[0] in ids), default=0)

    async def _first(self, response, budget_s: float):
        try:
            return await asyncio.wait_for(response, budget_s)
        except asyncio.TimeoutError:
            self._give_up_prefill(response)
            raise WorkerStalled(f"no first token within {budget_s:.0f}s (the prefill budget)") from None
        except asyncio.CancelledError:      # the client left while the prompt ran or waited for a replica
            self._give_up_prefill(response)
            raise

    def _give_up_prefill(self, response) -> None:
        """Cancel a prefill call (queued: it never runs; running: it frees what it held) and free
        the cache it holds if it answered all the same."""
        response.cancel()
        self._background_task(self._release_answered(response))

    async def _release_answered(self, response) -> None:
        try:
            handoff = await asyncio.wait_for(response, self.token_timeout_s)
        except Exception as e:      # cancelled (what it held is freed there), failed, or still silent
            log.debug("a prefill call given up ended with %s", type(e).__name__)
            return
        if isinstance(handoff, Handoff) and not handoff.finished and getattr(handoff.offer, "transport", None) == "nixl":
            self._release_held(handoff)

    def _release_held(self, handoff: Handoff) -> None:
        """Ask the prefill worker holding `handoff`'s cache to free it now (in the background)."""
        self._background_task(self._release(handoff.request_id, handoff.worker_id))

    async def _release(self, request_id: str, worker_id: str) -> None:
        log.debug("request %s ended before decode read its cache: prefill worker %s frees it", request_id, worker_id)
        try:
            await asyncio.wait_for(detached(lambda: self.pools["prefill"].release.remote(
                request_id, hint=RouteHint(require_worker=worker_id))), self.token_timeout_s)
        except Exception as e:
            log.warning("request %s: prefill worker %s did not free its cache (%s: %s); its release timeout "
                        "will", request_id, worker_id, type(e).__name__, e)

    async def _settle(self, gen, pending: asyncio.Future) -> None:
        """A decode call left before its first chunk (the client went away): it owns the handoff,
        so it runs until that chunk (its load is done then: the READ's notification frees
        prefill's copy, or decode gave the cache back) and is cancelled there. Cancelled sooner,
        a call that already started could still be reading what prefill would free; one still
        queued would never run, and nothing would free the cache before the timeout."""
        try:
            await asyncio.wait_for(pending, self.token_timeout_s)
        except (Exception, asyncio.CancelledError) as e:    # ended, failed or stalled: it gave back what it had not read
            log.debug("a decode call left before its first chunk ended with %s", type(e).__name__)
        finally:
            gen.cancel()

    def _background_task(self, coro) -> None:
        """Run `coro` on its own, detached from the request being served (which may be ending)."""
        task = detached(lambda: asyncio.get_running_loop().create_task(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stream(self, pool: str, gen, first_budget_s: float | None = None,
                      settle_first: bool = False) -> AsyncIterator[Chunk]:
        """`first_budget_s`: the wait for the first chunk (it includes the prefill when the
        pool runs the prompt too); token_timeout_s for every later one. Left early (the client
        left, a stop string matched, the worker failed) the call is cancelled, except that with
        `settle_first` (decode holding a handoff) one left before its first chunk is `_settle`d."""
        with self._counted(pool):
            done = got = stalled = False
            pending = None      # gen's next chunk, awaited in a task of its own: a cancel here leaves it running
            timeout = first_budget_s or self.token_timeout_s
            try:
                while True:
                    pending = asyncio.ensure_future(gen.__anext__())
                    ready, _ = await asyncio.wait((pending,), timeout=timeout)
                    if not ready:
                        stalled = True
                        raise WorkerStalled(f"{pool}: no token within {timeout:.0f}s")
                    try:
                        chunk = pending.result()
                    except StopAsyncIteration:
                        done = True
                        return
                    got, timeout = True, self.token_timeout_s
                    for c in chunk if isinstance(chunk, list) else [chunk]:   # n > 1: a step's chunks
                        if c.worker is not None:
                            self.metrics.workers.update(c.worker)
                        yield c
            finally:
                if not done:
                    if settle_first and not got and not stalled and pending is not None and not pending.done():
                        self._background_task(self._settle(gen, pending))
                    else:
                        if pending is not None:
                            pending.cancel()
                        gen.cancel()

    @contextmanager
    def _counted(self, pool: str):
        self.in_flight[pool] += 1
        self.metrics.queue_depth.labels(pool).set(self.in_flight[pool])
        try:
            yield
        finally:
            self.in_flight[pool] -= 1
            self.metrics.queue_depth.labels(pool).set(self.in_flight[pool])
