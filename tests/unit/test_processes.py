"""workers/processes.py: local children are forks of a preloaded fork server, with their
parent's environment at their start."""
from __future__ import annotations

import multiprocessing
import os
import sys

from kvmesh.workers.processes import PRELOAD, start_child


def _report(conn) -> None:
    preloaded = [m for m in PRELOAD if m in sys.modules]       # before this child imports anything
    conn.send((os.getppid(), preloaded, os.environ.get("KVMESH_TEST_PROCESSES")))
    conn.close()


def _child(value: str | None):
    if value is None:
        os.environ.pop("KVMESH_TEST_PROCESSES", None)
    else:
        os.environ["KVMESH_TEST_PROCESSES"] = value
    parent, child = multiprocessing.Pipe()
    p = start_child(_report, (child,), "kvmesh-test-child")
    child.close()
    try:
        return parent.recv()
    finally:
        p.join(timeout=30)
        assert p.exitcode == 0


def test_a_child_is_a_fork_of_the_preloaded_server_with_its_parents_environment_now():
    try:
        first_parent, preloaded, seen = _child("one")
        assert seen == "one"
        assert first_parent != os.getpid()              # the fork server's child, not this process's
        assert set(preloaded) == set(PRELOAD)           # imported there once, not in the child
        # the server kept the environment of its start; the child still gets this process's now
        second_parent, _, seen = _child("two")
        assert seen == "two" and second_parent == first_parent
        assert _child(None)[2] is None
    finally:
        os.environ.pop("KVMESH_TEST_PROCESSES", None)
