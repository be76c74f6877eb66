"""`build_app`: the Serve application for a ServeConfig.

    serve run deploy/serve.yaml          (import_path: kvmesh.cluster.app:build_app, args: the config)
    deploy(config)                       (tests, `kvmesh serve`: serve.run, or with the planner Serve's
                                          config path, which adds the app's autoscaling policy)

disaggregated:  Ingress ─▶ Prefill (own autoscaling, or the planner's)  ─▶ Decode (the same)
colocated:      Ingress ─▶ Colocated
Every pool routes with `kvmesh.cluster.serve.routing.KVAwareRouter`.
"""
from __future__ import annotations

import os
from typing import Any

from pydantic import SecretStr
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvmesh.cluster.openai.auth import keys_from_env
from kvmesh.cluster.config import HEAD_IP, ConfigFileError, PoolConfig, ServeConfig, check_parallel_sizes
from kvmesh.cluster.openai.ingress import INGRESS, Ingress
from kvmesh.cluster.serve.pools import Colocated, Decode, Prefill
from kvmesh.cluster.serve.routing import KVAwareRouter

ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0


def _router(name: str) -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=KVAwareRouter, request_router_kwargs={"deployment": name},
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)


PLANNED_ENV = "KVMESH_PLANNER_APP"       # set by deploy_planned in the app's runtime environment


def _pool(cls: type, pool: PoolConfig, name: str, planned: bool = False):
    """`planned`: the app's planner (cluster/serve/autoscale.py) sizes the pool within its autoscaling
    bounds and keeps its own hysteresis, so Serve applies its decisions at once."""
    router = _router(name)
    opts = pool.deployment_options(name)
    if planned:
        opts["autoscaling_config"] = {**opts["autoscaling_config"], "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
    return serve.deployment(cls).options(**opts, request_router_config=router,
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
    planned = config.planner.policy != "ray"
    if planned and not os.environ.get(PLANNED_ENV):
        raise ConfigFileError(
            f"planner.policy {config.planner.policy!r} needs the app's autoscaling policy, which `serve run` "
            "does not add: start it with `kvmesh serve --config FILE` (it deploys the app with the policy), or "
            "set planner.policy: ray")
    if config.mode == "colocated":
        pools = {"colocated": _pool(Colocated, config.colocated, "Colocated", planned).bind(config)}
    else:
        prefill = _pool(Prefill, config.prefill, "Prefill", planned).bind(config)
        pools = {"prefill": prefill, "decode": _pool(Decode, config.decode, "Decode", planned).bind(config, prefill)}
    ing = config.ingress
    # the ingress's own router too: /metrics sums every ingress replica's counters (metrics.py)
    return Ingress.options(num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
                           request_router_config=_router(INGRESS), ray_actor_options={"num_cpus": ing.num_cpus, "resources": dict(ing.resources)}).bind(config, pools)


def deploy(config: ServeConfig, name: str = "kvmesh", route_prefix: str = "/", timeout_s: float = 600.0) -> None:
    """Run the app on the started Serve, and wait until it runs (a planner app: `deploy_planned`)."""
    if config.planner.policy == "ray":
        serve.run(build_app(config), name=name, route_prefix=route_prefix)
    else:
        deploy_planned({name: (config, route_prefix)}, timeout_s)


def deploy_planned(apps: dict[str, tuple[ServeConfig, str]], timeout_s: float = 600.0) -> None:
    """Run apps whose pools the planner sizes (planner.policy "planner" or "dry-run"), {name: (config,
    route prefix)}, and wait until they run. They go through Serve's config path, the one that takes an
    application-level autoscaling policy (cluster/serve/autoscale.py): Serve's controller builds each from
    `build_app`'s import path and its config (API keys cross as $KVMESH_API_KEY in the app's runtime
    environment, never in its arguments). Serve keeps one set of config-deployed apps: this set replaces
    the last one (apps run with `serve.run` stay)."""
    import time

    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from kvmesh.cluster.serve.autoscale import policy_spec
    specs = []
    for name, (config, route_prefix) in apps.items():
        keys = [k.get_secret_value() for k in config.ingress.api_keys]
        args = config.model_dump(mode="json")
        if keys:
            args["ingress"] = {k: v for k, v in args.get("ingress", {}).items() if k != "api_keys"}
        spec = {"name": name, "route_prefix": route_prefix, "import_path": "kvmesh.cluster.app:build_app",
                "args": args, "autoscaling_policy": policy_spec(config, name)}
        env = {PLANNED_ENV: name, **({"KVMESH_API_KEY": ",".join(keys)} if keys else {})}
        spec["runtime_env"] = {"env_vars": env}
        specs.append(spec)
    _get_global_client().deploy_apps(ServeDeploySchema(applications=specs))
    deadline = time.monotonic() + timeout_s
    waiting = set(apps)
    while waiting:
        statuses = serve.status().applications
        for name in list(waiting):
            status = statuses.get(name)
            if status is not None and status.status == "RUNNING":
                waiting.discard(name)
            elif status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"app {name!r} failed to deploy: {status.message}")
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"apps {sorted(waiting)} not running after {timeout_s:g} s")
        if waiting:
            time.sleep(0.5)
