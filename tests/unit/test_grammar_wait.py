"""A guided request waits for its grammar outside the batch (issue 31): while its schema
compiles it holds no batch slot, the engine keeps stepping the other requests and no step waits
for the compile; once compiled it joins, and a compile over its budget fails that request only.
In a DP=2+EP engine the rank that runs the request compiles it in its own pool and parks the
request there, never inside the lockstep step (which used to pause every request of the replica
for the whole compile)."""
from __future__ import annotations

import json
import time

import pytest

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.sampling.params import SamplingParams

NAME = "swa_csa_hca"
SHORT = random_prompt(23, seed=3)
PLAIN = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BUDGET = dict(grammar_compile_timeout_s=4.0, grammar_compile_memory_bytes="8GiB")
STEP_LIMIT_S = 1.5      # a tiny model's step is milliseconds; the compiles below take seconds


def schema(n: int, required: bool) -> str:
    """n string properties: 1,000 required compile for far longer than the budget on any machine;
    a few optional ones compile in milliseconds (still after the request was parked for them)."""
    props = {f"field_{i}": {"type": "string"} for i in range(n)}
    extra = {"required": sorted(props)} if required else {"additionalProperties": False}
    return json.dumps({"type": "object", "properties": props, **extra}, sort_keys=True)


def guided(text: str) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, guide=("json_schema", text))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def run(engine, until_done: set[str], parked: callable) -> tuple[dict, list[str], float]:
    """Step until every id in `until_done` finished: (final outputs, ids that finished while
    `parked()` was true, slowest step in seconds)."""
    final, early, slowest = {}, [], 0.0
    deadline = time.monotonic() + 120
    while not until_done <= final.keys():
        assert time.monotonic() < deadline
        t0 = time.monotonic()
        outs = engine.step()
        slowest = max(slowest, time.monotonic() - t0)
        for out in outs:
            if out.finished:
                final[out.request_id] = out
                if parked():
                    early.append(out.request_id)
    return final, early, slowest


def test_a_request_waits_for_its_grammar_outside_the_batch_while_the_others_step(model_dir):
    engine = tiny_engine(model_dir, NAME, grammar_compile_workers=2, **BUDGET)
    try:
        engine.guides.compile(("json_object", ""))                  # the compiler processes are up
        engine.generate([SHORT], PLAIN)                             # and the first (slow) step is over
        engine.add_request("slow", SHORT, guided(schema(1000, required=True)), wait=False)
        engine.add_request("fine", SHORT, guided(schema(3, required=False)), wait=False)
        assert engine.stats().grammar.waiting == 2 and not engine.scheduler.has_work()   # no batch slot held
        for i in range(3):
            engine.add_request(f"plain-{i}", SHORT, PLAIN)
        final, early, slowest = run(engine, {"slow", "fine", "plain-0", "plain-1", "plain-2"},
                                    lambda: engine.stats().grammar.waiting > 0)
        assert {"plain-0", "plain-1", "plain-2"} <= set(early)     # served while the schemas compiled
        assert slowest < STEP_LIMIT_S                               # no step waited for a compile
        assert final["slow"].finish_reason == "error" and "time budget of 4 s" in final["slow"].error
        assert final["fine"].error is None and final["fine"].finish_reason in ("stop", "length")
        assert not engine.has_unfinished() and engine.stats().grammar.budget_kills == 1
    finally:
        engine.close()


def test_an_aborted_request_leaves_the_wait_and_holds_nothing(model_dir):
    engine = tiny_engine(model_dir, NAME, **BUDGET)
    try:
        engine.add_request("slow", SHORT, guided(schema(1000, required=True)), wait=False)
        engine.abort("slow")
        assert not engine.has_unfinished() and engine.stats().idle and not engine.seqs
    finally:
        engine.close()


def test_forks_of_a_parked_request_each_follow_the_grammar_from_its_start(model_dir):
    engine = tiny_engine(model_dir, NAME, grammar_compile_workers=1)
    try:
        ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=2, guide=("json_schema", json.dumps(ok)))
        engine.add_request("forks", SHORT, params, wait=False)
        assert engine.stats().grammar.waiting == 1
        final = {}
        while engine.has_unfinished():
            final.update({o.index: o for o in engine.step() if o.finished})
        assert sorted(final) == [0, 1]
        for out in final.values():
            assert json.loads(engine.tokenizer.decode(out.token_ids)) in ({"ok": True}, {"ok": False})
    finally:
        engine.close()


@pytest.mark.slow       # gloo process group: rank 1 is a spawned process
def test_a_data_parallel_rank_compiles_before_the_lockstep_step_and_never_inside_it(model_dir):
    engine = tiny_engine(model_dir, NAME, data_parallel_size=2, enable_expert_parallel=True,
                         grammar_compile_workers=2, **BUDGET)
    try:
        engine.generate([SHORT, SHORT], PLAIN)                      # the first (slow) steps are over
        engine.add_request("slow", SHORT, guided(schema(1000, required=True)), rank=1, wait=False)
        engine.add_request("fine", SHORT, guided(schema(3, required=False)), rank=1, wait=False)
        for rank in (0, 1, 1):
            engine.add_request(f"plain-{rank}-{time.monotonic_ns()}", SHORT, PLAIN, rank=rank)
        plain = set(engine.where) - {"slow", "fine"}
        final, early, slowest = run(engine, {"slow", "fine", *plain},
                                    lambda: engine.rank_stats[1].grammar.waiting > 0)
        assert plain <= set(early)            # both ranks stepped while rank 1's schemas compiled
        assert slowest < STEP_LIMIT_S         # the lockstep step never waited for them
        assert final["slow"].finish_reason == "error" and "time budget of 4 s" in final["slow"].error
        assert final["fine"].error is None and final["fine"].finish_reason in ("stop", "length")
        ranks = engine.rank_stats
        assert ranks[1].grammar.budget_kills == 1 and ranks[0].grammar.compiles == 0    # rank 1 compiled them
        assert not engine.has_unfinished()
    finally:
        engine.close()
