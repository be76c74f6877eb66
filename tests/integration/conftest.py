"""Fixtures of the integration tests: one local Ray + Serve for the session.

Starting Ray and Serve and shutting them down costs ~10 s of two busy cores a module, so the
modules that need a local Ray with no settings of their own share one: `local_serve` gives it to
a module, which deploys its apps on it under their own names and route prefixes
(`LocalServe.deploy`) and may kill their replicas and rank actors, never Ray's own processes;
every app is deleted when the module ends, also after a failure, but the session-wide default
apps (`tests.local_serve.SHARED_APPS`: a colocated app on the defaults that several modules only
send requests to, started once instead of once per module). A module that needs a second
node adds it (`session_cluster`) and removes it at its end. Those modules run one after another
(see `pytest_collection_modifyitems`), and the Ray is shut down after the last of them, so the
modules that start clusters of their own (namespace hosts, `ray start`, `kvmesh serve`) run
beside no idle Ray. A module whose apps cannot be deleted leaves a fresh Ray to the next one.
Under `make test`'s two xdist workers each worker has a session of its own: tests/lanes.py gives
one worker the "local_serve" modules and the other the "local_serve_2" ones, and each worker's
Ray is shut down after the last module of its group.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.local_serve import LocalServe

SHARED = "local_serve"
HEAD = {"num_cpus": 4,                       # logical: every module's replicas (0.1-0.25 each) fit
        "resources": {"kvmesh_prefill": 1},  # test_serve_reuse pins one prefill replica per node
        "object_store_memory": 1 << 30, "include_dashboard": False,
        # no process tails the workers' log files to stream them to the driver: no test reads them
        # there, and they stay in /tmp/ray/session_*/logs (a log monitor is ~1.2 CPU-s a node)
        "include_log_monitor": False}


class SessionServe:
    """The session's Ray (a ray.cluster_utils.Cluster: a module may add a node) + Serve, started
    on first use; stop() shuts both down (a later use starts another)."""

    def __init__(self) -> None:
        self.cluster = None
        self.serve: LocalServe | None = None

    def get(self) -> LocalServe:
        if self.serve is None:
            from ray.cluster_utils import Cluster
            cluster = Cluster(initialize_head=True, head_node_args=HEAD)
            try:
                serve = LocalServe(address=cluster.address)
                serve.__enter__()
            except BaseException:
                import ray
                ray.shutdown()          # the driver first: Cluster.shutdown refuses a connected head
                cluster.shutdown()
                raise
            self.cluster, self.serve = cluster, serve
        return self.serve

    def stop(self) -> None:
        serve, cluster, self.serve, self.cluster = self.serve, self.cluster, None, None
        try:
            if serve is not None:
                serve.__exit__(None, None, None)
        finally:
            if cluster is not None:
                cluster.shutdown()


@pytest.fixture(scope="session")
def _session_serve() -> Iterator[SessionServe]:
    session = SessionServe()
    try:
        yield session
    finally:
        session.stop()


def _later_users(request: pytest.FixtureRequest) -> bool:
    """Whether a test after this module's last one uses the session's Ray: under xdist, one
    of this module's lanes group (tests/lanes.py: a worker runs that group's modules and no
    other module on this Ray)."""
    from tests.lanes import group_of
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.path == request.path]
    if not mine:
        return True
    later = [item for item in items[mine[-1] + 1:] if SHARED in item.fixturenames]
    if hasattr(request.config, "workerinput"):
        later = [item for item in later if group_of(item) == group_of(items[mine[-1]])]
    return bool(later)


@pytest.fixture(scope="module")
def local_serve(request: pytest.FixtureRequest, _session_serve: SessionServe) -> Iterator[LocalServe]:
    """The session's local Ray + Serve for this module; the module's apps are deleted at its end."""
    serve = _session_serve.get()
    try:
        yield serve
    finally:
        try:
            serve.delete_all(keep=serve.kept)     # the session-wide default apps stay
        except BaseException:
            _session_serve.stop()           # nothing of this module may reach the next one
            raise
        if not _later_users(request):
            _session_serve.stop()


@pytest.fixture(scope="module")
def session_cluster(local_serve: LocalServe, _session_serve: SessionServe):
    """The ray.cluster_utils.Cluster under `local_serve`, for a module that adds a node (and
    removes it at its end)."""
    return _session_serve.cluster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules on the session's Ray run one after another, where the first of them would
    run, each module's tests in their order; every other module keeps its place."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    users = [path for path, its in modules.items() if any(SHARED in i.fixturenames for i in its)]
    if not users:
        return
    order = list(modules)
    first = order.index(users[0])
    rest = [path for path in order if path not in users]
    before = [path for path in order[:first] if path not in users]
    ordered = before + users + rest[len(before):]
    items[:] = [item for path in ordered for item in modules[path]]
