"""Hostile guided-decoding load over HTTP (issue 31, item 3): three schemas that compile past
their budget, sent at once, hold at most all but one of the worker's compiler processes; a small
schema sent behind them answers within 2 s of what it takes alone, a plain request does not
stall, each slow one is a 400 naming its budget, and /metrics shows the pool's counters. The
refusals are one WARNING line in the replica's log, no tracebacks (issue 48 item 5).

Requests waiting for their grammar hold no serving slot (issue 48 item 1): with two slots, four
slow schemas from one client wait beside them while plain requests are served, a fifth gets a 429
at once, and a refused schema sent again is a 400 with no compile.

The session's Ray + Serve, the default tiny app (colocated), with a short compile budget and two
compiler processes (one kept for small schemas), so the slow ones end in seconds; two serving slots,
four grammar waits per client (every request here comes from 127.0.0.1: one client).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.integration.chaos_cluster import per_worker, scrape
from tests.local_serve import small_config

pytestmark = pytest.mark.slow     # a Serve app

BUDGET_S = 2.0
SLACK_S = 2.0          # the bound: a small schema behind slow ones within 2 s of its own time
SLOTS = 2
PER_CLIENT = 4


def wide(n: int, tag: str) -> dict:
    """n required properties: 1,000 compile far past BUDGET_S on any machine (and stay under the
    64 KiB schema limit). `tag` makes each a schema of its own (no cache hit, no coalescing)."""
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)},
            "required": [f"{tag}_{i}" for i in range(n)]}


def small(tag: str) -> dict:
    return {"type": "object", "properties": {tag: {"type": "boolean"}}, "required": [tag],
            "additionalProperties": False}


@pytest.fixture(scope="module")
def url(local_serve):
    engine = {"grammar_compile_timeout_s": BUDGET_S, "grammar_compile_workers": 2,
              "grammar_compile_memory_bytes": "8GiB"}
    pool = {"max_ongoing_requests": SLOTS, "max_grammar_waiting": 8, "grammar_waiting_per_client": PER_CLIENT}
    return local_serve.deploy("hostile-grammar", small_config("colocated", engine=engine, colocated=pool),
                              "/hostile-grammar")


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as c:
        yield c


def complete(http: httpx.Client, url: str, schema: dict | None) -> tuple[httpx.Response, float]:
    """A short completion (guided by `schema` when given); (response, seconds)."""
    body = {"model": http.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": "{", "max_tokens": 8, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    t0 = time.monotonic()
    r = http.post(f"{url}/v1/completions", json=body)
    return r, time.monotonic() - t0


def grammar_metric(url: str, name: str) -> float:
    return worker_metric(url, f"grammar_{name}")


def worker_metric(url: str, name: str) -> float:
    return sum(per_worker(scrape(url), name, "colocated").values())


def test_a_small_schema_behind_three_slow_ones_answers_promptly_and_nothing_stalls(url, http):
    assert complete(http, url, small("warm"))[0].status_code == 200         # the pool is up
    deadline = time.monotonic() + 120
    while grammar_metric(url, "processes") < 2:
        assert time.monotonic() < deadline, "the compiler processes did not start"
        time.sleep(0.5)
    r, alone = complete(http, url, small("alone"))                          # its own compile + reply
    assert r.status_code == 200
    _, plain_alone = complete(http, url, None)
    kills = grammar_metric(url, "budget_kills")

    with ThreadPoolExecutor(5) as pool:
        slow = [pool.submit(complete, http, url, wide(1000, f"s{i}")) for i in range(3)]
        time.sleep(0.5)                                                     # they are compiling / queued
        assert grammar_metric(url, "running") >= 1
        behind = pool.submit(complete, http, url, small("behind"))
        plain = pool.submit(complete, http, url, None)
        r, took = behind.result()
        assert r.status_code == 200, r.text
        assert took <= alone + SLACK_S, (took, alone)
        assert not all(f.done() for f in slow)                              # not queued behind them
        r, plain_took = plain.result()
        assert r.status_code == 200 and plain_took <= plain_alone + SLACK_S, (plain_took, plain_alone)
        for f in slow:
            r, _ = f.result()
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "response_format" and f"time budget of {BUDGET_S:g} s" in err["message"]
    assert grammar_metric(url, "budget_kills") == kills + 3
    assert grammar_metric(url, "waiting") == 0
    # the pool's Serve log: the three refusals are one WARNING line, no "Request failed." traceback
    deadline = time.monotonic() + 10
    while "request refused: response_format" not in (text := replica_log("hostile-grammar")):
        assert time.monotonic() < deadline, "no refusal line in the replica's log"
        time.sleep(0.2)
    assert text.count("request refused: response_format") == 1, text[-3000:]
    assert "Request failed." not in text and "CompileBudgetExceeded" not in text, text[-3000:]


def replica_log(app: str) -> str:
    """Every Serve replica log of `app`'s deployments in this Ray session, concatenated."""
    import ray
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"replica_{app}_*.log")))



def test_grammar_waits_hold_no_serving_slot_and_a_client_past_its_bound_gets_a_429(url, http):
    assert complete(http, url, None)[0].status_code == 200
    kills = grammar_metric(url, "budget_kills")
    with ThreadPoolExecutor(PER_CLIENT + 1 + 2 * SLOTS) as pool:
        slow = [pool.submit(complete, http, url, wide(1000, f"w{i}")) for i in range(PER_CLIENT)]
        deadline = time.monotonic() + 60
        while worker_metric(url, "grammar_gate_waiting") < PER_CLIENT:
            assert time.monotonic() < deadline, "the slow schemas never waited"
            time.sleep(0.1)
        assert worker_metric(url, "serving") == 0                  # waiting for a grammar holds no slot
        r, _ = complete(http, url, wide(1000, "over"))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
        assert "grammar_waiting_per_client: 4" in r.json()["error"]["message"]
        plain = [pool.submit(complete, http, url, None) for _ in range(2 * SLOTS)]     # more than the slots
        assert all(f.result()[0].status_code == 200 for f in plain)
        assert not all(f.done() for f in slow)                      # served while the compiles still ran
        for f in slow:
            r, _ = f.result()
            assert r.status_code == 400 and "time budget" in r.json()["error"]["message"], r.text
    assert grammar_metric(url, "budget_kills") == kills + PER_CLIENT    # the 429'd one never compiled
    assert worker_metric(url, "grammar_busy_refusals") >= 1
    r, _ = complete(http, url, wide(1000, "w0"))                    # refused before: a 400, no compile
    assert r.status_code == 400 and grammar_metric(url, "budget_kills") == kills + PER_CLIENT
    assert worker_metric(url, "grammar_gate_waiting") == 0 and worker_metric(url, "serving") == 0
