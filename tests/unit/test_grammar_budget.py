"""One request's response_format must not take the engine down (issue 23): a schema over the
size limit is refused before any work; a schema whose compile runs past its time or memory
budget is stopped (the compile runs in a child process) and answered with an error naming
`response_format`; the engine serves other requests meanwhile and afterwards."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.engine.async_engine import AsyncEngine
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams

NAME = "swa_csa_hca"
SHORT = random_prompt(23, seed=3)
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def wide(n: int) -> str:
    """n required string properties: xgrammar's compile cost grows steeply with n (500 of them
    take seconds and over a GiB with this tokenizer; the issue's 13,000 took ~20 GB)."""
    return json.dumps({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(n)},
                       "required": [f"field_{i}" for i in range(n)]}, sort_keys=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def guided(schema: str) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, guide=("json_schema", schema))


def test_a_schema_over_the_size_limit_is_refused_before_any_compile(model_dir):
    engine = tiny_engine(model_dir, NAME, max_schema_bytes=4096)
    with pytest.raises(InvalidRequestError, match="over the limit of 4096") as e:
        engine.add_request("big", SHORT, guided(wide(200)))
    assert e.value.field == "response_format"
    assert engine.guides._pool is None and not engine.seqs      # nothing started, nothing queued
    assert engine.generate([SHORT], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("budget, what", [(dict(grammar_compile_memory_bytes="700MiB"), "memory budget of 700 MiB"),
                                          (dict(grammar_compile_timeout_s=0.5), "time budget of 0.5 s")])
def test_a_compile_over_its_budget_is_stopped_and_the_engine_serves_on(model_dir, budget, what):
    engine = tiny_engine(model_dir, NAME, **budget)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=what) as e:
        engine.add_request("wide", SHORT, guided(wide(500)))
    assert e.value.field == "response_format" and engine.guides.stats().budget_kills == 1
    assert time.monotonic() - t0 < 30
    out = engine.generate([SHORT], guided(json.dumps(SMALL, sort_keys=True)))[0]    # a fresh compiler process
    assert json.loads(engine.tokenizer.decode(out.token_ids)) in ({"ok": True}, {"ok": False})
    engine.close()


def test_a_refused_schema_is_remembered_and_refused_again_without_a_compile(model_dir):
    """Sent again, a schema refused at its budget is the same 400 from memory: no compile starts
    (the pool's compiles and kills stay), the counter says so; a schema that cannot compile at
    all is remembered too; another schema still compiles."""
    engine = tiny_engine(model_dir, NAME, grammar_compile_timeout_s=0.5)
    with pytest.raises(InvalidRequestError, match="time budget of 0.5 s") as first:
        engine.add_request("wide", SHORT, guided(wide(500)))
    before = engine.guides.stats()
    for i in range(3):
        with pytest.raises(InvalidRequestError) as again:
            engine.add_request(f"wide-{i}", SHORT, guided(wide(500)))
        assert str(again.value) == str(first.value) and again.value.field == "response_format"
    after = engine.guides.stats()
    assert (after.compiles, after.budget_kills, after.queued, after.running) == \
        (before.compiles, before.budget_kills, before.queued, before.running)
    assert after.refusals_remembered == 3 and not engine.seqs
    bad = json.dumps({"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}})
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="cannot be compiled"):
            engine.add_request("bad", SHORT, guided(bad))
    assert engine.guides.stats().refusals_remembered == 4
    out = engine.generate([SHORT], guided(json.dumps(SMALL, sort_keys=True)))[0]
    assert json.loads(engine.tokenizer.decode(out.token_ids)) in ({"ok": True}, {"ok": False})
    engine.close()


def test_the_async_engine_compiles_off_its_loop_so_other_requests_go_on(model_dir):
    # 1,000 properties compile for well over the 3 s budget on any machine (500 took 2-4 s,
    # depending on load), so the time budget, not the machine's speed, ends the compile; the
    # memory budget is raised so it cannot end it first
    engine = AsyncEngine(engine=tiny_engine(model_dir, NAME, grammar_compile_timeout_s=3.0,
                                            grammar_compile_memory_bytes="8GiB"))
    engine.engine.guides.compile(("json_schema", json.dumps(SMALL)))      # the compiler processes are up
    while engine.engine.guides.stats().processes < engine.engine.guides._pool.size:
        time.sleep(0.05)

    async def run(rid: str, params: SamplingParams) -> float:
        async for out in engine.generate(rid, SHORT, params):
            if out.all_finished:
                break
        return time.monotonic()

    async def both():
        await run("warm", GREEDY)                  # the first (slow) step is over
        slow = asyncio.create_task(run("wide", guided(wide(1000))))
        await asyncio.sleep(0.2)
        plain = [await run(f"plain-{i}", GREEDY) for i in range(3)]
        with pytest.raises(InvalidRequestError, match="time budget"):
            await slow
        return plain[-1], time.monotonic()

    try:
        plain_done, slow_done = asyncio.run(both())
        assert plain_done < slow_done - 1.0     # served while the big schema was compiling
    finally:
        engine.shutdown()
