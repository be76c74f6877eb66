"""A read that hangs (here: opening a FIFO nobody writes to) ends in IoTimeoutError at
the deadline instead of hanging its caller; the next call gets a fresh worker."""
from __future__ import annotations

import os
import threading

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
