"""A read that hangs (here: opening a FIFO nobody writes to) ends in IoTimeoutError at
the deadline instead of hanging its caller; the next call gets a fresh worker."""
from __future__ import annotations

import os

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
