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
from kvmesh.cluster.serve.routing import decode_hint
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
    return GenRequest(f"{req.request_id}-r{len(sent)}", req.prompt + sent, params)


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
                 load_hint: Callable[[], RouteHint] | None = None):
        self.mode, self.pools, self.metrics = mode, pools, metrics
        self.token_timeout_s, self.max_retries = token_timeout_s, max_retries
        self.prefill_s_per_1k_tokens = prefill_s_per_1k_tokens
        self.prefix_hint = prefix_hint or no_hint       # async: it must never block the ingress's loop
        self.load_hint = load_hint or RouteHint     # decode: the ranks' loads pushed since the prefix hint
        self.in_flight = {name: 0 for name in pools}

    async def stream(self, req: GenRequest) -> AsyncIterator[Chunk]:
        sent: list[int] = []
        for attempt in range(self.max_retries + 1):
            again = continuation(req, sent)
            if attempt and not sent:    # a fresh id: the failed attempt's cache may still be held under the old
                again = replace(again, request_id=f"{req.request_id}-a{attempt}")
            try:
                async for chunk in self._attempt(again):
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

    async def _attempt(self, req: GenRequest) -> AsyncIterator[Chunk]:
        hint = await self.prefix_hint(req.prompt)
        budget = prefill_budget_s(len(req.prompt), self.token_timeout_s, self.prefill_s_per_1k_tokens)
        if self.mode == "colocated":
            async for chunk in self._stream("colocated", self.pools["colocated"].options(stream=True)
                                            .generate.remote(req, hint=hint), budget):
                yield chunk
            return
        with self._counted("prefill"):
            handoff = await self._first(self.pools["prefill"].prefill.remote(req, hint=hint), budget)
        if handoff.worker is not None:
            self.metrics.workers.update(handoff.worker)
        firsts = first_chunks(handoff)
        if handoff.finished:
            for chunk in firsts:
                yield chunk
            return
        # n > 1 cannot resume as a continuation once tokens were sent: its first tokens wait for
        # decode's first chunk, so a decode that fails before it leaves the request retryable.
        held = firsts if req.params.n > 1 else []
        for chunk in firsts if not held else []:
            yield chunk
        async for chunk in self._stream("decode", self.pools["decode"].options(stream=True)
                                        .decode.remote(req, handoff, hint=decode_hint(hint, self.load_hint()))):
            for first in held:
                yield first
            held = []
            if chunk.transfer is not None:
                self.metrics.transfer(chunk.transfer)
            yield chunk

    async def _first(self, response, budget_s: float):
        try:
            return await asyncio.wait_for(response, budget_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise WorkerStalled(f"no first token within {budget_s:.0f}s (the prefill budget)") from None

    async def _stream(self, pool: str, gen, first_budget_s: float | None = None) -> AsyncIterator[Chunk]:
        """`first_budget_s`: the wait for the first chunk (it includes the prefill when the
        pool runs the prompt too); token_timeout_s for every later one."""
        with self._counted(pool):
            done = False
            timeout = first_budget_s or self.token_timeout_s
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(gen.__anext__(), timeout)
                    except StopAsyncIteration:
                        done = True
                        return
                    except asyncio.TimeoutError:
                        raise WorkerStalled(f"{pool}: no token within {timeout:.0f}s") from None
                    timeout = self.token_timeout_s
                    for c in chunk if isinstance(chunk, list) else [chunk]:   # n > 1: a step's chunks
                        if c.worker is not None:
                            self.metrics.workers.update(c.worker)
                        yield c
            finally:
                if not done:        # the client left, a stop string matched, or the worker failed
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
