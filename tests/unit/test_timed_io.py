"""A read that hangs (here: opening a FIFO nobody writes to) ends in IoTimeoutError at
the deadline instead of hanging its caller; the next call gets a fresh worker."""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvmesh.kvstore.timed_io import IoTimeoutError, TimedRunner


def test_a_hung_read_times_out_and_the_runner_keeps_working(tmp_path):
    fifo = tmp_path / "hang"
    os.mkfifo(fifo)
    runner = TimedRunner(0.2)
    try:
        with pytest.raises(IoTimeoutError):
            runner.run(lambda: open(fifo, "rb").read())   # blocks in open(2) until a writer comes
        assert runner.abandoned == 1
        assert runner.run(lambda: 42) == 42
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)    # release the abandoned worker
        os.close(fd)


def test_errors_of_the_call_reach_the_caller():
    def boom():
        raise PermissionError("nope")
    with pytest.raises(PermissionError):
        TimedRunner(1.0).run(boom)


def test_meanwhile_runs_beside_the_call_and_a_hang_still_times_out(tmp_path):
    runner = TimedRunner(0.5)
    started, seen = threading.Event(), []

    def call():
        started.set()
        return "read"

    def meanwhile(deadline):
        seen.append(started.wait(1.0))      # the call runs while this does, on another thread
    assert runner.run(call, meanwhile=meanwhile) == "read" and seen == [True]

    fifo = tmp_path / "hang"
    os.mkfifo(fifo)
    waited = []
    try:
        with pytest.raises(IoTimeoutError):
            runner.run(lambda: open(fifo, "rb").read(), meanwhile=lambda d: waited.append(
                threading.Event().wait(max(0.0, d - time.monotonic()))))
        assert waited == [False]        # it got the deadline, and the runner's wait after it is not longer
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_parallel_calls_run_side_by_side_and_no_more():
    from concurrent.futures import ThreadPoolExecutor
    runner = TimedRunner(5.0, parallel=2)
    a, b = threading.Event(), threading.Event()
    both = [lambda: (a.set(), b.wait(3))[1], lambda: (b.set(), a.wait(3))[1]]     # each waits for the other
    with ThreadPoolExecutor(3) as ex:
        assert list(ex.map(runner.run, both)) == [True, True]
        running, gate, peak, lock = [0], threading.Event(), [], threading.Lock()

        def counted():
            with lock:
                running[0] += 1
                peak.append(running[0])
            gate.wait(0.2)
            with lock:
                running[0] -= 1
        list(ex.map(runner.run, [counted] * 3))
    assert max(peak) == 2       # the third waited for a worker
