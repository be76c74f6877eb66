"""Shared pytest fixtures. Each section is owned by one area; keep sections self-contained."""

from __future__ import annotations

import os

# Ray Serve kills a proxy that misses its readiness check (5 s) three times, and serve.start
# fails with it: on two cores shared by both pytest workers' Ray clusters a proxy was seen to take
# longer (load ~6). Every Ray the tests start (Cluster, `ray start`, `kvmesh serve`) inherits this.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "20")
# Serve's own log lines (an access line per request, per replica) go to its log files only
# (`/tmp/ray/session_latest/logs/serve/`), not to stderr as well: Ray's log monitor tailed them
# and streamed them to the test process (CPU the 2 cores have no spare of).
os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
# Each node's Ray dashboard agent samples every worker process's CPU and memory for the dashboard
# every 5 s; no test reads those figures, so once a minute.
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# Serve's periodic work, which runs whether or not requests come: the controller's loop every
# 0.25 s (Serve's default: 0.1 s; its reconciling of deployments and each node's free resources),
# Ray metrics that every replica, handle and proxy exports every second (default: 0.1 s; no test
# reads them: kvmesh's /metrics is its own) and each event loop's lag measured every 30 s (5 s).
# An idle Ray + Serve with a colocated and a disaggregated app took 0.160 cores of the 2 with
# Serve's defaults and 0.108 with these. SERVE_SETTINGS is what namespace hosts export (chaos_cluster).
SERVE_SETTINGS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                  "RAY_SERVE_EVENT_LOOP_MONITORING_INTERVAL_S": "30"}
for _name, _value in SERVE_SETTINGS.items():
    os.environ.setdefault(_name, _value)
# Serve's proxy answers /-/routes by itself, outside every app's API key: every Ray the tests start
# hides it the way `kvmesh serve` does (the proxy callback, cluster/openai/proxy_guard.py).
from kvmesh.cluster.openai.proxy_guard import RAY_ENV as _PROXY_GUARD_ENV  # noqa: E402  (stdlib only)

for _name, _value in _PROXY_GUARD_ENV.items():
    os.environ.setdefault(_name, _value)

# ---------------------------------------------------------------------------------
# kvstore: a private Redis server for the index tests.
#
# Never the system server on 127.0.0.1:6379: tests start their own redis-server on a
# free port, with no persistence, in a temp dir, and kill it at the end of the session.
# ---------------------------------------------------------------------------------
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.local_serve import free_port

REDIS_SERVER_BINARY = "/usr/bin/redis-server"
REDIS_START_TIMEOUT_S = 10.0


class PrivateRedis:
    """A redis-server subprocess on a fixed private port; can be stopped and restarted."""

    def __init__(self, binary: str, workdir: Path, host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.workdir = workdir
        self.host = host            # another address only for namespace hosts the test made
        self.port = free_port()
        self.url = f"redis://{host}:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self._proc is None, "already running"
        self._proc = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", self.host, "--protected-mode", "no",
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_until_ping()

    def _wait_until_ping(self) -> None:
        import redis

        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if self._proc is not None and self._proc.poll() is not None:
                    code = self._proc.returncode
                    raise RuntimeError(f"redis-server exited with {code}; see {self.workdir}/redis.log")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server (an outage); data is lost since nothing is persisted."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Start again on the same port (after `stop`)."""
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_process() -> Iterator[PrivateRedis]:
    """The session's private Redis, with stop()/restart() for outage tests."""
    if not Path(REDIS_SERVER_BINARY).exists():
        pytest.skip(f"{REDIS_SERVER_BINARY} is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))
    server = PrivateRedis(REDIS_SERVER_BINARY, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server(redis_process: PrivateRedis) -> str:
    """URL of the session's private Redis: `redis://127.0.0.1:PORT/0`."""
    return redis_process.url


# ---------------------------------------------------------------------------------
# reliability: a password-protected private Redis that allows DEBUG (fault injection:
# CONFIG SET maxmemory, REPLICAOF, DEBUG SLEEP). One per test module.
# ---------------------------------------------------------------------------------
REDIS_PASSWORD = "s3cret-Pa55word-for-the-index"


@pytest.fixture(scope="module")
def password_redis():
    """(client, url with the password) of a private redis-server for fault injection."""
    import redis

    if not Path(REDIS_SERVER_BINARY).exists():
        pytest.skip(f"{REDIS_SERVER_BINARY} is not installed")
    workdir, port = tempfile.mkdtemp(prefix="kvmesh-redis-faults-"), free_port()
    proc = subprocess.Popen([REDIS_SERVER_BINARY, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", REDIS_PASSWORD,
                             "--enable-debug-command", "local", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=REDIS_PASSWORD, socket_timeout=5)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        yield client, f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------
# suite: both cores. `make test` runs two pytest-xdist workers (`-n 2`) with the scheduler
# of tests/lanes.py. A work unit is one test module, so its module-scoped fixtures are built
# once, but for the groups of tests/lanes.py (the modules on the session's Ray + Serve, one
# after another on one worker; the modules that start clusters of their own). Without xdist
# the groups only order the modules.
# ---------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)     # before every other implementation (xdist's reads the marks)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    from tests.lanes import group_items
    group_items(config, items)
    return (yield)


def _lanes_groups_file(config: pytest.Config) -> str:
    if not hasattr(config, "_kvmesh_lanes_dir"):
        config._kvmesh_lanes_dir = tempfile.TemporaryDirectory(prefix="kvmesh-lanes-")
        config.add_cleanup(config._kvmesh_lanes_dir.cleanup)
    return f"{config._kvmesh_lanes_dir.name}/groups.json"


def pytest_configure_node(node) -> None:
    """xdist (controller): tell each worker where to write its modules' groups, and where the
    clean install's venv is being built."""
    from tests.integration.clean_install import WORKERINPUT
    from tests.lanes import GROUPS_FILE
    node.workerinput[GROUPS_FILE] = _lanes_groups_file(node.config)
    node.workerinput[WORKERINPUT] = getattr(node.config, "_kvmesh_clean_install", "")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadgroup":
        return None                     # xdist's own scheduler for any other --dist
    from tests.lanes import LaneScheduling
    return LaneScheduling(config, log, _lanes_groups_file(config))


# ---------------------------------------------------------------------------------
# packaging: test_clean_install's fresh venv is built in the background from the session's
# start, by the controller (or pytest alone), and removed at the session's end
# (tests/integration/clean_install.py).
# ---------------------------------------------------------------------------------
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        return                          # an xdist worker: the controller started it
    from tests.integration.clean_install import BackgroundInstall, wanted
    if wanted(config):
        build = BackgroundInstall.start()
        config._kvmesh_clean_install = str(build.folder)
        config.add_cleanup(build.stop)
