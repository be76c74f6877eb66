"""Serve under clients that vanish and a Redis that answers with errors: 200 clients
disconnect at random points (mid-body, before the first byte, mid-prefill, around the
handoff, mid-stream); afterwards no pool holds a request, every slot and block is free
again within the release timeout, and a normal request completes with the cold tokens.
Streams dropped right after their first token (before decode has read the handoff) leave no
cache held on prefill well before the release timeout, and none is released by it (issue 48
item 3). Redis error replies (OOM, READONLY) never fail a request. Bodies over the limit are 413."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from ray import serve

from tests.integration.test_index_faults import out_of_memory, read_only
from tests.local_serve import drop_after_first_token, small_config
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine.stats import EngineStats
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster and a Serve app

RELEASE_TIMEOUT_S = 5.0
CLIENTS = 200
DROPPED = 24        # streams dropped after their first token: more than decode's max_ongoing_requests (16)
BODY_LIMIT = 64 << 10
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6          # a few blocks with the byte tokenizer
GREEDY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def app(password_redis, tmp_path_factory, local_serve):
    client, url = password_redis
    config = small_config("disaggregated", engine={"store": str(tmp_path_factory.mktemp("store")), "index": url},
                          handoff={"release_timeout_s": RELEASE_TIMEOUT_S},
                          ingress={"max_body_bytes": BODY_LIMIT, "num_cpus": 0.1, "token_timeout_s": 30.0})
    return local_serve.deploy("disconnects", config, "/"), local_serve.port, client, config


@pytest.fixture(scope="module")
def cold(app):
    config = app[3].engine.model_copy(update={"store": None, "index": "local"})
    return Engine(config.engine_config()).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids


def pool_state(name: str) -> EngineStats:
    return pool_stats(name).engine


def pool_stats(name: str):
    return serve.get_deployment_handle(name, app_name="disconnects").stats.remote().result(timeout_s=30)


async def vanishing_client(port: int, rng: random.Random) -> str:
    how = rng.choice(["mid_body", "early", "early", "mid_stream"])
    stream = how == "mid_stream" or rng.random() < 0.5
    body = json.dumps({**GREEDY, "max_tokens": rng.randint(4, 40), "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if how == "mid_body":
            writer.write(head + body[:len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
        elif how == "early":     # before the first byte: in the queue, mid-prefill or around the handoff
            writer.write(head + body)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.6))
        else:
            writer.write(head + body)
            await writer.drain()
            await asyncio.wait_for(reader.readuntil(b"data: "), 60)
            await asyncio.wait_for(reader.read(rng.randint(1, 400)), 60)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.transport.abort()        # a hard drop, as a client that goes away does
    return how


async def run_clients(port: int) -> list[str]:
    rng = random.Random(15)

    async def one(i: int) -> str:
        await asyncio.sleep(rng.uniform(0, 8))      # spread over a few seconds: all phases overlap
        return await vanishing_client(port, random.Random(i))
    return await asyncio.gather(*(one(i) for i in range(CLIENTS)))


@pytest.mark.slow
def test_clients_that_disconnect_anywhere_leave_no_held_kv_and_the_service_serves(app, cold):
    url, port, _, _ = app
    kinds = asyncio.run(asyncio.wait_for(run_clients(port), 300))
    print({k: kinds.count(k) for k in set(kinds)})
    deadline = time.monotonic() + RELEASE_TIMEOUT_S + 60
    while True:
        states = {name: pool_state(name) for name in ("Prefill", "Decode")}
        if all(s.idle for s in states.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(states)
    assert all(s.idle for s in states.values()), states
    r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == cold


def wait_until(ready, within_s: float, every_s: float = 0.05):
    """Poll `ready()` until it returns a truthy value or `within_s` passes; its last value."""
    deadline = time.monotonic() + within_s
    while not (value := ready()) and time.monotonic() < deadline:
        time.sleep(every_s)
    return value


def test_streams_dropped_after_their_first_token_leave_no_cache_held_on_prefill(app):
    """Prefill holds each handoff's cache until decode reads it. A client that drops its stream
    right after the first token (before decode has read the cache, often before decode's call
    left the ingress's queue) must not leave it held until `release_timeout_s`: every hold is
    gone well before that timeout, and the prefill worker counts no release by timeout."""
    port = app[1]
    assert wait_until(lambda: pool_stats("Prefill").engine.held == 0, RELEASE_TIMEOUT_S + 30)   # earlier tests' holds
    before = pool_stats("Prefill").held_timeouts

    async def drops():
        body = {**GREEDY, "max_tokens": 200, "stream": True}
        got = await asyncio.wait_for(asyncio.gather(*(drop_after_first_token(port, body) for _ in range(DROPPED))), 300)
        assert all(got), "a stream ended before its first token"
    asyncio.run(drops())
    # a hold that waited for the timeout would still be there at RELEASE_TIMEOUT_S / 2 after the last drop
    assert wait_until(lambda: pool_stats("Prefill").engine.held == 0, RELEASE_TIMEOUT_S / 2), \
        f"prefill still holds {pool_stats('Prefill').engine.held} caches"
    assert pool_stats("Prefill").held_timeouts == before
    assert wait_until(lambda: pool_state("Decode").idle, 60)


@pytest.mark.parametrize("fault", [out_of_memory, read_only], ids=["oom", "readonly"])
def test_serve_keeps_serving_through_redis_error_replies(app, cold, fault):
    url, _, client, _ = app
    with fault(client):
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == cold
    r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == cold


def test_a_body_over_the_limit_is_413_declared_or_streamed(app):
    url = app[0]
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}).encode()
    r = httpx.post(f"{url}/v1/completions", content=big, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                       # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
