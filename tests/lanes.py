"""How `make test` spreads the suite over two pytest-xdist workers (`-n 2 --dist loadgroup`).

The suite is CPU-bound on 2 cores, and the modules that run Ray clusters slow each other down
far more than they slow a one-process unit test (a chaos scenario run beside the Serve modules
took 2.7x its time alone and once missed its deadline). So the work units are laid out in two
lanes:

* worker gw0 takes "local_serve" first (the modules on the session's Ray + Serve,
  tests/integration/conftest.py: one after another, so one Ray + Serve serves them all), then
  "chaos" (test_chaos's namespace hosts, beside the unit tests only);
* the other worker takes "own_clusters" first (the other modules that start clusters of their
  own: namespace hosts, `ray start`, `kvmesh serve`), then "local_serve_2" (the Serve modules
  that balance the lanes, on that worker's own session Ray + Serve);
* then each takes the other modules, one unit per module, in collection order, and the other
  lane's units only when nothing else is left;
* "chaos" and "own_clusters" never run at the same time (both make network-namespace hosts
  and Ray clusters of their own).

A module in none of these groups is a unit of its own (its module-scoped fixtures are built
once). Without xdist the groups only order the modules (the two Serve groups one after the
other, on one Ray + Serve).
"""
from __future__ import annotations

import json
import os

import pytest

LOCAL_SERVE, LOCAL_SERVE_2, OWN_CLUSTERS, CHAOS = "local_serve", "local_serve_2", "own_clusters", "chaos"
ORDER = (LOCAL_SERVE, LOCAL_SERVE_2, OWN_CLUSTERS, CHAOS)
# local_serve_2: ~1/5 of the Serve modules' time, so both lanes end together (3a66d4a gave it
# test_serve_tensor_parallel alone, and that lane ended ~110 s after the other; f5ad2fb, whose
# ranks fork from a preloaded server, ended gw0's lane ~70 s after the other with the first two)
SECOND_SERVE_MODULES = frozenset({"test_serve_failures.py", "test_serve_dp_handoff.py", "test_serve_dsv4_chat.py"})
OWN_CLUSTER_MODULES = frozenset({
    "test_onprem_cluster.py", "test_nixl_partition.py", "test_wide_ep.py",    # network-namespace hosts
    "test_serve_cli_ray.py", "test_serve_fake_cluster.py",  # `ray start`, `kvmesh serve`
})
LANES = {"gw0": (LOCAL_SERVE, CHAOS), "other": (OWN_CLUSTERS, LOCAL_SERVE_2)}   # each worker's first units
NOT_TOGETHER = frozenset({CHAOS, OWN_CLUSTERS})    # never on two workers at once
GROUPS_FILE = "kvmesh_lanes_groups"                # workerinput key: where workers write {module: group}


def group_of(item: pytest.Item) -> str:
    if "local_serve" in item.fixturenames:
        return LOCAL_SERVE_2 if item.path.name in SECOND_SERVE_MODULES else LOCAL_SERVE
    if item.path.name == "test_chaos.py":
        return CHAOS
    if item.path.name in OWN_CLUSTER_MODULES:
        return OWN_CLUSTERS
    return str(item.path)


def group_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the items by group (stable otherwise); on an xdist worker, also write each
    module's group where the controller's scheduler reads it (a group is a property of the
    tests' fixtures, which only a worker that collected them knows)."""
    groups = {id(item): group_of(item) for item in items}
    items.sort(key=lambda item: ORDER.index(groups[id(item)]) if groups[id(item)] in ORDER else len(ORDER))
    path = getattr(config, "workerinput", {}).get(GROUPS_FILE)
    if path:
        modules: dict[str, str] = {}
        for item in items:
            module = item.nodeid.split("::")[0]
            if modules.get(module) not in ORDER:
                modules[module] = groups[id(item)]
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(modules, f)
        os.replace(tmp, path)


try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:       # pragma: no cover - xdist is in the test extra
    LoadGroupScheduling = object


class LaneScheduling(LoadGroupScheduling):
    """xdist's loadgroup scheduling (whole groups to a worker, a worker refilled when two of
    its tests are left) with the lanes above for choosing the next unit. pytest 9 no longer lets
    xdist tag a node id with its `xdist_group`, so a unit's scope is read from the groups the
    workers wrote (`group_items`), by module."""

    def __init__(self, config: pytest.Config, log=None, groups_file: str | None = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False    # units in collection order (group_items'), not by size
        self.groups_file, self.groups = groups_file, None

    def schedule(self) -> None:
        if self.groups is None and self.collection_is_completed:
            with open(self.groups_file) as f:
                self.groups = json.load(f)
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::")[0]
        return self.groups.get(module, module)

    def _running(self, node) -> set[str]:
        return {scope for scope, tests in self.assigned_work.get(node, {}).items() if not all(tests.values())}

    def _pick(self, node) -> str | None:
        busy = set().union(*(self._running(other) for other in self.assigned_work if other is not node))
        allowed = [scope for scope in self.workqueue
                   if not (scope in NOT_TOGETHER and busy & (NOT_TOGETHER - {scope}))]
        if not allowed:
            return None
        mine = LANES["gw0" if node.gateway.id == "gw0" else "other"]
        lanes = {scope for lane in LANES.values() for scope in lane}
        return next((s for s in mine if s in allowed), None) \
            or next((s for s in allowed if s not in lanes), allowed[0])

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is None:            # only units that may not run beside another worker's: wait
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        super()._reschedule(node)
        # a worker left waiting by NOT_TOGETHER is refilled when another one's unit ends
        for other in self.assigned_work:
            if other is not node and not other.shutting_down and self.workqueue \
                    and self._pending_of(self.assigned_work[other]) == 0:
                self._assign_work_unit(other)
