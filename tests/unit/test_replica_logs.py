"""What a replica logs for a request that ends in an exception (cluster/serve/replica_logs.py):
a refusal is one WARNING line without traceback, at most one per cause per period, the next one
counting those held back; a cancel is no error; anything else keeps its ERROR and traceback.
Records go through a real logger and handler, as Serve's "Request failed." records do."""
from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import RayTaskError, TaskCancelledError

from kvmesh.cluster.serve.replica_logs import RequestLogFilter, install, is_cancel, is_refusal
from kvmesh.kvstore.log_once import RateLimit
from kvmesh.workers.sampling.params import InvalidRequestError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """What a handler writes: each record formatted, traceback included."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def served():
    """A logger like Serve's, with the filter and a handler; the clock drives the rate limit."""
    logger = logging.getLogger("kvmesh.test.replica_logs")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    clock, handler = Clock(), Lines()
    f = RequestLogFilter(RateLimit(60.0, clock=clock))
    logger.addFilter(f)
    logger.addHandler(handler)
    yield logger, clock, handler
    logger.removeFilter(f)
    logger.removeHandler(handler)


def failed(logger: logging.Logger, e: BaseException) -> None:
    """Serve's replica logs a failed request like this (logger.exception in replica.py)."""
    try:
        raise e
    except BaseException:
        logger.exception("Request failed.")


def refusal(field: str, text: str = "x") -> InvalidRequestError:
    return InvalidRequestError(f"the schema did not compile within its budget ({text})", field=field)


def test_a_refusal_is_one_warning_line_per_cause_and_period_counting_the_ones_held_back(served):
    logger, clock, out = served
    for _ in range(5):
        failed(logger, refusal("response_format", "a" * 18_000))        # an 18 KB request's refusal
    failed(logger, refusal("tools"))                                     # another cause: its own line
    clock.now = 61.0
    failed(logger, refusal("response_format"))
    assert [line.split(":")[0] for line in out.lines] == ["WARNING request refused"] * 3
    assert all("Traceback" not in line and len(line) < 400 for line in out.lines)
    assert "response_format: the schema did not compile" in out.lines[0] and "tools:" in out.lines[1]
    assert out.lines[2].endswith("(4 more like it since the last such line, not logged)")


def test_a_cancel_is_no_error_and_other_failures_keep_their_traceback(served):
    logger, _, out = served
    failed(logger, TaskCancelledError())
    failed(logger, asyncio.CancelledError())
    assert out.lines == []                                              # below the logger's INFO
    logger.setLevel(logging.DEBUG)
    failed(logger, TaskCancelledError())
    assert len(out.lines) == 1 and out.lines[0].startswith("DEBUG request cancelled (TaskCancelledError)")
    failed(logger, RuntimeError("the engine broke"))
    assert out.lines[1].startswith("ERROR Request failed.") and "Traceback" in out.lines[1]
    assert "RuntimeError: the engine broke" in out.lines[1]


def test_a_workers_refusal_or_cancel_wrapped_by_ray_is_told_apart():
    wrapped = RayTaskError("decode", "traceback text", refusal("max_tokens"))
    assert is_refusal(wrapped) and not is_cancel(wrapped)
    assert is_cancel(TaskCancelledError()) and not is_refusal(TaskCancelledError())
    assert not is_refusal(RuntimeError("x")) and not is_cancel(RuntimeError("x"))


def test_install_puts_one_filter_on_a_logger():
    name = "kvmesh.test.replica_logs.install"
    first = install(name)
    assert install(name) is first
    assert sum(isinstance(f, RequestLogFilter) for f in logging.getLogger(name).filters) == 1
    logging.getLogger(name).removeFilter(first)


def test_the_rate_limit_keeps_a_bounded_table_of_causes():
    clock = Clock()
    limit = RateLimit(60.0, max_causes=3, clock=clock)
    assert [limit.allow(c) for c in "abcd"] == [0, 0, 0, 0]
    assert len(limit._causes) == 3 and "a" not in limit._causes           # the oldest went
    assert limit.allow("b") is None and limit.allow("b") is None
    clock.now = 60.0
    assert limit.allow("b") == 2 and limit.allow("b") is None
