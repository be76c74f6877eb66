"""deploy/local-cluster.yaml on Ray's fake multi-node provider: the real autoscaler
brings up a prefill node and a decode node (min_workers: 1) with their custom
resources, and the pools pinned by those resources land on them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.local_serve import free_port

ROOT = Path(__file__).resolve().parents[2]
NODES_WITHIN_S = 120.0


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) for every visible process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        table[int(entry.name)] = (ppid, cmd)
    return table


def stop_cluster(markers: list[str]) -> None:
    """Stop only this cluster's processes: those whose command line names its temp dir
    or GCS port, and their descendants (never `ray stop`, which would stop every Ray here)."""
    table = _proc_table()
    ours = {pid for pid, (_, cmd) in table.items() if any(m in cmd for m in markers)}
    ours.discard(os.getpid())
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in table.items() if ppid in ours} - ours - {os.getpid()}
        grew = bool(children)
        ours |= children
    for sig in (signal.SIGTERM, signal.SIGKILL):
        ours = {pid for pid in ours if _running(pid)}
        for pid in ours:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2
        while any(_running(pid) for pid in ours) and time.monotonic() < deadline:
            time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def fake_cluster():
    gcs_port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")     # short: raylet socket paths have a limit
    config = yaml.safe_load((ROOT / "deploy" / "local-cluster.yaml").read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
    config_path = Path(temp_dir) / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # the autoscaler looks every second (Ray's default: 5 s), so the min_workers nodes come sooner
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    markers = [temp_dir, f":{gcs_port}"]
    try:
        subprocess.run([ray_bin, "start", "--head", f"--port={gcs_port}", "--num-cpus=1", f"--temp-dir={temp_dir}",
                        "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                        f"--autoscaling-config={config_path}"], env=env, check=True, capture_output=True,
                       timeout=120)
        yield f"127.0.0.1:{gcs_port}"
    finally:
        stop_cluster(markers)
        shutil.rmtree(temp_dir, ignore_errors=True)     # its config and Ray's session logs


# Runs in a child process: Ray reads RAY_AUTH_MODE once per process, and clusters made by
# `ray start` require the local token, while this test process may already have used Ray.
CHECK = """
import json, sys, time
import httpx, ray
from ray import serve
from kvmesh.cluster.app import build_app
from tests.local_serve import free_port, small_config

ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    kinds = {k for n in ray.nodes() if n["Alive"] for k in n["Resources"] if k.startswith("kvmesh_")}
    if kinds >= {"kvmesh_prefill", "kvmesh_decode"}:
        break
    time.sleep(1)
result = {"node_kinds": sorted(kinds), "seconds_to_nodes": round(float(sys.argv[2]) - deadline + time.monotonic(), 1)}
if kinds >= {"kvmesh_prefill", "kvmesh_decode"}:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    config = small_config("disaggregated", prefill={"resources": {"kvmesh_prefill": 0.01}},
                          decode={"resources": {"kvmesh_decode": 0.01}})
    serve.run(build_app(config), name="kvmesh", route_prefix="/")
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
    result["status"] = r.status_code
    node_of = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
    for d in ("Prefill", "Decode"):
        result[d] = [node_of[serve.get_deployment_handle(d, "kvmesh").info.remote().result()["node_id"]]]
    serve.shutdown()
print("RESULT " + json.dumps(result))
"""


@pytest.mark.slow
def test_autoscaler_starts_prefill_and_decode_nodes_and_the_pools_land_on_them(fake_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHECK, fake_cluster, str(NODES_WITHIN_S)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=NODES_WITHIN_S + 240)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["node_kinds"] == ["kvmesh_decode", "kvmesh_prefill"], result
    assert result["status"] == 200, result
    assert result["Prefill"] and all("kvmesh_prefill" in r for r in result["Prefill"]), result
    assert result["Decode"] and all("kvmesh_decode" in r for r in result["Decode"]), result
