"""`kvmesh serve`: the app on its own local Ray (or on an existing cluster when asked),
the URL and an example request.

    kvmesh serve                               # a new local Ray, private to this command
    kvmesh serve --address HEAD_IP:6379        # attach to a running cluster (or $RAY_ADDRESS)
    kvmesh serve --model DIR --tensor-parallel-size 2 --kv-cache-dtype fp8 --decode-max-num-seqs 128

`vllm serve`'s flags for what a config would say (cluster/cli/serve_flags.py): --tensor-parallel-size,
--enable-expert-parallel, --kv-cache-dtype, --max-model-len, --max-num-seqs, --served-model-name,
with --prefill-* / --decode-* forms where the pools differ; one that disagrees with the config
file is an error naming both.

A local run never attaches to a Ray cluster started earlier on the machine
(`ray.init(address="local")`). Attaching uses Ray's token authentication when a token is
available here (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`, the file
`ray get-auth-token --generate` writes), unless `RAY_AUTH_MODE` says otherwise.

A local Ray is private to this command, so none of its listeners is for another machine: it runs in
Ray's single-machine mode (`LOCAL_RAY_ENV`: node IP 127.0.0.1, so the GCS, raylet, object manager,
workers, dashboard and agents listen on loopback) and NIXL's UCX uses the loopback device only;
`--host` decides the HTTP port alone. Serve's proxy does not serve its `/-/routes` (proxy_guard.py).
A variable already set in the environment is left as it is. docs/security.md lists every port.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from kvmesh.cluster.cli.serve_flags import add_vllm_flags

DEFAULT_PORT = 8000
LOCAL_MIN_CPUS = 4   # logical CPUs for a local Ray, so the default pools fit a small laptop
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# Set before `import ray` (Ray reads the first at import) and inherited by every process of the local Ray.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # Ray's one-machine mode: the node's IP is 127.0.0.1
    "UCX_NET_DEVICES": "lo",                    # NIXL (UCX) listens on loopback only
}


class PortInUseError(OSError):
    """The HTTP port is taken by another process."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI API on a local Ray (or an existing cluster)")
    p.add_argument("--config", help="kvmesh config YAML (or a Serve config like deploy/serve.yaml)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], help="override the config's mode")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` (repeat for several keys; also $KVMESH_API_KEY, "
                        "comma-separated)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="attach to this Ray cluster (HOST:PORT or auto) instead of starting a local one "
                        "(default: $RAY_ADDRESS)")
    p.add_argument("--planner", choices=["ray", "planner", "dry-run"],
                   help="who sizes the pools (planner.policy): ray (each pool's own autoscaling, the default), "
                        "planner (one policy sizes them together from the TTFT / ITL targets), dry-run (it "
                        "decides and logs, nothing moves); the pools need autoscaling bounds")
    p.add_argument("--slo-ttft-ms", type=float, help="the planner's time-to-first-token target (planner.slo_ttft_ms)")
    p.add_argument("--slo-itl-ms", type=float, help="the planner's inter-token latency target (planner.slo_itl_ms)")
    add_vllm_flags(p)
    p.set_defaults(handler=cmd_serve)


def example_request(url: str, model: str, auth: bool = False) -> str:
    body = json.dumps({"model": model, "prompt": "The king said to his servants,", "max_tokens": 32, "temperature": 0})
    key = " -H \"Authorization: Bearer $KVMESH_API_KEY\"" if auth else ""
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json'{key} -d '{body}'"


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError when (host, port) cannot be bound."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(f"port {port} on {host} is in use ({e.strerror}); pick another with --port") from e


def token_available(env: dict[str, str] | None = None) -> bool:
    """A Ray auth token is at hand: in the environment, at RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN"):
        return True
    path = Path(env["RAY_AUTH_TOKEN_PATH"]) if env.get("RAY_AUTH_TOKEN_PATH") else Path.home() / ".ray" / "auth_token"
    return path.is_file() and path.stat().st_size > 0


def use_token_auth_if_available() -> None:
    """Ray enables token auth only for clusters it finds by itself; an explicit address needs
    RAY_AUTH_MODE=token, set here (before Ray reads it) when a token exists and no mode is set."""
    if AUTH_MODE_ENV not in os.environ and token_available():
        os.environ[AUTH_MODE_ENV] = "token"


def ray_env(address: str | None) -> dict[str, str]:
    """The environment `kvmesh serve` gives the Ray it starts (none for one it attaches to: that
    cluster's processes are started already): the proxy guard, and loopback for a local Ray."""
    from kvmesh.cluster.openai.proxy_guard import RAY_ENV
    return {} if address else {**RAY_ENV, **LOCAL_RAY_ENV}


def set_ray_env(address: str | None, environ=os.environ) -> None:
    """Put ray_env() into this process's environment, before Ray is imported; what is set stays."""
    if not address and "ray" in sys.modules:      # not from the `kvmesh` command: a caller imported Ray first
        print("kvmesh serve: Ray was imported before its environment was set: the local Ray may listen "
              "beyond loopback", file=sys.stderr, flush=True)
    for name, value in ray_env(address).items():
        environ.setdefault(name, value)


def start_ray(address: str | None) -> None:
    import ray
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=max(LOCAL_MIN_CPUS, os.cpu_count() or 1))


def serve_config(args: argparse.Namespace, keys: list[str] | None = None):
    """The ServeConfig `kvmesh serve` runs: the config file (or the defaults), then the flags.
    ConfigFileError (ServeFlagError) where they do not validate, disagree, or give a parallel size
    that does not split the model (checked here, before Ray starts)."""
    from kvmesh.cluster.config import ConfigFileError, check_parallel_sizes, load_config, read_config_file
    from kvmesh.cluster.cli.serve_flags import flag_overrides
    data = read_config_file(args.config)
    overrides = {k: v for k, v in {"engine.model": args.model, "mode": args.mode,
                                   "ingress.api_keys": keys or None, "planner.policy": args.planner,
                                   "planner.slo_ttft_ms": args.slo_ttft_ms,
                                   "planner.slo_itl_ms": args.slo_itl_ms}.items() if v is not None}
    overrides.update(flag_overrides(args, data, args.config or "the defaults"))
    config = load_config(args.config, overrides, data=data)
    check_parallel_sizes(config)
    if not args.address:
        check_one_node(config)
    if config.planner.policy != "ray":
        from kvmesh.cluster.serve.autoscale import profile_of
        try:
            profile_of(config)
        except ValueError as e:
            raise ConfigFileError(str(e)) from None
    return config


def check_one_node(config) -> None:
    """A local Ray is one node: a pool whose replica spans several (data_parallel_size_local) could
    never be placed there, so it fails here rather than waiting for nodes that never come."""
    from kvmesh.cluster.config import ConfigFileError
    pools = ["colocated"] if config.mode == "colocated" else ["prefill", "decode"]
    for name in pools:
        pool = getattr(config, name)
        if pool.nodes > 1:
            raise ConfigFileError(
                f"{name}.data_parallel_size_local {pool.data_parallel_size_local} places each replica over "
                f"{pool.nodes} nodes, and a local Ray is one node: attach to a cluster with --address (or set "
                f"data_parallel_size_local to data_parallel_size {pool.data_parallel_size})")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvmesh.cluster.openai.auth import keys_from_env
    from kvmesh.cluster.config import ConfigFileError
    keys = (args.api_key or []) + keys_from_env()
    try:
        config = serve_config(args, keys)
        if not args.address:       # attached, the HTTP proxy runs on the cluster's head, not here
            check_port_free(args.host, args.port)
    except (ConfigFileError, PortInUseError) as e:
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return 2
    if args.address:
        use_token_auth_if_available()
    set_ray_env(args.address)
    import httpx
    import ray
    from ray import serve

    from kvmesh.cluster.app import deploy
    start_ray(args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    deploy(config)
    print(f"kvmesh serve: on Ray at {ray.get_runtime_context().gcs_address}"
          f"{' (attached)' if args.address else ' (a new local cluster)'}", flush=True)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    if keys and httpx.get(f"{url}/-/routes", timeout=60).status_code == 200:
        print("kvmesh serve: warning: Serve's proxy answers /-/routes without the API key; start Ray with "
              "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=kvmesh.cluster.openai.proxy_guard.middlewares "
              "(docs/security.md)", file=sys.stderr, flush=True)
    print(f"kvmesh is serving {model} ({config.mode}) at {url}/v1\n\nTry:\n  {example_request(url, model, bool(keys))}\n"
          f"\nMetrics: {url}/metrics   Stop: Ctrl-C", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    print("kvmesh serve: shutting down", flush=True)
    if args.address:
        serve.delete("kvmesh")     # the cluster and its Serve instance stay up for others
    else:
        serve.shutdown()
    ray.shutdown()
    return 0
