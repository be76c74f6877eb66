"""A NIXL READ cut by a partition (issue 23's chaos tests found it): the READ times out, and
when the link heals UCX still writes its bytes into the destination's memory, whatever that
memory holds by then. The READ must say so (TransferInFlight) and report when it is over, so
that the decode engine gives those blocks to no other request before (pinned for the engine
by test_kv_manager.py). Two agents in two network namespaces; the cut is iptables DROP."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.onprem_hosts import free_subnet
from tests.integration.test_onprem_cluster import require_namespaces

pytestmark = pytest.mark.slow     # network namespaces

pytest.importorskip("nixl._api")
ROOT = Path(__file__).resolve().parents[2]
HEAL_WITHIN_S = 30.0

AGENT = """
import json, os, pickle, subprocess, sys, time, torch
from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent
from kvmesh.kvstore.transfer.kv_transport import HandoffError, TransferInFlight
role, ip, peer, folder = sys.argv[1:5]
N = 1 << 20
if role == "source":
    t = torch.full((N,), 1.0)
    agent = KVTransferAgent("source", [t], ip)
    pickle.dump(agent.describe([(0, 0, N * 4)]), open(folder + "/remote.tmp", "wb"))
    os.rename(folder + "/remote.tmp", folder + "/remote.pkl")
    time.sleep(120)
    sys.exit()
while not os.path.exists(folder + "/remote.pkl"):
    time.sleep(0.1)
remote = pickle.load(open(folder + "/remote.pkl", "rb"))
t = torch.zeros(N)
agent = KVTransferAgent("destination", [t], ip)
out = {"first": agent.read(remote, [(0, 0, N * 4)], timeout_s=30) == N * 4 and bool((t == 1).all())}
t.fill_(7.0)
cut = [["iptables", "-A", "INPUT", "-s", peer, "-j", "DROP"], ["iptables", "-A", "OUTPUT", "-d", peer, "-j", "DROP"]]
for rule in cut:
    subprocess.run(rule, check=True)
settled = None
try:
    agent.read(remote, [(0, 0, N * 4)], timeout_s=2)
    out["error"] = None
except HandoffError as e:
    out["error"] = type(e).__name__
    settled = getattr(e, "settled", None)
out["settled_while_cut"] = settled() if settled else None
subprocess.run(["iptables", "-F"], check=True)
deadline = time.monotonic() + float(sys.argv[5])
while settled is not None and not settled() and time.monotonic() < deadline:
    time.sleep(0.2)
out["settled_after_heal"] = settled() if settled else None
t.fill_(7.0)                # now the memory is given to someone else
time.sleep(3)
out["untouched_after"] = bool((t == 7).all())
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture
def two_namespaces():
    require_namespaces()
    if not shutil.which("iptables"):
        pytest.skip("needs iptables (scripts/setup.sh installs it)")
    net = free_subnet("10.216", "kvn")
    names = [f"kvn{net}a", f"kvn{net}b"]
    ips = [f"10.216.{net}.1", f"10.216.{net}.2"]
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "link", "add", f"{names[0]}v", "type", "veth", "peer", "name", f"{names[1]}v"],
                       check=True)
        for ns, ip in zip(names, ips):
            subprocess.run(["ip", "link", "set", f"{ns}v", "netns", ns], check=True)
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", f"{ns}v"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", f"{ns}v", "up"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        yield names, ips
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_read_cut_by_a_partition_is_in_flight_until_the_link_heals_and_then_over(two_namespaces):
    names, ips = two_namespaces
    folder = tempfile.mkdtemp(prefix="kvn-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"}
    agent = ["ip", "netns", "exec"]
    source = subprocess.Popen([*agent, names[0], sys.executable, "-c", AGENT, "source", ips[0], ips[1], folder],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run([*agent, names[1], sys.executable, "-c", AGENT, "destination", ips[1], ips[0], folder,
                              str(HEAL_WITHIN_S)], env=env, capture_output=True, text=True, timeout=180)
    finally:
        source.kill()
        source.wait()
        shutil.rmtree(folder, ignore_errors=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["first"], result
    assert result["error"] == "TransferInFlight", result        # not a plain HandoffError: memory still owed
    assert result["settled_while_cut"] is False, result
    assert result["settled_after_heal"] is True, result
    assert result["untouched_after"], result                    # once over, nothing lands any more
