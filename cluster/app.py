"""`build_app`: the Serve application for a ServeConfig.

    serve run deploy/serve.yaml          (import_path: kvmesh.cluster.app:build_app, args: the config)
    serve.run(build_app(config))         (tests, `kvmesh serve`)

disaggregated:  Ingress ─▶ Prefill (own autoscaling)  ─▶ Decode (own autoscaling)
colocated:      Ingress ─▶ Colocated
Every pool routes with `kvmesh.cluster.serve.routing.KVAwareRouter`.
"""
from __future__ import annotations

from typing import Any

from pydantic import SecretStr
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvmesh.cluster.openai.auth import keys_from_env
from kvmesh.cluster.config import HEAD_IP, PoolConfig, ServeConfig, check_parallel_sizes
from kvmesh.cluster.openai.ingress import INGRESS, Ingress
from kvmesh.cluster.serve.pools import Colocated, Decode, Prefill
from kvmesh.cluster.serve.routing import KVAwareRouter

ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0


def _router(name: str) -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=KVAwareRouter, request_router_kwargs={"deployment": name},
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)


def _pool(cls: type, pool: PoolConfig, name: str):
    router = _router(name)
    return serve.deployment(cls).options(**pool.deployment_options(name), request_router_config=router,
                                         health_check_period_s=HEALTH_CHECK_PERIOD_S,
                                         graceful_shutdown_timeout_s=5)


def ray_head_ip() -> str:
    """The head node's IP, from the GCS address of the Ray cluster this runs in."""
    import ray
    if not ray.is_initialized():
        raise RuntimeError(f"the config uses {HEAD_IP}: build the app inside a running Ray cluster")
    return ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]


def build_app(args: dict[str, Any] | ServeConfig | None = None) -> serve.Application:
    config = args if isinstance(args, ServeConfig) else ServeConfig.model_validate(args or {})
    check_parallel_sizes(config)
    env_keys = keys_from_env()
    if env_keys and not config.ingress.api_keys:   # `serve run deploy/serve.yaml` with KVMESH_API_KEY set
        config = config.model_copy(update={"ingress": config.ingress.model_copy(update={"api_keys": [SecretStr(k) for k in env_keys]})})
    if HEAD_IP in config.engine.index:
        config = config.with_head_ip(ray_head_ip())
    if config.mode == "colocated":
        pools = {"colocated": _pool(Colocated, config.colocated, "Colocated").bind(config)}
    else:
        prefill = _pool(Prefill, config.prefill, "Prefill").bind(config)
        pools = {"prefill": prefill, "decode": _pool(Decode, config.decode, "Decode").bind(config, prefill)}
    ing = config.ingress
    # the ingress's own router too: /metrics sums every ingress replica's counters (metrics.py)
    return Ingress.options(num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
                           request_router_config=_router(INGRESS), ray_actor_options={"num_cpus": ing.num_cpus, "resources": dict(ing.resources)}).bind(config, pools)
