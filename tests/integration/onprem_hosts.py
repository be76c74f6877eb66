"""Linux network namespaces as the machines of an on-premises cluster, for one test.

Each "host" is a network namespace on a private bridge (10.213.N.0/24, N free on this
machine) AND its own PID and mount namespace: an `sshd` (private config, throwaway keys,
listening on the host's address only) runs as the child of a tiny init that is PID 1 of
the host, with a private /root, /tmp, /run, /dev/shm and /mnt (where /mnt/kvmesh is one
folder bind-mounted on every host: the shared store). Everything run over SSH on a host
lives in that host: `ray stop` there sees only that host's processes, /tmp/ray is its own.
Killing the init kills every process of the host; `close()` removes the namespaces, the
bridge, the veths, the processes and the files, also after a failure.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PYTHON = str(Path(sys.executable).resolve())   # the interpreter itself (a venv's python is a link)
SSH_UP_WITHIN_S = 30.0

# PID 1 of a host: private mounts, then sshd, reaping every orphan until sshd exits
HOST_INIT = """
import os, subprocess, sys
home, shared, config, log, *keep = sys.argv[1:]
def mount(*args):
    subprocess.run(["mount", *args], check=True)
PRIVATE = (("/tmp", "4g"), ("/dev/shm", "2g"), ("/run", "64m"), ("/mnt", "16m"))
mount("--make-rprivate", "/")
# paths the hosts need (the Python, the venv, the repo) that lie under a private folder:
# staged beside home before the tmpfs hides them, bound back at the same path after
staged = []
for i, path in enumerate(p for p in keep if p.startswith(tuple(d + "/" for d, _ in PRIVATE))):
    stage = os.path.join(os.path.dirname(home), "stage", str(i))
    os.makedirs(stage, exist_ok=True)
    mount("--bind", path, stage)
    staged.append((stage, path))
for path, size in PRIVATE:
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)
for stage, path in staged:
    os.makedirs(path, exist_ok=True)
    mount("--bind", stage, path)
os.makedirs("/run/sshd", exist_ok=True)
os.makedirs("/mnt/kvmesh")
mount("--bind", shared, "/mnt/kvmesh")
for path in keep:          # parts of the real /root the hosts need (a Python installed there)
    if not path.startswith("/root/"):
        continue
    target = os.path.join(home, os.path.relpath(path, "/root"))
    os.makedirs(target, exist_ok=True)
    mount("--bind", path, target)
mount("--rbind", home, "/root")
sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", config], stderr=open(log, "ab"))
while os.wait()[0] != sshd.pid:
    pass
"""

SSHD_CONFIG = """ListenAddress {ip}
Port 22
HostKey {host_key}
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
AcceptEnv none
"""


def visible_paths() -> list[str]:
    """What the hosts must see at the same path although their /root, /tmp, ... are private:
    the interpreter's folder (pyenv under /root), the venv and this checkout (a CI clone may
    live under /tmp)."""
    real = Path(PYTHON)
    paths = [str(Path("/root") / real.relative_to("/root").parts[0])] if real.is_relative_to("/root") else []
    for path in (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve()):
        if not any(path.is_relative_to(p) for p in paths):
            paths.append(str(path))
    return paths


def run(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=60, **kw)


class HostsUnavailable(RuntimeError):
    """Network namespaces (or sshd) cannot be used on this machine."""


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise HostsUnavailable("needs root (ip netns, unshare)")
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", "rsync", "mount"):
        if not shutil.which(tool):
            raise HostsUnavailable(f"`{tool}` is not installed")
    if not Path(SSHD).exists():
        raise HostsUnavailable(f"{SSHD} is missing: scripts/setup.sh installs openssh-server")
    probe = f"kvoprobe{os.getpid() % 10000}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        raise HostsUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    run("ip", "netns", "del", probe, check=False)


def free_subnet(net: str, name: str) -> int:
    used = run("ip", "-4", "-o", "addr").stdout + run("ip", "-4", "route").stdout
    links = run("ip", "-o", "link").stdout
    free = [n for n in range(1, 255) if f"{net}.{n}." not in used and f"{name}{n}" not in links]
    if not free:
        raise HostsUnavailable(f"no free {net}.N.0/24 subnet")
    return random.choice(free)


class Hosts:
    """`count` hosts: ips[i] is {subnet}.N.(i+1); the bridge (this side) is {subnet}.N.254.
    Each user of the class has its own `name` (of the links and namespaces) and `subnet`, so
    two tests on one machine never meet."""

    def __init__(self, count: int, name: str = "kvo", subnet: str = "10.213"):
        self.keep = visible_paths()
        self.subnet = subnet
        self.net = free_subnet(subnet, name)
        self.prefix = f"{name}{self.net}"
        self.root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/var/tmp"))   # /tmp is private on the hosts
        self.ips = [f"{subnet}.{self.net}.{i + 1}" for i in range(count)]
        self.gateway = f"{subnet}.{self.net}.254"
        self.bridge = f"{self.prefix}br"
        self.namespaces: list[str] = []
        self.inits: list[subprocess.Popen] = []
        self.key = self.root / "id_ed25519"
        self.shared = self.root / "shared"

    # -- bring-up ---------------------------------------------------------------------
    def start(self) -> "Hosts":
        self.shared.mkdir()
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvmesh-onprem-test", "-f", str(self.key))
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key"))
        (self.root / "host_init.py").write_text(HOST_INIT)
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, ip in enumerate(self.ips):
            self._add_host(i, ip)
        for ip in self.ips:
            self._wait_for_ssh(ip)
        return self

    def add_host(self) -> str:
        """One more host on the bridge, after start() (a machine that joins late); its address."""
        ip = f"{self.subnet}.{self.net}.{len(self.ips) + 1}"
        self.ips.append(ip)
        self._add_host(len(self.ips) - 1, ip)
        self._wait_for_ssh(ip)
        return ip

    def _add_host(self, i: int, ip: str) -> None:
        ns, outside, inside = f"{self.prefix}-{i}", f"{self.prefix}h{i}", f"{self.prefix}p{i}"
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        run("ip", "link", "set", outside, "master", self.bridge, "up")
        run("ip", "link", "set", inside, "netns", ns)
        run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
        run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        # a default route only so that programs find their address (Ray asks the kernel which
        # source address would reach a public IP); this side does not forward, nothing leaves
        run("ip", "-n", ns, "route", "add", "default", "via", self.gateway)
        host = self.root / f"host{i}"
        (host / "home").mkdir(parents=True)
        config = host / "sshd_config"
        config.write_text(SSHD_CONFIG.format(ip=ip, host_key=self.root / "host_key",
                                             authorized=self.root / "id_ed25519.pub"))
        self.inits.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             PYTHON, str(self.root / "host_init.py"), str(host / "home"), str(self.shared),
             str(config), str(host / "sshd.log"), *self.keep],
            stdout=subprocess.DEVNULL, stderr=open(host / "init.log", "ab"), start_new_session=True))

    def ssh_args(self, ip: str) -> list[str]:
        return ["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
                f"root@{ip}"]

    def ssh(self, ip: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.ssh_args(ip), command], capture_output=True, text=True, timeout=timeout)

    def _wait_for_ssh(self, ip: str) -> None:
        deadline = time.monotonic() + SSH_UP_WITHIN_S
        while True:
            out = self.ssh(ip, "true", timeout=15)
            if out.returncode == 0:
                return
            if time.monotonic() > deadline:
                logs = "".join(p.read_text() for p in self.root.glob("host*/*.log"))
                raise RuntimeError(f"sshd on {ip} did not answer: {out.stderr.strip()}\n{logs[-2000:]}")
            time.sleep(0.5)

    # -- inspection -------------------------------------------------------------------
    def processes(self, ip: str) -> list[str]:
        """Command lines of every process the host can see (its own PID namespace)."""
        script = ("import os\nfor p in os.listdir('/proc'):\n if p.isdigit():\n  try: print(open(f'/proc/{p}/cmdline',"
                  "'rb').read().replace(b'\\0', b' ').decode(errors='replace'))\n  except OSError: pass")
        out = self.ssh(ip, f"{PYTHON} -c \"{script}\"")
        if out.returncode != 0:
            raise RuntimeError(f"cannot list processes on {ip}: {out.stderr}")
        return [line for line in out.stdout.splitlines() if line.strip()]

    def check_isolated(self) -> None:
        """Each host sees only its own processes (PID 1 is its init), so `ray stop` there is safe."""
        for ip in self.ips:
            seen = self.processes(ip)
            init = self.ssh(ip, "cat /proc/1/cmdline").stdout
            if "host_init.py" not in init or len(seen) > 20:
                raise RuntimeError(f"host {ip} is not in its own PID namespace: PID 1 is {init!r}, "
                                   f"{len(seen)} processes visible")

    # -- faults -----------------------------------------------------------------------
    def namespace(self, ip: str) -> str:
        return self.namespaces[self.ips.index(ip)]

    def netns(self, ip: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A command (iptables, tc) in the host's network namespace only."""
        return run("ip", "netns", "exec", self.namespace(ip), *command, check=check)

    def kill(self, ip: str) -> None:
        """SIGKILL every process of the host (its PID 1, and with it its PID namespace); the
        network namespace stays, so the address answers with resets, like a machine whose
        processes all crashed."""
        proc = self.inits[self.ips.index(ip)]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        # unshare ignores SIGTERM while it waits; once it dies, --kill-child kills the host's
        # PID 1, and with it every process of the host's PID namespace
        for proc in self.inits:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.inits:
            proc.wait()
        for i, ns in enumerate(self.namespaces):
            # the veth goes now: a namespace lives on after `del` while its kernel sockets do
            run("ip", "link", "del", f"{self.prefix}h{i}", check=False)
            run("ip", "netns", "del", ns, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
