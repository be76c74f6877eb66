"""What a kvmesh replica logs when a request ends in an exception.

Ray Serve logs every exception a deployment method raises as ERROR "Request failed." with its
whole traceback (ray/serve/_private/replica.py), and most of them are no internal error here:

* a refusal — InvalidRequestError from the engine (a schema past its compile budget, a prompt too
  long, ...) is the client's mistake, answered with a 400, and TooManyRequests (a client past its
  bound of grammars compiling, cluster/serve/grammar_gate.py) a 429: one WARNING line, no traceback, at most
  one per cause (kind + field) every REFUSAL_EVERY_S, the next one counting those held back;
* a cancel — the client went away (TaskCancelledError, RequestCancelledError): no error at all
  (a DEBUG line; Serve's access line already says CANCELLED);
* anything else keeps Serve's ERROR and traceback.

`RequestLogFilter` does that on Serve's logger; `install()` puts it there: every kvmesh
deployment's constructor calls it (Serve has set up its logger by then and never touches a
logger's filters; Ray's `worker_process_setup_hook` is honoured only in `ray.init`'s job-wide
runtime_env, not per actor). `is_cancel` / `is_refusal` tell the ingress the same.
"""
from __future__ import annotations

import asyncio
import logging

from kvmesh.cluster.errors import TooManyRequests
from kvmesh.kvstore.log_once import RateLimit
from kvmesh.workers.sampling.params import InvalidRequestError

SERVE_LOGGER = "ray.serve"
REFUSAL_EVERY_S = 60.0
MAX_MESSAGE = 300          # characters of a refusal's message in its line


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e        # RayTaskError carries the worker's exception


def is_cancel(e: BaseException) -> bool:
    """The request's client went away (or its caller cancelled it): nothing failed."""
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError
    kinds = (asyncio.CancelledError, TaskCancelledError, RequestCancelledError)
    return isinstance(e, kinds) or isinstance(_cause(e), kinds)


def is_refusal(e: BaseException) -> bool:
    """The worker refused the request (a 400 or a 429 names why)."""
    return isinstance(_cause(e), (InvalidRequestError, TooManyRequests))


def refusal_cause(e: BaseException) -> str:
    """A refusal's rate-limit key: its kind and field, never its text (bounded)."""
    cause = _cause(e)
    return f"{type(cause).__name__}:{getattr(cause, 'field', None) or '-'}"


def refusal_line(e: BaseException) -> str:
    text = str(_cause(e)).split("\n")[0]
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


class RequestLogFilter(logging.Filter):
    """On Serve's logger: a refusal's record becomes one WARNING line without traceback (held
    back within its cause's period), a cancel's is dropped (kept at DEBUG when that is enabled);
    every other record passes as it is."""

    def __init__(self, limit: RateLimit | None = None):
        super().__init__()
        self.limit = limit or RateLimit(REFUSAL_EVERY_S)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.levelno < logging.ERROR or record.exc_info[1] is None:
            return True
        e = record.exc_info[1]
        if is_cancel(e):
            self._rewrite(record, logging.DEBUG, "request cancelled (%s): the client went away",
                          (type(_cause(e)).__name__,))
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        if is_refusal(e):
            held = self.limit.allow(refusal_cause(e))
            if held is None:
                return False
            self._rewrite(record, logging.WARNING, "request refused: %s%s", (refusal_line(e), self.limit.suffix(held)))
        return True

    @staticmethod
    def _rewrite(record: logging.LogRecord, level: int, msg: str, args: tuple) -> None:
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.msg, record.args = msg, args
        record.exc_info = record.exc_text = record.stack_info = None


def install(logger_name: str = SERVE_LOGGER) -> RequestLogFilter:
    """Put one RequestLogFilter on the logger (idempotent); returns it."""
    logger = logging.getLogger(logger_name)
    for f in logger.filters:
        if isinstance(f, RequestLogFilter):
            return f
    f = RequestLogFilter()
    logger.addFilter(f)
    return f
