"""A local Ray + Serve with kvmesh apps on it, for tests and benchmarks.

    with LocalServe(num_cpus=4) as ls:
        url = ls.deploy("disagg", small_config("disaggregated"), "/")
        httpx.post(f"{url}/v1/completions", json={...})
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Any

from kvmesh.cluster.config import ServeConfig

# replicas small enough that both pools, a colocated pool and two ingresses fit two cores
SMALL_POOL = {"num_cpus": 0.25, "max_ongoing_requests": 16, "max_queued_requests": 64}


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Ray's default worker ports are 10002-19999; above them, below the kernel's ephemeral range.
_PORTS = range(20000, min(_ephemeral_range()[0], 32768))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 outside the kernel's ephemeral range.

    A port taken from the ephemeral range (bind to 0) can be handed, before the server that
    was meant to bind it starts, to one of the many outgoing loopback connections Ray opens;
    the server then fails with EADDRINUSE for as long as that connection lives (CI saw a
    Serve proxy fail to bind that way)."""
    for port in random.sample(_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def small_config(mode: str = "disaggregated", **overrides: Any) -> ServeConfig:
    """The tiny default model on a small KV budget, memory-only store, one schema compiler
    process per engine (each imports xgrammar and torch), tiny replicas."""
    data: dict[str, Any] = {
        "mode": mode,
        "engine": {"kv_cache_bytes": 16 << 20, "max_num_seqs": 8, "max_batched_tokens": 512, "store": None,
                   "grammar_compile_workers": 1},
        "prefill": dict(SMALL_POOL), "decode": dict(SMALL_POOL), "colocated": dict(SMALL_POOL),
        "ingress": {"num_cpus": 0.1, "token_timeout_s": 30.0},
        "handoff": {"release_timeout_s": 10.0},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return ServeConfig.model_validate(data)


# Session-wide apps on the defaults that several modules only send requests to (none kills or
# reconfigures them): name -> (mode, route prefix). `deploy_many(..., shared=("colocated",))`
# starts one with the module's own apps the first time and reuses it after; `delete_all` keeps it.
SHARED_APPS = {"colocated": ("colocated", "/colocated")}


class LocalServe:
    def __init__(self, num_cpus: float = 4, port: int | None = None, address: str | None = None):
        self.num_cpus, self.port, self.address = num_cpus, port or free_port(), address
        self.kept: set[str] = set()     # the SHARED_APPS deployed on this Serve

    def __enter__(self) -> "LocalServe":
        import ray
        from ray import serve
        if self.address:
            ray.init(address=self.address)
        else:
            ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def deploy(self, name: str, config: ServeConfig, route_prefix: str = "/") -> str:
        """Deploy (or redeploy) an app; returns its base URL (append /v1/...)."""
        return self.deploy_many({name: (config, route_prefix)})[name]

    def deploy_many(self, apps: dict[str, tuple[ServeConfig, str]], shared: tuple[str, ...] = ()) -> dict[str, str]:
        """Deploy apps side by side, {name: (config, route prefix)}, and wait until all of
        them run (their replicas start together); {name: base URL}, the `shared` apps'
        (SHARED_APPS names) included: deployed here unless one is already running."""
        from ray import serve

        from kvmesh.cluster.app import build_app, deploy_planned
        running = serve.status().applications
        apps = dict(apps)
        for name in shared:
            mode, prefix = SHARED_APPS[name]
            if name not in self.kept or name not in running or running[name].status != "RUNNING":
                apps[name] = (small_config(mode), prefix)
            self.kept.add(name)
        planned = {n: a for n, a in apps.items() if a[0].planner.policy != "ray"}   # Serve's config path
        if len(apps) > len(planned):
            serve.run_many([serve.RunTarget(build_app(config), name=name, route_prefix=prefix)
                            for name, (config, prefix) in apps.items() if name not in planned])
        if planned:
            deploy_planned(planned)
        urls = {name: self.base + prefix.rstrip("/") for name, (_, prefix) in apps.items()}
        return {**urls, **{name: self.base + SHARED_APPS[name][1].rstrip("/") for name in shared}}

    def delete_all(self, within_s: float = 60.0, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Delete every app on this Serve but `keep` (running SHARED_APPS, which hold no rank
        actors or placement groups), all at once, and wait until they, their replicas, rank
        actors and placement groups are gone: a test module sharing the session's Serve leaves
        nothing of its own behind."""
        import time

        import ray
        from ray import serve
        from ray.util.placement_group import placement_group_table
        for name in serve.status().applications:
            if name not in keep:
                serve.delete(name, _blocking=False)
        kept = tuple(f"SERVE_REPLICA::{name}#" for name in keep)
        deadline = time.monotonic() + within_s
        while True:
            left = [name for name in serve.status().applications if name not in keep]
            left += [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith(("SERVE_REPLICA::", "kvmesh-rank:")) and not a["name"].startswith(kept)]
            left += [f"placement group {g['placement_group_id']}" for g in placement_group_table().values()
                     if g["state"] != "REMOVED"]
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"still there {within_s:.0f} s after the apps were deleted: {left}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve
        serve.shutdown()
        ray.shutdown()


async def drop_after_first_token(port: int, body: dict, path: str = "/v1/completions",
                                 timeout_s: float = 300) -> bool:
    """POST `body` (a streamed request) over a raw connection and drop it (a hard close, as a
    client that goes away) once an event carrying a token arrives; whether one did before the
    stream ended."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + data)
        await writer.drain()
        while line := await asyncio.wait_for(reader.readline(), timeout_s):
            if line.startswith(b"data: {") and any(c.get("token_ids") for c in json.loads(line[6:])["choices"]):
                return True
        return False
    finally:
        writer.transport.abort()
