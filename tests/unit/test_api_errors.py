"""Every failure the ingress meets becomes an OpenAI-style JSON error: a dead worker is a 503
with Retry-After (the client may try again), a request's own fault a 400, anything else a JSON
500 - never Starlette's plain-text one (issue 23)."""
from __future__ import annotations

import asyncio
import json

from ray.exceptions import RayActorError

from kvmesh.cluster.errors import WorkerFailed
from kvmesh.cluster.openai.ingress import _unhandled, to_api_error
from kvmesh.workers.errors import EngineDeadError
from kvmesh.workers.sampling.params import InvalidRequestError


def test_a_dead_worker_is_a_503_with_retry_after():
    for error in (RayActorError(), EngineDeadError("engine loop died"), WorkerFailed("retries did not complete it")):
        err = to_api_error(error, 7)
        assert err.status == 503 and err.headers == {"Retry-After": "7"} and err.code == "worker_failed", error


def test_a_requests_own_fault_is_a_400_naming_the_field():
    err = to_api_error(InvalidRequestError("too big", "response_format"), 1)
    assert err.status == 400 and err.param == "response_format"


def test_an_unhandled_error_outside_the_request_path_is_a_json_body():
    for error, status in ((RuntimeError("boom"), 500), (RayActorError(), 503)):
        response = asyncio.run(_unhandled(None, error))
        body = json.loads(response.body)
        assert response.status_code == status and set(body["error"]) == {"message", "type", "param", "code"}
