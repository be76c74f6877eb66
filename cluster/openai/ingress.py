"""The OpenAI-compatible front end: a FastAPI app served by one Serve deployment.

    POST /v1/completions   POST /v1/chat/completions   GET /v1/models[/{id}]   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   GET /version       (all but /health need the API key when one is set)

Each route is a thin call into its serving object (serving_completion.py, serving_chat.py,
serving_tokenize.py); they tokenize, validate (every 4xx is decided there or by the engine's
InvalidRequestError, before any byte of a stream is sent), dispatch, and turn the pool's chunks
into OpenAI bodies or SSE events. The API key is one dependency on the whole app (auth.py).
"""

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException

from kvmesh.workers.checkpoint.default_model import ensure_default_model
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.errors import APIError, bad_request
from kvmesh.cluster.openai.auth import ApiKeys, client_of, require_api_key
from kvmesh.cluster.openai.limits import WorkerLimits, read_body
from kvmesh.cluster.openai.protocol import package_version
from kvmesh.cluster.openai.serving import PREPARE_THREADS, ServedModel, ServingContext, error_response, to_api_error
from kvmesh.cluster.openai.serving_chat import ServingChat
from kvmesh.cluster.openai.serving_completion import ServingCompletion
from kvmesh.cluster.openai.serving_tokenize import ServingTokenize
from kvmesh.cluster.serve import replica_logs
from kvmesh.cluster.serve.dispatch import Dispatcher
from kvmesh.cluster.serve.locator import PrefixLocator
from kvmesh.cluster.serve.metrics import SCRAPE_TIMEOUT_S, Metrics, each_replica, pool_replica_states, scrape_pools

log = logging.getLogger(__name__)
DEFAULT_RETRY_AFTER_S = 1     # outside a request's handler the config's ingress.retry_after_s is not at hand


def _replica_keys() -> ApiKeys:
    """The keys of the Ingress this replica runs (Serve builds one per replica, after the app)."""
    return serve.get_replica_context().servable_object.keys


# FastAPI's own /docs, /redoc and /openapi.json would answer without the API key: served below, behind it.
api = FastAPI(title="kvmesh", description="OpenAI-compatible completions on a prefill/decode cluster",
              docs_url=None, redoc_url=None, openapi_url=None, dependencies=[require_api_key(_replica_keys)])


@api.exception_handler(APIError)
async def _api_error(_request: Request, err: APIError):
    return error_response(err)


@api.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, err: RequestValidationError):
    return error_response(bad_request(str(err.errors()[0].get("msg", err))))


@api.exception_handler(HTTPException)
async def _http_error(_request: Request, err: HTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return error_response(APIError(err.status_code, str(err.detail), type=kind))


@api.exception_handler(Exception)
async def _unhandled(_request: Request, err: Exception):
    """Whatever a route did not turn into an APIError still gets the JSON body (a dead worker
    a 503 with Retry-After), never Starlette's plain-text 500."""
    return error_response(to_api_error(err, DEFAULT_RETRY_AFTER_S))


INGRESS = "Ingress"       # the deployment's name (app.py gives it a KVAwareRouter under it)


@serve.deployment(name=INGRESS)
@serve.ingress(api)
class Ingress:
    def __init__(self, config: ServeConfig, pools: dict):
        replica_logs.install()      # a refusal is one WARNING line, a cancel no error
        self.config = config
        model_dir = Path(config.engine.model) if config.engine.model else ensure_default_model()
        self.keys = ApiKeys(config.ingress.api_keys)
        self.pools = pools
        metrics = Metrics()
        locator = PrefixLocator(config.engine.index)
        metrics.routing.attach(locator)
        dispatch = Dispatcher(config.mode, pools, metrics, config.ingress.token_timeout_s,
                              config.ingress.max_retries, locator.hint_async, config.ingress.prefill_s_per_1k_tokens,
                              locator.load_hint, config.ingress.decode_prefill_max_tokens,
                              config.ingress.decode_prefill_queue,
                              lambda: locator.hasher.block_tokens if locator.hasher else 0)
        self.ctx = ServingContext(
            model=ServedModel(config.ingress.model_name or model_dir.name, config.engine.model),
            tokenizer=load_tokenizer(model_dir), limits=WorkerLimits(config.mode, pools, locator),
            dispatch=dispatch, metrics=metrics, retry_after_s=config.ingress.retry_after_s,
            special_in_content=config.ingress.allow_special_tokens_in_content,
            prepare=ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare"))
        self.serving_completion = ServingCompletion(self.ctx)
        self.serving_chat = ServingChat(self.ctx)
        self.serving_tokenize = ServingTokenize(self.ctx)
        metrics.workers.attach(self._worker_stats)
        self._peers = None          # a handle to this deployment, made on the first scrape

    async def _worker_stats(self) -> list:
        """Every replica's live counters, read now (a scrape of each replica of each pool)."""
        return await scrape_pools(self.pools)

    async def _pool_replicas(self) -> dict:
        """Each pool's replicas by state (metrics.pool_replica_states), or nothing if Serve's
        controller does not answer within the scrape's budget."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(pool_replica_states, self.pools), SCRAPE_TIMEOUT_S)
        except Exception as e:
            log.debug("metrics: no replica states from Serve's controller: %r", e)
            return {}

    async def _planner(self) -> dict | None:
        """The P/D planner's last decision (published by Serve's controller in Ray's internal KV), or
        None when this app has no planner (or the KV does not answer within the scrape's budget)."""
        if self.config.planner.policy == "ray":
            return None
        from kvmesh.cluster.serve.autoscale import planner_key

        def read():
            from ray.experimental.internal_kv import _internal_kv_get
            raw = _internal_kv_get(planner_key(serve.get_replica_context().app_name))
            return json.loads(raw) if raw else None
        try:
            return await asyncio.wait_for(asyncio.to_thread(read), SCRAPE_TIMEOUT_S)
        except Exception as e:
            log.debug("metrics: no planner snapshot: %r", e)
            return None

    async def _ingress_families(self) -> dict:
        """Every ingress replica's own series (this one's included), by replica id."""
        if self._peers is None:
            context = serve.get_replica_context()
            self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        # its own series read here, the others' asked for: a call to itself through Serve's router
        # missed a scrape's budget on a loaded node (a fresh-clone run's log)
        me, families = await self.metric_families()
        answers = await each_replica(self._peers, "metric_families", lambda answer: answer[0], skip=me)
        return {me: families, **{rid: fams for rid, (_, fams) in answers.items()}}

    async def metric_families(self, hint=None) -> tuple[str, list]:
        """(this replica's id, its own series): called by the replica a scrape landed on, `hint`
        pinning the call; the id shows the pin held."""
        return serve.get_replica_context().replica_id.unique_id, self.ctx.metrics.families()

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.ingress.max_body_bytes)

    # ---- generation and tokens ------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.serving_completion.serve(await self._body(request), client_of(request, self.keys.enabled))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.serving_chat.serve(await self._body(request), client_of(request, self.keys.enabled))

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self.serving_tokenize.tokenize(await self._body(request))

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self.serving_tokenize.detokenize(await self._body(request))

    # ---- the model, the service ----------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok", "mode": self.config.mode}

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self.ctx.model.card((await self.ctx.limits.get()).max_model_len)]}

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        self.ctx.model.check(model_id)
        return self.ctx.model.card((await self.ctx.limits.get()).max_model_len)

    @api.get("/version")
    async def version(self):
        return {"version": package_version()}

    @api.get("/metrics")
    async def metrics(self):
        return Response(await self.ctx.metrics.exposition(self._ingress_families, self._pool_replicas, self._planner), media_type=CONTENT_TYPE_LATEST)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        # behind the key like every route: with API keys, the page's own fetch of /openapi.json needs one too
        return get_swagger_ui_html(openapi_url=request.scope.get("root_path", "") + "/openapi.json",
                                   title="kvmesh API")
