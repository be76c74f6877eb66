"""Failures at the HTTP edge: a decode replica killed mid-stream, and overload (503)."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import ray
from ray import serve

from tests.helpers import assert_clean_end, stream_and_kill
from tests.local_serve import small_config
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster and Serve apps

KILL_BOUND_S = 120.0      # the client hears the end of its stream within this (2 attempts x token timeout)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def urls(local_serve):
    overload = small_config("colocated", colocated={"max_ongoing_requests": 1, "max_queued_requests": 1},
                            ingress={"retry_after_s": 2})
    urls = local_serve.deploy_many({"kill": (small_config("disaggregated"), "/"), "overload": (overload, "/overload")})
    return {"disagg": urls["kill"], "overload": urls["overload"]}


def replica_actor(app: str, deployment: str):
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert names, f"no replica of {app}/{deployment}"
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def running_replicas(app: str, deployment: str) -> int:
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_decode_replica_killed_mid_stream_ends_cleanly_and_the_pool_recovers(urls):
    want = Engine(small_config().engine.engine_config()).generate(
        [PROMPT], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))[0].token_ids
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.monotonic()
    tokens, errors, _ = stream_and_kill(urls["disagg"], body,
                                        lambda: ray.kill(replica_actor("kill", "Decode"), no_restart=True),
                                        KILL_BOUND_S)
    assert_clean_end(tokens, errors, want)
    deadline = time.monotonic() + 60
    while running_replicas("kill", "Decode") < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"decode pool running again after {time.monotonic() - start:.1f}s")
    r = httpx.post(f"{urls['disagg']}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_overload_is_503_with_retry_after(urls):
    body = {"prompt": "hello", "max_tokens": 64, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{urls['overload']}/v1/completions", json=body, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in replies)
    assert 200 in codes and 503 in codes, codes
    assert set(codes) <= {200, 503}
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["retry-after"] == "2"
    assert busy.json()["error"]["type"] == "overloaded_error"
