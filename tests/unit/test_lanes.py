"""tests/lanes.py: how `make test` lays the suite out over two xdist workers. The scheduler
runs on xdist's own LoadScopeScheduling with stand-in worker handles (what xdist's controller
would hand it), so what is pinned is which unit each worker gets and when."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tests.lanes import CHAOS, LOCAL_SERVE, LOCAL_SERVE_2, OWN_CLUSTERS, LaneScheduling

MODULES = {   # module -> (group, tests)
    "tests/integration/test_serve_a.py": (LOCAL_SERVE, 3),
    "tests/integration/test_serve_b.py": (LOCAL_SERVE, 1),
    "tests/integration/test_serve_tp.py": (LOCAL_SERVE_2, 3),
    "tests/integration/test_onprem.py": (OWN_CLUSTERS, 3),
    "tests/integration/test_chaos.py": (CHAOS, 3),
    "tests/unit/test_u1.py": (None, 3),
    "tests/unit/test_u2.py": (None, 3),
}


class Worker:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


class Config:
    """What the scheduler reads of pytest's config under `-n 2 --dist loadgroup`."""
    option = SimpleNamespace(loadscopereorder=True, maxschedchunk=None)

    def getvalue(self, name: str):
        return {"tx": ["2*popen"], "dist": "loadgroup"}[name]


def scheduler(tmp_path):
    groups = {module: group or module for module, (group, _) in MODULES.items()}
    (tmp_path / "groups.json").write_text(json.dumps(groups))
    ids = [f"{module}::test_{i}" for module, (_, n) in MODULES.items() for i in range(n)]
    sched = LaneScheduling(Config(), None, str(tmp_path / "groups.json"))
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, ids)
    sched.schedule()
    return sched, workers, ids


def modules_sent(worker: Worker, ids: list[str]) -> list[str]:
    out: list[str] = []
    for i in worker.sent:
        module = ids[i].split("::")[0]
        if module not in out:
            out.append(module)
    return out


def finish(sched, worker: Worker, ids: list[str], module: str) -> None:
    for i in worker.sent:
        if ids[i].startswith(module + "::"):
            sched.mark_test_complete(worker, i)


def test_each_worker_takes_its_lane_first_then_the_rest(tmp_path):
    sched, (gw0, gw1), ids = scheduler(tmp_path)
    # one unit = every serve module of the group, in order; the other worker: own clusters,
    # then the second serve group, then the unit modules
    assert modules_sent(gw0, ids) == ["tests/integration/test_serve_a.py", "tests/integration/test_serve_b.py"]
    assert modules_sent(gw1, ids) == ["tests/integration/test_onprem.py"]
    finish(sched, gw1, ids, "tests/integration/test_onprem.py")
    assert modules_sent(gw1, ids)[1:] == ["tests/integration/test_serve_tp.py"]   # not chaos: it is gw0's
    finish(sched, gw1, ids, "tests/integration/test_serve_tp.py")
    assert modules_sent(gw1, ids)[2:] == ["tests/unit/test_u1.py"]
    finish(sched, gw0, ids, "tests/integration/test_serve_a.py")
    finish(sched, gw0, ids, "tests/integration/test_serve_b.py")
    assert modules_sent(gw0, ids)[2:] == ["tests/integration/test_chaos.py"]


def test_chaos_and_the_own_clusters_never_run_at_once(tmp_path):
    sched, (gw0, gw1), ids = scheduler(tmp_path)
    finish(sched, gw0, ids, "tests/integration/test_serve_a.py")
    finish(sched, gw0, ids, "tests/integration/test_serve_b.py")
    # gw1 still runs test_onprem: gw0 skips chaos, takes the unit modules, then (nothing else
    # left that it may run) gw1's second serve group
    assert modules_sent(gw0, ids)[2:] == ["tests/unit/test_u1.py"]
    finish(sched, gw0, ids, "tests/unit/test_u1.py")
    finish(sched, gw0, ids, "tests/unit/test_u2.py")
    finish(sched, gw0, ids, "tests/integration/test_serve_tp.py")
    assert modules_sent(gw0, ids)[2:] == ["tests/unit/test_u1.py", "tests/unit/test_u2.py",
                                          "tests/integration/test_serve_tp.py"]
    assert list(sched.workqueue) == ["chaos"]            # gw0 waits
    finish(sched, gw1, ids, "tests/integration/test_onprem.py")
    # onprem ended: chaos goes to a free worker; then every test ran, each once
    assert "tests/integration/test_chaos.py" in modules_sent(gw0, ids) + modules_sent(gw1, ids)
    for worker in (gw0, gw1):
        finish(sched, worker, ids, "tests/integration/test_chaos.py")
    assert sorted(gw0.sent + gw1.sent) == list(range(len(ids))) and not sched.workqueue
    assert sched.tests_finished
