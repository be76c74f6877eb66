"""`ray up` for real: deploy/onprem.yaml on three "machines" (network namespaces with their
own sshd, PID and mount namespaces; tests/integration/onprem_hosts.py), the README's steps
exactly: `ray get-auth-token --generate`, `ray up`, `ray exec ... serve deploy
deploy/serve-onprem.yaml`, completions to the head's address, `ray down`. The test changes
only the addresses, the SSH user/key and the cluster name in the config.

Prints the time from `ray up` to the first completion and the time to tear down.
"""
from __future__ import annotations

import base64
import getpass
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import random_prompt
from tests.integration.onprem_hosts import Hosts, HostsUnavailable, check_prerequisites
from tests.integration.test_serve_fake_cluster import stop_cluster
from tests.local_serve import small_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]     # network-namespace hosts with their own sshd

ROOT = Path(__file__).resolve().parents[2]
SERVING_WITHIN_S = 600.0
STOPPED_WITHIN_S = 180.0
PROMPT = random_prompt(300, seed=7)          # two full 128-token blocks and a tail
MAX_TOKENS = 8
GCS_GONE_S = 10             # a worker's raylet outlives the head's GCS by this (Ray's default: 60 s)
RAY_MARKERS = ("raylet", "gcs_server", "redis-server", "ray::", "default_worker.py", "dashboard", "monitor.py")

# run on the head by `ray exec`: the node of every live Serve replica of the app
PLACEMENT = """
import json, ray
from ray.util.state import list_actors
ray.init(address="auto", logging_level="ERROR")
ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
out = {}
for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000):
    if a.class_name.startswith("ServeReplica:kvmesh:"):
        out.setdefault(a.class_name.rsplit(":", 1)[1], []).append(ip[a.node_id])
print("PLACEMENT " + json.dumps(out))
"""


def require_namespaces() -> None:
    """Skip (naming why) where this machine cannot make namespace hosts."""
    try:
        check_prerequisites()
    except HostsUnavailable as e:
        pytest.skip(f"on-prem cluster test needs network namespaces: {e}")


@pytest.fixture
def hosts():
    require_namespaces()
    h = Hosts(3)
    try:
        yield h.start()
    finally:
        h.close()


class Launcher:
    """The machine that runs `ray up` (this process's namespace), with its own HOME and TMPDIR
    so the auth token, Ray's cluster state and config cache are the test's alone."""

    def __init__(self, hosts: Hosts):
        head, prefill, decode = hosts.ips
        self.hosts, self.head = hosts, head
        self.home = hosts.root / "launcher"
        (self.home / "tmp").mkdir(parents=True)
        config = yaml.safe_load((ROOT / "deploy" / "onprem.yaml").read_text())
        config["cluster_name"] = f"kvmesh-onprem-{hosts.net}"
        config["provider"].update(head_ip=head, worker_ips=[prefill, decode],
                                  kvmesh_pools={prefill: "prefill", decode: "decode"})
        config["auth"] = {"ssh_user": "root", "ssh_private_key": str(hosts.key)}
        self.config = hosts.root / "onprem.yaml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.cluster_name = config["cluster_name"]
        venv_bin = str(Path(sys.executable).parent)
        self.env = {"PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(self.home),
                    "TMPDIR": str(self.home / "tmp"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "LANG": "C.UTF-8",
                    **{k: os.environ[k] for k in ("USER", "LOGNAME") if k in os.environ}}  # ssh_control_dir
        self.log = hosts.root / "launcher.log"
        # every host already has the project's environment, so the setup command's
        # `test -x .venv/bin/kvmesh` skips scripts/setup.sh (which a fresh machine runs; the
        # hosts cannot reach a package index). PYTHONPATH=~/kvmesh (set up by the config)
        # makes the copy `ray up` synced the code that runs.
        venv = Path(sys.executable).parent.parent.resolve()
        for home in hosts.root.glob("host*/home"):
            (home / "kvmesh").mkdir()
            (home / "kvmesh" / ".venv").symlink_to(venv)
            # `ray down` stops the head; a worker's raylet exits once the GCS is gone this long,
            # then the config's watch loop stops the rest of the worker (Ray's default: 60 s).
            # The head's autoscaler looks for machines to launch every second (its default: 5 s).
            (home / ".bashrc").write_text(f"export RAY_gcs_rpc_server_reconnect_timeout_s={GCS_GONE_S} "
                                          "AUTOSCALER_UPDATE_INTERVAL_S=1\n")

    def run(self, *args: str, timeout: float = 900) -> str:
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(args)}\n")
        out = subprocess.run(list(args), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        with open(self.log, "a") as log:
            log.write(out.stdout + out.stderr)
        assert out.returncode == 0, f"`{' '.join(args)}` failed:\n{(out.stdout + out.stderr)[-5000:]}"
        return out.stdout

    def ray(self, *args: str, timeout: float = 900) -> str:
        return self.run(shutil.which("ray", path=self.env["PATH"]), *args, timeout=timeout)

    def ssh_control_dir(self) -> Path:
        """Where `ray up` keeps its SSH control sockets for this cluster (Ray's fixed /tmp path)."""
        h = lambda s: hashlib.sha256(s.encode()).hexdigest()[:10]
        return Path("/tmp") / f"ray_ssh_{h(getpass.getuser())}" / h(self.cluster_name)

    def close(self) -> None:
        control = self.ssh_control_dir()
        stop_cluster([str(control), str(self.hosts.root)])    # ssh masters left by ray up / exec
        shutil.rmtree(control, ignore_errors=True)
        try:
            control.parent.rmdir()
        except OSError:
            pass


@pytest.fixture
def launcher(hosts):
    hosts.check_isolated()      # before anything can run `ray stop` on a host
    ln = Launcher(hosts)
    try:
        yield ln
    finally:
        ln.close()


def complete(url: str, prompt, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})


def wait_for_first_completion(url: str) -> dict:
    deadline, last = time.monotonic() + SERVING_WITHIN_S, "no answer"
    while time.monotonic() < deadline:
        try:
            r = complete(url, "Hello, kvmesh")
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(3)
    raise AssertionError(f"no completion from {url} within {SERVING_WITHIN_S:.0f} s: {last}")


def ray_processes(hosts: Hosts) -> dict[str, list[str]]:
    return {ip: [p for p in hosts.processes(ip) if any(m in p for m in RAY_MARKERS)] for ip in hosts.ips}


def placement(launcher: Launcher) -> dict[str, list[str]]:
    code = base64.b64encode(PLACEMENT.encode()).decode()
    out = launcher.ray("exec", str(launcher.config), f"cd ~/kvmesh && python -c \"$(echo {code} | base64 -d)\"")
    lines = [l for l in out.splitlines() if l.startswith("PLACEMENT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("PLACEMENT "):])


@pytest.mark.slow
def test_ray_up_onprem_serves_prefill_and_decode_on_their_hosts_and_ray_down_stops_all(hosts, launcher, capsys):
    head, prefill, decode = hosts.ips
    url = f"http://{head}:8000"
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.sampling.params import SamplingParams
    cold = Engine(small_config().engine.engine_config()).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].token_ids

    launcher.ray("get-auth-token", "--generate")
    t0 = time.monotonic()
    launcher.ray("up", "-y", str(launcher.config))
    t_up = time.monotonic() - t0
    launcher.ray("exec", str(launcher.config), "cd ~/kvmesh && serve deploy deploy/serve-onprem.yaml")
    wait_for_first_completion(url)
    t_serving = time.monotonic() - t0

    where = placement(launcher)
    assert where.get("Prefill") and set(where["Prefill"]) == {prefill}, where
    assert where.get("Decode") and set(where["Decode"]) == {decode}, where
    assert where.get("Ingress") and set(where["Ingress"]) == {head}, where

    first = complete(url, PROMPT)
    again = complete(url, PROMPT)
    assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
    first, again = first.json(), again.json()
    assert first["choices"][0]["token_ids"] == cold, first
    assert again["choices"][0]["token_ids"] == cold, again
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    stored = list((hosts.shared / "store").rglob("*"))
    assert any(p.is_file() for p in stored), "nothing reached the shared store"

    t1 = time.monotonic()
    launcher.ray("down", "-y", str(launcher.config))
    t_down = time.monotonic() - t1
    deadline, left = time.monotonic() + STOPPED_WITHIN_S, ray_processes(hosts)
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(2)
        left = ray_processes(hosts)
    t_stopped = time.monotonic() - t1
    assert not any(left.values()), f"still running {STOPPED_WITHIN_S:.0f} s after `ray down`: {left}"
    with capsys.disabled():
        print(f"\non-prem cluster (head + 1 prefill + 1 decode host): `ray up` {t_up:.1f} s, "
              f"`ray up` -> first completion {t_serving:.1f} s, `ray down` {t_down:.1f} s, "
              f"every Ray process and Redis gone {t_stopped:.1f} s after `ray down` began "
              f"(2 shared cores, other jobs running)")


def test_namespace_hosts_are_isolated_and_leave_nothing_behind():
    """What makes `ray stop` on a host safe on a shared machine, and the cleanup."""
    require_namespaces()
    h = Hosts(2)
    try:
        h.start()
        h.check_isolated()
        head, other = h.ips
        assert h.ssh(head, "cat /proc/1/cmdline").stdout.count("host_init.py") == 1
        assert h.ssh(head, f"echo > /dev/tcp/{other}/22 && echo reached").stdout.strip() == "reached"
        # the host's /tmp is its own: only what it wrote, and the checkout/venv kept visible
        kept = {Path(p).relative_to("/tmp").parts[0] for p in h.keep if p.startswith("/tmp/")}
        assert set(h.ssh(head, "touch /tmp/mine && ls /tmp").stdout.split()) == {"mine"} | kept
        assert set(h.ssh(other, "ls /tmp").stdout.split()) == kept
        assert h.ssh(other, "touch /mnt/kvmesh/shared && echo ok").stdout.strip() == "ok"
        assert (h.shared / "shared").exists()
    finally:
        h.close()
    names = (h.prefix + "-0", h.prefix + "-1", h.bridge, h.prefix + "h0", h.prefix + "h1")
    listed = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names[2:]) and not h.root.exists()
    assert not any(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for n in names[:2])
    assert not any(str(h.root) in p for p in _all_command_lines())


def _all_command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return lines
