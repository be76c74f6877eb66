"""`kvmesh serve`: a local Ray, the app on this machine, the URL and an example request."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

DEFAULT_PORT = 8000
LOCAL_MIN_CPUS = 4   # logical CPUs for a local Ray, so the default pools fit a small laptop


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI API on a local Ray (or an existing cluster)")
    p.add_argument("--config", help="kvmesh config YAML (or a Serve config like deploy/serve.yaml)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], help="override the config's mode")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="join this Ray cluster instead of starting a local one (default: $RAY_ADDRESS)")
    p.set_defaults(handler=cmd_serve)


def example_request(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "Hello, kvmesh", "max_tokens": 16, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import ConfigFileError, load_config
    overrides = {k: v for k, v in {"engine.model": args.model, "mode": args.mode}.items() if v is not None}
    try:
        config = load_config(args.config, overrides)
    except ConfigFileError as e:
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return 2
    import httpx
    import ray
    from ray import serve

    from .app import build_app
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=max(LOCAL_MIN_CPUS, os.cpu_count() or 1))
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(config), name="kvmesh", route_prefix="/")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    print(f"kvmesh is serving {model} ({config.mode}) at {url}/v1\n\nTry:\n  {example_request(url, model)}\n"
          f"\nMetrics: {url}/metrics   Stop: Ctrl-C", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    print("kvmesh serve: shutting down", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
