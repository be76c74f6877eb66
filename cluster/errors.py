"""The errors the cluster's parts raise across package lines: the leaf every part may import.

`APIError` is what the HTTP layer answers with OpenAI's error body; the constructors below name
the common cases. `WorkerFailed` / `WorkerStalled` are what a dispatch to the pools ends with.
"""
from __future__ import annotations


class APIError(Exception):
    """An error the API reports with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                    param="model", code="model_not_found")


def overloaded(retry_after_s: int) -> APIError:
    return APIError(503, "The server is overloaded; retry shortly.", type="overloaded_error",
                    code="overloaded", headers={"Retry-After": str(retry_after_s)})


class TooManyRequests(Exception):
    """A client is past a bound on what it may have in flight: a 429 with Retry-After
    (rate_limited builds it). Raised in a worker, it crosses Ray as a RayTaskError's cause."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return TooManyRequests, (str(self), self.retry_after_s)


def rate_limited(e: TooManyRequests) -> APIError:
    return APIError(429, str(e), type="requests", code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, e.retry_after_s))})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes "
                         "(ingress.max_body_bytes)", type="invalid_request_error", code="request_too_large")


class WorkerFailed(RuntimeError):
    """Workers kept failing for this request; the message says how."""


class WorkerStalled(RuntimeError):
    """No token arrived within token_timeout_s."""
