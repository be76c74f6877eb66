"""The OpenAI-compatible front end: a FastAPI app served by one Serve deployment.

    POST /v1/completions   POST /v1/chat/completions   GET /v1/models[/{id}]   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   GET /version       (all but /health need the API key when one is set)

The ingress tokenizes, validates (every 4xx is decided here or by the engine's
InvalidRequestError, before any byte of a stream is sent), looks up the prefix index
for the prefill router, and turns the pool's chunks into OpenAI bodies or SSE events.
"""

import asyncio
import dataclasses
import logging
import uuid
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from workers.checkpoint.default_model import ensure_default_model
from workers.checkpoint.tokenizer import load_tokenizer
from workers.sampling.grammar import check_schema_size
from workers.sampling.params import InvalidRequestError

from cluster.errors import APIError, WorkerFailed, bad_request, model_not_found, overloaded
from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    package_version,
    parse_body,
)
from cluster.openai.auth import ApiKeys
from cluster.config import ServeConfig
from cluster.serve.dispatch import RETRYABLE, Dispatcher
from cluster.chat.dsv4_grammar import after_reasoning
from cluster.openai.limits import read_body
from cluster.serve.locator import PrefixLocator
from cluster.messages import GenRequest
from cluster.serve.metrics import Metrics, RequestTimer, scrape_pools
from cluster.openai.responses import Reply, ReplyFormat, sse
from cluster.chat.template import chat_prompt_ids

log = logging.getLogger(__name__)
DEFAULT_RETRY_AFTER_S = 1     # outside a request's handler the config's ingress.retry_after_s is not at hand
# FastAPI's own /docs, /redoc and /openapi.json would answer without the API key: served below, behind it.
api = FastAPI(title="kvmesh", description="OpenAI-compatible completions on a prefill/decode cluster",
              docs_url=None, redoc_url=None, openapi_url=None)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(APIError)
async def _api_error(_request: Request, err: APIError):
    return _error_response(err)


@api.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, err: RequestValidationError):
    return _error_response(bad_request(str(err.errors()[0].get("msg", err))))


@api.exception_handler(HTTPException)
async def _http_error(_request: Request, err: HTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(err.status_code, str(err.detail), type=kind))


def to_api_error(e: BaseException, retry_after_s: int) -> APIError:
    """Any failure of a request -> the status and body the client gets."""
    cause = getattr(e, "cause", None) or e          # RayTaskError carries the worker's exception
    if isinstance(e, APIError):
        return e
    if isinstance(cause, InvalidRequestError):
        return bad_request(str(cause).split("\n")[0], cause.field)
    if isinstance(cause, BackPressureError):
        return overloaded(retry_after_s)
    if isinstance(cause, WorkerFailed) or isinstance(e, RETRYABLE) or isinstance(cause, RETRYABLE):
        return APIError(503, str(cause).split("\n")[0], type="service_unavailable", code="worker_failed",
                        headers={"Retry-After": str(retry_after_s)})
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(cause).__name__}: {cause}", type="internal_error")


@api.exception_handler(Exception)
async def _unhandled(_request: Request, err: Exception):
    """Whatever a route did not turn into an APIError still gets the JSON body (a dead worker
    a 503 with Retry-After), never Starlette's plain-text 500."""
    return _error_response(to_api_error(err, DEFAULT_RETRY_AFTER_S))


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


class _Events:
    """One accepted request: its remaining chunks as a whole body or as SSE."""

    def __init__(self, ingress, endpoint: str, body, resp: Reply, first, chunks, timer: RequestTimer):
        self.ingress, self.endpoint, self.body, self.resp = ingress, endpoint, body, resp
        self.first, self.chunks, self.timer = first, chunks, timer

    async def _deltas(self):
        try:
            yield await self._feed(*self.first)
            if not self.resp.done:
                async for prompt, chunk in self.chunks:
                    yield await self._feed(prompt, chunk)
                    if self.resp.done:
                        break
        finally:
            await self.chunks.aclose()
            self.timer.done(sum(len(p) for p in self.resp.prompts))
            self.ingress.metrics.cached_tokens.inc(self.resp.cached_tokens)

    async def _feed(self, prompt: int, chunk):
        self.timer.tokens(len(chunk.token_ids))
        if self.body.stop_strings:      # stop-string matching runs off the event loop
            return await asyncio.to_thread(self.resp.feed, prompt, chunk)
        return self.resp.feed(prompt, chunk)

    async def whole(self):
        try:
            async for _ in self._deltas():
                pass
        except Exception as e:
            return _error_response(to_api_error(e, self.ingress.config.ingress.retry_after_s))
        b = self.body
        if self.endpoint == "completions":
            return self.resp.completion(b.logprobs, b.return_token_ids)
        return self.resp.chat(b.logprobs, b.top_n, b.return_token_ids)

    async def sse(self):
        b, r, chat = self.body, self.resp, self.endpoint == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield sse(r.chat_opening(b.return_token_ids))
        offsets: dict[int, int] = {}
        try:
            async for choice, delta in self._deltas():
                detail = delta.token_ids and (b.return_token_ids or b.logprobs is not None and b.logprobs is not False)
                first = choice.index not in offsets
                if not (delta.text or delta.reasoning or delta.calls or detail or choice.done or (first and choice.echo)):
                    continue
                if chat:
                    event = r.chat_chunk(choice, delta, b.logprobs, b.top_n, b.return_token_ids)
                else:
                    event = r.completion_chunk(choice, delta, offsets.get(choice.index, 0), b.logprobs,
                                               b.return_token_ids, first)
                if b.continuous_usage:
                    event["usage"] = r.usage()
                yield sse(event)
                offsets[choice.index] = offsets.get(choice.index, 0) + len(event["choices"][0].get("text", ""))
            if b.include_usage:
                yield sse(r.usage_chunk(obj))
        except Exception as e:
            yield sse(to_api_error(e, self.ingress.config.ingress.retry_after_s).body())
        yield sse("[DONE]")


def stop_ids(tokenizer, body) -> frozenset[int]:
    """The ids that end a sequence of this request (as the engine's stop check has them)."""
    return frozenset(body.stop_token_ids) | (frozenset() if body.ignore_eos else frozenset(tokenizer.stop_token_ids))


def reply_format(tokenizer, endpoint: str, body) -> ReplyFormat | None:
    """Chat replies in V4's format are parsed into reasoning, content and tool calls."""
    if endpoint != "chat" or tokenizer.chat_format != "dsv4":
        return None
    return ReplyFormat(body.thinking_mode, bool(body.offered_tools), body.parallel_tool_calls)


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, config: ServeConfig, pools: dict):
        self.config = config
        model_dir = Path(config.engine.model) if config.engine.model else ensure_default_model()
        self.model_name = config.ingress.model_name or model_dir.name
        self.tokenizer = load_tokenizer(model_dir)
        self.keys = ApiKeys(config.ingress.api_keys)
        self.metrics = Metrics()
        self.pools = pools
        self.locator = PrefixLocator(config.engine.index)
        self.dispatch = Dispatcher(config.mode, pools, self.metrics, config.ingress.token_timeout_s,
                                   config.ingress.max_retries, self.locator.hint,
                                   config.ingress.prefill_s_per_1k_tokens)
        self.metrics.workers.attach(self._worker_stats)
        self.limits: dict | None = None

    async def _limits(self) -> dict:
        """max_model_len / vocab of the workers (asked once; every pool runs the same engine settings)."""
        if self.limits is None:
            names = ["colocated"] if self.config.mode == "colocated" else ["prefill", "decode"]
            infos = [await self.pools[n].info.remote() for n in names]
            self.limits = {"max_model_len": min(i["max_model_len"] for i in infos),
                           "vocab_size": infos[0]["vocab_size"],
                           "max_schema_bytes": min(i["max_schema_bytes"] for i in infos)}
            self.locator.configure(infos[0].get("fingerprint"), infos[0]["block_tokens"],
                                   infos[0].get("index_namespace"))
        return self.limits

    async def _worker_stats(self) -> list:
        """Every replica's live counters, read now (a scrape of each replica of each pool)."""
        return await scrape_pools(self.pools)

    def _auth(self, request: Request) -> None:
        self.keys.check(request.url.path.removeprefix(request.scope.get("root_path", "")) or "/",
                        request.headers.get("authorization"))

    # ---- endpoints ----------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok", "mode": self.config.mode}

    def _model_card(self, limits: dict) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "root": self.model_name, "parent": None, "max_model_len": limits["max_model_len"]}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list", "data": [self._model_card(await self._limits())]}

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        self._auth(request)
        if model_id not in (self.model_name, self.config.engine.model):
            raise model_not_found(model_id, self.model_name)
        return self._model_card(await self._limits())

    @api.get("/version")
    async def version(self, request: Request):
        self._auth(request)
        return {"version": package_version()}

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        self._auth(request)
        body = parse_body(await read_body(request, self.config.ingress.max_body_bytes), TokenizeRequest)
        ids = self._tokenize_body(body)
        return {"tokens": ids, "count": len(ids), "max_model_len": (await self._limits())["max_model_len"]}

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        self._auth(request)
        body = parse_body(await read_body(request, self.config.ingress.max_body_bytes), DetokenizeRequest)
        vocab = (await self._limits())["vocab_size"]
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        self._auth(request)
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        self._auth(request)     # with API keys, the page's own fetch of /openapi.json needs one too
        return get_swagger_ui_html(openapi_url=request.scope.get("root_path", "") + "/openapi.json",
                                   title="kvmesh API")

    @api.get("/metrics")
    async def metrics(self, request: Request):
        self._auth(request)
        return Response(await self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request)
        return await self._serve("completions", await read_body(request, self.config.ingress.max_body_bytes))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._auth(request)
        return await self._serve("chat", await read_body(request, self.config.ingress.max_body_bytes))

    # ---- the common path ----------------------------------------------------------------------
    def _tokenize_body(self, body) -> list[int]:
        if body.prompt is not None:
            return self.tokenizer.encode(body.prompt)
        return self._chat_ids(body.as_chat())

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """Chat messages in the checkpoint's format (its template, V4's own, or the plain one) -> ids."""
        return chat_prompt_ids(self.tokenizer, body)

    def _prompt(self, endpoint: str, raw: bytes):
        """-> (request body, token ids of each prompt, max_tokens, logprobs wanted)."""
        if endpoint == "completions":
            body = parse_body(raw, CompletionRequest)
            ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
            return body, ids, body.max_tokens, body.logprobs is not None
        body = parse_body(raw, ChatCompletionRequest)
        ids = self._chat_ids(body)
        return body, [ids], body.token_limit, body.logprobs

    async def _serve(self, endpoint: str, raw: bytes):
        timer = RequestTimer(self.metrics)
        try:
            body, prompts, max_tokens, logprobs = self._prompt(endpoint, raw)
            if body.model not in (None, self.model_name, self.config.engine.model):
                raise model_not_found(body.model, self.model_name)
            prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
            rid = f"{prefix}-{uuid.uuid4().hex}"
            echo = getattr(body, "echo", False)
            reqs = [await self._request(endpoint, body, ids, max_tokens, logprobs, f"{rid}-{i}", echo)
                    for i, ids in enumerate(prompts)]
            resp = Reply(rid, self.model_name, self.tokenizer, body.stop_strings, prompts,
                         body.num_sequences, keep=body.n,
                         echo=[self.tokenizer.decode(p) for p in prompts] if echo else None,
                         stop_ids=stop_ids(self.tokenizer, body), fmt=reply_format(self.tokenizer, endpoint, body))
            chunks = merge([self.dispatch.stream(r) for r in reqs])
            first = await chunks.__anext__()      # errors before the first token are still a status code
        except Exception as e:
            err = to_api_error(e, self.config.ingress.retry_after_s)
            self.metrics.request(endpoint, err.status)
            return _error_response(err)
        self.metrics.request(endpoint, 200)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        events = _Events(self, endpoint, body, resp, first, chunks, timer)
        if body.stream:
            return StreamingResponse(events.sse(), media_type="text/event-stream")
        return await events.whole()

    async def _request(self, endpoint: str, body, ids: list[int], max_tokens: int | None,
                       logprobs: bool, request_id: str, echo: bool = False) -> GenRequest:
        limits = await self._limits()
        if not ids:
            raise bad_request("the prompt is empty", "prompt" if endpoint == "completions" else "messages")
        bad = [t for t in ids if not 0 <= t < limits["vocab_size"]]
        if bad:
            raise bad_request(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {limits['vocab_size']})",
                              "prompt")
        outside = sorted(int(k) for k in body.logit_bias or {} if int(k) >= limits["vocab_size"])
        if outside:
            raise bad_request(f"logit_bias: token ids {outside[:5]} are outside the vocabulary "
                              f"[0, {limits['vocab_size']})", "logit_bias")
        room = limits["max_model_len"] - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                              f"model's context of {limits['max_model_len']} tokens", "max_tokens")
        try:
            params = body.sampling_params(max_tokens or room, logprobs)
            fmt = reply_format(self.tokenizer, endpoint, body)
            if params.guide:        # refused here, before any worker sees it
                check_schema_size(params.guide[1], limits["max_schema_bytes"],
                                  "tools" if params.guide[0] == "ebnf" else "response_format")
            if fmt and fmt.mode == "thinking" and params.guide and params.guide[0] != "ebnf":
                params = dataclasses.replace(params, guide=after_reasoning(params.guide))
            if echo and body.logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
            params.validate()
        except InvalidRequestError as e:
            raise bad_request(str(e), e.field) from None
        return GenRequest(request_id, ids, params)
