"""The request path every generating endpoint shares (vLLM's serving_engine, SGLang's serving base):

    raw body ─parse─▶ body ─prompts()─▶ Prompts ─gen_request()─▶ a GenRequest per prompt
             ─dispatch─▶ chunks ─Reply.feed─▶ choices ─render() / render_opening() + render_chunk()─▶
             one JSON body, or SSE events then `data: [DONE]`

`OpenAIServing.serve` runs it for every endpoint; a subclass (serving_completion.py,
serving_chat.py) says what its body is, how it becomes prompts and how a Reply is rendered.
Parsing, rendering, tokenizing and checking a body (up to the GenRequests) run on the context's
prepare threads, never on the event loop: a 1 MB chat body takes seconds to tokenize, and every
other request of the replica would wait that long.
Every 4xx is decided before the first chunk is in, so it is a status code; a failure after it
is the status of a whole body, or the last event of a stream.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Callable, NamedTuple, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse
from ray.serve.exceptions import BackPressureError

from kvmesh.workers.checkpoint.tokenizer import Tokenizer
from kvmesh.workers.sampling.params import InvalidRequestError

from kvmesh.cluster.errors import (APIError, TooManyRequests, WorkerFailed, bad_request, model_not_found,
                                   overloaded, rate_limited)
from kvmesh.cluster.messages import Chunk, GenRequest
from kvmesh.cluster.openai.limits import Limits, WorkerLimits
from kvmesh.cluster.openai.protocol import parse_body
from kvmesh.cluster.openai.responses import Choice, Delta, Reply, sse
from kvmesh.cluster.openai.validate import Body, Prompts, gen_request
from kvmesh.cluster.serve.dispatch import RETRYABLE, Dispatcher
from kvmesh.cluster.serve.metrics import Metrics, RequestTimer
from kvmesh.cluster.serve.replica_logs import is_cancel

log = logging.getLogger(__name__)
PREPARE_THREADS = 4      # bodies prepared at once per ingress replica; more wait their turn
CLIENT_CLOSED = 499      # the status of a request whose client went away (nginx's; in the access log only)
T = TypeVar("T")


def to_api_error(e: BaseException, retry_after_s: int) -> APIError:
    """Any failure of a request -> the status and body the client gets."""
    cause = getattr(e, "cause", None) or e          # RayTaskError carries the worker's exception
    if isinstance(e, APIError):
        return e
    if isinstance(cause, InvalidRequestError):
        return bad_request(str(cause).split("\n")[0], cause.field)
    if isinstance(cause, TooManyRequests):
        return rate_limited(cause)
    if isinstance(cause, BackPressureError):
        return overloaded(retry_after_s)
    if isinstance(cause, WorkerFailed) or isinstance(e, RETRYABLE) or isinstance(cause, RETRYABLE):
        return APIError(503, str(cause).split("\n")[0], type="service_unavailable", code="worker_failed",
                        headers={"Retry-After": str(retry_after_s)})
    if is_cancel(e):        # the client went away (Serve cancelled its request): no error, nobody reads this
        log.debug("request cancelled (%s): the client went away", type(cause).__name__)
        return APIError(CLIENT_CLOSED, "the client closed the request", type="client_closed", code="client_closed")
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(cause).__name__}: {cause}", type="internal_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ServedModel(NamedTuple):
    """The one model served: `name` (ingress.model_name, or the checkpoint folder's name) and
    `path` (engine.model as configured, None for the default model); a request may use either."""
    name: str
    path: str | None

    def check(self, requested: str | None) -> None:
        """404 model_not_found unless `requested` names this model (None names it)."""
        if requested not in (None, self.name, self.path):
            raise model_not_found(requested, self.name)

    def card(self, max_model_len: int) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "root": self.name, "parent": None, "max_model_len": max_model_len}


@dataclass(frozen=True)
class ServingContext:
    """What the endpoints share, built once per ingress replica."""
    model: ServedModel
    tokenizer: Tokenizer
    limits: WorkerLimits
    dispatch: Dispatcher
    metrics: Metrics
    retry_after_s: int             # the Retry-After of a 503 (overloaded, worker failed)
    special_in_content: bool       # ingress.allow_special_tokens_in_content
    prepare: ThreadPoolExecutor    # PREPARE_THREADS threads: the work on a body that is not I/O

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a prepare thread; the event loop serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare, fn, *args)


def stop_ids(tokenizer: Tokenizer, body: Body) -> frozenset[int]:
    """The ids that end a sequence of this request (as the engine's stop check has them)."""
    return frozenset(body.stop_token_ids) | (frozenset() if body.ignore_eos else frozenset(tokenizer.stop_token_ids))


class OpenAIServing(ABC):
    """One generating endpoint. `serve(raw)` is a whole request; a subclass sets the class
    attributes and the methods marked abstract, and keeps no state of its own per request."""
    endpoint: str                  # the `endpoint` label of the request metrics
    id_prefix: str                 # a reply's id is `{id_prefix}-{hex}`
    chunk_object: str              # the `object` of a streamed usage chunk
    request_model: type[Body]

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    @abstractmethod
    def prompts(self, body: Body) -> Prompts:
        """The body's prompts as token ids, and what holds for all of them; raises a 400 APIError."""

    @abstractmethod
    def render(self, reply: Reply, body: Body) -> dict:
        """The response body, once every choice is done."""

    def render_opening(self, reply: Reply, body: Body) -> list[dict]:
        """The events a stream starts with, before any token (none unless overridden)."""
        return []

    @abstractmethod
    def render_chunk(self, reply: Reply, body: Body, choice: Choice, delta: Delta, offset: int, first: bool) -> dict:
        """The SSE event for `delta` of `choice`; `offset`: characters of its text sent so far;
        `first`: nothing of this choice was sent yet."""

    async def serve(self, raw: bytes, client: str = "") -> JSONResponse | StreamingResponse | dict:
        """The response to one request body from `client` (auth.client_of): a JSON body, an SSE
        stream, or an error's status and OpenAI body. Counts the request (by endpoint and status)
        and, once accepted, its prompt tokens."""
        timer = RequestTimer(self.ctx.metrics)
        try:
            gen = await self._start(raw, timer, client)
        except Exception as e:
            err = to_api_error(e, self.ctx.retry_after_s)
            self.ctx.metrics.request(self.endpoint, err.status)
            return error_response(err)
        self.ctx.metrics.request(self.endpoint, 200)
        self.ctx.metrics.prompt_tokens.inc(gen.prompt_tokens)
        if gen.body.stream:
            return StreamingResponse(gen.sse(), media_type="text/event-stream")
        return await gen.whole()

    async def _start(self, raw: bytes, timer: RequestTimer, client: str) -> Generation:
        """Prepare (off the loop) and dispatch; returns once the first chunk is in (an error
        before the first token is still a status code)."""
        body, prompts = await self.ctx.off_loop(self._parse, raw)
        reply, reqs = await self.ctx.off_loop(self._requests, body, prompts, await self.ctx.limits.get(), client)
        chunks = merge([self.ctx.dispatch.stream(r) for r in reqs])
        first = await chunks.__anext__()
        return Generation(self, body, reply, first, chunks, timer)

    def _parse(self, raw: bytes) -> tuple[Body, Prompts]:
        """The body and its prompts as token ids, or a 400 (a 404 for another model)."""
        body = parse_body(raw, self.request_model)
        prompts = self.prompts(body)
        self.ctx.model.check(body.model)
        return body, prompts

    def _requests(self, body: Body, prompts: Prompts, limits: Limits, client: str) -> tuple[Reply, list[GenRequest]]:
        """The Reply and a GenRequest per prompt, checked against the workers' limits (or a 400)."""
        rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        reqs = [gen_request(body, prompts, ids, f"{rid}-{i}", limits, client) for i, ids in enumerate(prompts.ids)]
        tok = self.ctx.tokenizer
        reply = Reply(rid, self.ctx.model.name, tok, body.stop_strings, prompts.ids, body.num_sequences,
                      keep=body.n, echo=[tok.decode(p) for p in prompts.ids] if prompts.echo else None,
                      stop_ids=stop_ids(tok, body), fmt=prompts.fmt)
        return reply, reqs


class Generation:
    """One accepted request: the rest of its chunks folded into `reply`, as one body or as SSE.
    Either way the chunk stream is closed (cancelling the workers' calls) and the timer stopped
    when it ends, also when the client goes away midway."""

    def __init__(self, serving: OpenAIServing, body: Body, reply: Reply, first: tuple[int, Chunk],
                 chunks: AsyncGenerator[tuple[int, Chunk], None], timer: RequestTimer):
        self.serving, self.body, self.reply = serving, body, reply
        self.first, self.chunks, self.timer = first, chunks, timer

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.reply.prompts)

    async def _deltas(self) -> AsyncIterator[tuple[Choice, Delta]]:
        try:
            yield await self._feed(*self.first)
            if not self.reply.done:
                async for prompt, chunk in self.chunks:
                    yield await self._feed(prompt, chunk)
                    if self.reply.done:
                        break
        finally:
            await self.chunks.aclose()
            self.timer.done(self.prompt_tokens)
            self.serving.ctx.metrics.cached_tokens.inc(self.reply.cached_tokens)

    async def _feed(self, prompt: int, chunk: Chunk) -> tuple[Choice, Delta]:
        self.timer.tokens(len(chunk.token_ids))
        if self.body.stop_strings:      # stop-string matching runs off the event loop
            return await asyncio.to_thread(self.reply.feed, prompt, chunk)
        return self.reply.feed(prompt, chunk)

    async def whole(self) -> JSONResponse | dict:
        """The response body, or the error's status and body if the generation fails."""
        try:
            async for _ in self._deltas():
                pass
        except Exception as e:
            return error_response(to_api_error(e, self.serving.ctx.retry_after_s))
        return self.serving.render(self.reply, self.body)

    async def sse(self) -> AsyncIterator[str]:
        """The endpoint's opening events, an event per delta worth sending, usage if asked for,
        an error event if the generation fails midway, then `[DONE]`."""
        b, r, serving = self.body, self.reply, self.serving
        for event in serving.render_opening(r, b):
            yield sse(event)
        offsets: dict[int, int] = {}
        try:
            async for choice, delta in self._deltas():
                first = choice.index not in offsets
                if not self._worth_sending(choice, delta, first):
                    continue
                event = serving.render_chunk(r, b, choice, delta, offsets.get(choice.index, 0), first)
                if b.continuous_usage:
                    event["usage"] = r.usage()
                yield sse(event)
                offsets[choice.index] = offsets.get(choice.index, 0) + len(event["choices"][0].get("text", ""))
            if b.include_usage:
                yield sse(r.usage_chunk(serving.chunk_object))
        except Exception as e:
            yield sse(to_api_error(e, serving.ctx.retry_after_s).body())
        yield sse("[DONE]")

    def _worth_sending(self, choice: Choice, delta: Delta, first: bool) -> bool:
        """Text, reasoning, tool calls, token detail asked for, the choice's end, or its echo."""
        b = self.body
        detail = delta.token_ids and (b.return_token_ids or b.logprobs is not None and b.logprobs is not False)
        return bool(delta.text or delta.reasoning or delta.calls or detail or choice.done or (first and choice.echo))


async def merge(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(i, chunk) from several chunk streams as they arrive (a batch of prompts)."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:                 # closing this closes the dispatch stream now (cancels the worker call)
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
