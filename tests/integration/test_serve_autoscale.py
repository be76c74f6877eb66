"""Separate autoscaling: decode load grows the decode pool without touching prefill, and
the decode pool shrinks back when idle."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from tests.local_serve import small_config

FAST_SCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1.0, "downscale_delay_s": 4.0,
                "metrics_interval_s": 0.5, "look_back_period_s": 2.0}
STREAMS = 4
GROW_WITHIN_S, SHRINK_WITHIN_S = 90.0, 90.0


def replicas(app: str, deployment: str) -> int:
    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def url(local_serve):
    config = small_config(
        "disaggregated",
        # prefill requests are short: a high target keeps this load from scaling it
        prefill={"autoscaling": {**FAST_SCALING, "target_ongoing_requests": 8}},
        decode={"autoscaling": {**FAST_SCALING, "target_ongoing_requests": 1}})
    return local_serve.deploy("scale", config, "/")


def decode_load(url: str, stop: threading.Event) -> None:
    body = {"prompt": "hello world", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            assert client.post(f"{url}/v1/completions", json=body).status_code == 200


@pytest.mark.slow
def test_decode_load_scales_decode_only_and_it_shrinks_back_when_idle(url):
    assert replicas("scale", "Decode") == 1 and replicas("scale", "Prefill") == 1
    stop = threading.Event()
    workers = [threading.Thread(target=decode_load, args=(url, stop), daemon=True) for _ in range(STREAMS)]
    for w in workers:
        w.start()
    max_prefill, deadline = 1, time.monotonic() + GROW_WITHIN_S
    try:
        while replicas("scale", "Decode") < 2 and time.monotonic() < deadline:
            max_prefill = max(max_prefill, replicas("scale", "Prefill"))
            time.sleep(0.5)
        grown = replicas("scale", "Decode")
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=120)
    assert grown == 2, "decode pool did not grow under decode load"
    assert max_prefill == 1 and replicas("scale", "Prefill") == 1, "prefill pool scaled with decode load"
    deadline = time.monotonic() + SHRINK_WITHIN_S
    while replicas("scale", "Decode") > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replicas("scale", "Decode") == 1, "decode pool did not shrink back when idle"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
