"""`kvmesh serve` on a machine where another Ray cluster is already running (started here
by `ray start`, with Ray's token authentication): by default it serves on a new local Ray
of its own and leaves the other cluster alone; `--address` attaches to the other one,
authenticating with the token it finds; a port in use is a one-line error."""
from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.cluster.cli import main
from kvmesh.cluster.cli.serve import ray_env
from tests.local_serve import free_port, small_config
from tests.integration.test_serve_fake_cluster import stop_cluster

pytestmark = pytest.mark.slow     # `ray start` and `kvmesh serve` subprocesses

ROOT = Path(__file__).resolve().parents[2]
SERVE_WITHIN_S = 300.0
RAY_BIN = str(Path(sys.executable).parent / "ray")
KVMESH_BIN = str(Path(sys.executable).parent / "kvmesh")


@pytest.fixture(scope="module")
def other_ray():
    """A Ray cluster started by `ray start` with token auth: (address, token file)."""
    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")      # short: raylet socket paths have a limit
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32))
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    try:
        subprocess.run([RAY_BIN, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
                        "--include-dashboard=false", f"--ray-client-server-port={free_port()}"],
                       env=env, check=True, capture_output=True, timeout=120)
        yield f"127.0.0.1:{port}", token
    finally:
        stop_cluster([temp_dir, f":{port}"])
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve-cli") / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(small_config("colocated").model_dump(mode="json")))
    return path


SERVE_ACTORS = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
print("ACTORS " + json.dumps(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))))
"""


def named_actors(address: str, token: Path) -> list[str]:
    """Named actors of the other cluster, seen by a separate client (token auth)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SERVE_ACTORS, address], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = [l for l in out.stdout.splitlines() if l.startswith("ACTORS ")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("ACTORS "):])


class ServeProcess:
    """`kvmesh serve` as a subprocess; its output lines are collected as they come."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen([KVMESH_BIN, "serve", *args], env=env, cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"`kvmesh serve` never printed {text!r}:\n" + "".join(self.lines)[-4000:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def serve_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def gcs_port(address: str) -> str:
    return ":" + address.rsplit(":", 1)[1]


def complete(port: int) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"prompt": "Hello, kvmesh", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def listening(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of `pid` and its descendants
    (a local Ray's GCS, raylet, workers, agents and dashboard are all under `kvmesh serve`)."""
    import psutil
    root = psutil.Process(pid)
    names = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            names[proc.pid] = proc.name()
        except psutil.NoSuchProcess:
            pass
    return sorted((c.laddr.ip, c.laddr.port, names[c.pid]) for c in psutil.net_connections("inet")
                  if c.status == psutil.CONN_LISTEN and c.pid in names)


def is_loopback(ip: str) -> bool:
    import ipaddress
    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


@pytest.mark.slow
def test_serve_starts_its_own_ray_next_to_a_running_cluster(other_ray, config_file):
    address, token = other_ray
    port = free_port()
    env = serve_env()
    for name in ray_env(None):          # what kvmesh serve sets itself (tests/conftest.py sets the proxy's)
        env.pop(name, None)
    server = ServeProcess(["--config", str(config_file), "--port", str(port)], env)
    try:
        where = server.wait_for("kvmesh serve: on Ray at", SERVE_WITHIN_S)
        server.wait_for("kvmesh is serving", SERVE_WITHIN_S)
        assert "(a new local cluster)" in where and f"{gcs_port(address)} " not in where, where
        assert complete(port)["choices"][0]["text"] is not None
        assert "SERVE_CONTROLLER_ACTOR" not in named_actors(address, token)
        # --host 127.0.0.1 (the default): Ray's listeners and kvmesh's own are on loopback, all but one a
        # replica that Ray Serve 2.60 binds to [::] with no setting (its inter-deployment gRPC server,
        # behind Ray's token auth when that is on: docs/security.md)
        sockets = listening(server.proc.pid)
        assert ("127.0.0.1", port) in {(ip, p) for ip, p, _ in sockets}
        assert {name for *_, name in sockets} >= {"gcs_server", "raylet"}, sockets
        wide = [s for s in sockets if not is_loopback(s[0])]
        replicas = [s for s in wide if s[2].startswith("ray::ServeRepl")]
        assert wide == replicas and all(ip == "::" for ip, *_ in replicas), sockets
        assert len(replicas) == len({name for *_, name in replicas}) == 2, sockets   # Ingress, Colocated
        assert httpx.get(f"http://127.0.0.1:{port}/-/routes", timeout=30).status_code == 404
    finally:
        rc = server.stop()
    assert rc == 0, "".join(server.lines)[-3000:]


@pytest.mark.slow
def test_serve_address_attaches_to_the_running_cluster_with_its_token(other_ray, config_file):
    address, token = other_ray
    port = free_port()
    # only the token file, no RAY_AUTH_MODE: `kvmesh serve` turns token auth on for the address
    server = ServeProcess(["--config", str(config_file), "--port", str(port), "--address", address],
                          serve_env(RAY_AUTH_TOKEN_PATH=str(token)))
    try:
        where = server.wait_for("kvmesh serve: on Ray at", SERVE_WITHIN_S)
        server.wait_for("kvmesh is serving", SERVE_WITHIN_S)
        assert where.rstrip().endswith(f"{gcs_port(address)} (attached)"), where
        complete(port)
        assert "SERVE_CONTROLLER_ACTOR" in named_actors(address, token)
    finally:
        rc = server.stop()
    assert rc == 0, "".join(server.lines)[-3000:]


def test_serve_on_a_port_in_use_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is in use" in err, err
