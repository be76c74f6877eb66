"""The OpenAI-compatible front end: a FastAPI app served by one Serve deployment.

    POST /v1/completions   POST /v1/chat/completions   GET /v1/models   GET /health   GET /metrics

The ingress tokenizes, validates (every 4xx is decided here or by the engine's
InvalidRequestError, before any byte of a stream is sent), looks up the prefix index
for the prefill router, and turns the pool's chunks into OpenAI bodies or SSE events.
"""

import logging
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from workers.default_model import ensure_default_model
from workers.sampling import InvalidRequestError
from workers.tokenizer import load_tokenizer

from .api import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, model_not_found, overloaded,
                  parse_body)
from .config import ServeConfig
from .dispatch import Dispatcher, WorkerFailed
from .locator import PrefixLocator
from .messages import GenRequest
from .metrics import Metrics, RequestTimer
from .responses import Generation, sse
from .text import render_chat

log = logging.getLogger(__name__)
api = FastAPI(title="kvmesh", description="OpenAI-compatible completions on a prefill/decode cluster")


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
        return bad_request(str(cause).split("\n")[0], str(cause).split(":")[0] if ":" in str(cause) else None)
    if isinstance(cause, BackPressureError):
        return overloaded(retry_after_s)
    if isinstance(cause, WorkerFailed):
        return APIError(503, str(cause), type="service_unavailable", code="worker_failed",
                        headers={"Retry-After": str(retry_after_s)})
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(cause).__name__}: {cause}", type="internal_error")


class _Events:
    """One accepted request: its remaining chunks as a whole body or as SSE."""

    def __init__(self, ingress, endpoint: str, body, gen: Generation, first, chunks, timer: RequestTimer):
        self.ingress, self.endpoint, self.body, self.gen = ingress, endpoint, body, gen
        self.first, self.chunks, self.timer = first, chunks, timer

    async def _deltas(self):
        try:
            yield self._feed(self.first)
            if not self.gen.done:
                async for chunk in self.chunks:
                    yield self._feed(chunk)
                    if self.gen.done:
                        break
        finally:
            await self.chunks.aclose()
            self.timer.done()
            self.ingress.metrics.cached_tokens.inc(self.gen.cached_tokens)

    def _feed(self, chunk):
        self.timer.tokens(len(chunk.token_ids))
        return self.gen.feed(chunk)

    async def whole(self):
        try:
            async for _ in self._deltas():
                pass
        except Exception as e:
            return _error_response(to_api_error(e, self.ingress.config.ingress.retry_after_s))
        b = self.body
        if self.endpoint == "completions":
            return self.gen.completion(b.logprobs is not None, b.return_token_ids)
        return self.gen.chat(b.logprobs, b.top_logprobs or 0, b.return_token_ids)

    async def sse(self):
        b, g, chat = self.body, self.gen, self.endpoint == "chat"
        if chat:
            yield sse(g.chat_chunk(None, False, 0, b.return_token_ids))
        offset, first = 0, True
        try:
            async for delta in self._deltas():
                detail = delta.token_ids and (b.return_token_ids or b.logprobs)
                if not (delta.text or detail or g.done):
                    continue
                if chat:
                    yield sse(g.chat_chunk(delta, b.logprobs, b.top_logprobs or 0, b.return_token_ids))
                else:
                    yield sse(g.completion_chunk(delta, offset, b.logprobs is not None, b.return_token_ids, first))
                offset, first = offset + len(delta.text), False
            if b.include_usage:
                yield sse(g.usage_chunk("chat.completion.chunk" if chat else "text_completion"))
        except Exception as e:
            yield sse(to_api_error(e, self.ingress.config.ingress.retry_after_s).body())
        yield sse("[DONE]")


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, config: ServeConfig, pools: dict):
        self.config = config
        model_dir = Path(config.engine.model) if config.engine.model else ensure_default_model()
        self.model_name = config.ingress.model_name or model_dir.name
        self.tokenizer = load_tokenizer(model_dir)
        self.metrics = Metrics()
        self.pools = pools
        self.locator = PrefixLocator(config.engine.index)
        self.dispatch = Dispatcher(config.mode, pools, self.metrics, config.ingress.token_timeout_s,
                                   config.ingress.max_retries, self.locator.hint)
        self.limits: dict | None = None

    async def _limits(self) -> dict:
        """max_model_len / vocab of the workers (asked once; every pool runs the same engine settings)."""
        if self.limits is None:
            names = ["colocated"] if self.config.mode == "colocated" else ["prefill", "decode"]
            infos = [await self.pools[n].info.remote() for n in names]
            self.limits = {"max_model_len": min(i["max_model_len"] for i in infos),
                           "vocab_size": infos[0]["vocab_size"]}
            self.locator.configure(infos[0].get("fingerprint"), infos[0]["block_tokens"])
        return self.limits

    # ---- endpoints ----------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok", "mode": self.config.mode}

    @api.get("/v1/models")
    async def models(self):
        limits = await self._limits()
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvmesh", "max_model_len": limits["max_model_len"]}]}

    @api.get("/metrics")
    async def metrics(self):
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve("completions", await request.body())

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve("chat", await request.body())

    # ---- the common path ----------------------------------------------------------------------
    def _prompt(self, endpoint: str, raw: bytes):
        """-> (request body, prompt token ids, max_tokens, logprobs wanted)."""
        if endpoint == "completions":
            body = parse_body(raw, CompletionRequest)
            ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
            return body, ids, body.max_tokens, body.logprobs is not None
        body = parse_body(raw, ChatCompletionRequest)
        try:
            text = render_chat(self.tokenizer.chat_template, [(m.role, m.text) for m in body.messages],
                               body.add_generation_prompt,
                               **{**self.tokenizer.special_tokens, **(body.chat_template_kwargs or {})})
        except Exception as e:  # a template's raise_exception, or a broken template
            raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
        encode = self.tokenizer.encode_rendered if self.tokenizer.chat_template else self.tokenizer.encode
        return body, encode(text), body.token_limit, body.logprobs

    async def _serve(self, endpoint: str, raw: bytes):
        timer = RequestTimer(self.metrics)
        try:
            body, ids, max_tokens, logprobs = self._prompt(endpoint, raw)
            if body.model not in (None, self.model_name, self.config.engine.model):
                raise model_not_found(body.model, self.model_name)
            req = await self._request(endpoint, body, ids, max_tokens, logprobs)
            gen = Generation(req.request_id, self.model_name, self.tokenizer, body.stop_strings, req.prompt)
            chunks = self.dispatch.stream(req)
            first = await chunks.__anext__()      # errors before the first token are still a status code
        except Exception as e:
            err = to_api_error(e, self.config.ingress.retry_after_s)
            self.metrics.request(endpoint, err.status)
            return _error_response(err)
        self.metrics.request(endpoint, 200)
        self.metrics.prompt_tokens.inc(len(ids))
        events = _Events(self, endpoint, body, gen, first, chunks, timer)
        if body.stream:
            return StreamingResponse(events.sse(), media_type="text/event-stream")
        return await events.whole()

    async def _request(self, endpoint: str, body, ids: list[int], max_tokens: int | None,
                       logprobs: bool) -> GenRequest:
        limits = await self._limits()
        if not ids:
            raise bad_request("the prompt is empty", "prompt" if endpoint == "completions" else "messages")
        bad = [t for t in ids if not 0 <= t < limits["vocab_size"]]
        if bad:
            raise bad_request(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {limits['vocab_size']})",
                              "prompt")
        room = limits["max_model_len"] - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                              f"model's context of {limits['max_model_len']} tokens", "max_tokens")
        try:
            params = body.sampling_params(max_tokens or room, logprobs).validate()
        except InvalidRequestError as e:
            raise bad_request(str(e), str(e).split(":")[0]) from None
        prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
        return GenRequest(f"{prefix}-{uuid.uuid4().hex}", ids, params)
