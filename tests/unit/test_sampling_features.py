"""vLLM's sampling features in the engine: n forks sharing the prompt's blocks, penalties,
min_p, logit_bias, top-N logprobs, grammar-guided JSON; the batch sampler's math."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
from kvmesh.workers.sampling.sampler import SampleRow, sample_batch

NAME, BLOCK = "swa_csa_hca", 16
PROMPT = random_prompt(100, seed=3)          # 6 full blocks + a partial one
SHORT = random_prompt(23, seed=3)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    return tiny_engine(path, NAME)


def greedy(engine: Engine, prompt, **kw) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw))[0].token_ids


def test_n_forks_share_the_prompt_blocks_and_sample_different_sequences(engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4, ignore_eos=True)
    free = engine.blocks.num_free
    engine.add_request("fork", PROMPT, params)
    outs = []
    while not outs:
        outs = engine.step()
    full = len(PROMPT) // BLOCK
    # one prefill: the 6 full blocks are shared (refcount 4), each fork copies only the partial block
    assert free - engine.blocks.num_free == full + 4
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    shared = engine.groups["fork"][0].blocks[:full]
    assert all(engine.blocks.ref[b] == 4 for b in shared)
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.index] = o
    assert len(final) == 4 and all(len(o.token_ids) == 6 for o in final.values())
    assert len({tuple(o.token_ids) for o in final.values()}) == 4
    assert engine.blocks.num_free == free and all(engine.blocks.ref[b] == 0 for b in shared)


def test_n_greedy_forks_equal_the_single_greedy_run(engine):
    want = greedy(engine, PROMPT)
    outs = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=3))
    assert [o.token_ids for o in outs] == [want] * 3 and [o.index for o in outs] == [0, 1, 2]


def test_seeded_forks_are_reproducible(engine):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, ignore_eos=True)
    a = [o.token_ids for o in engine.generate([SHORT], params)]
    b = [o.token_ids for o in engine.generate([SHORT], params)]
    assert a == b


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.0), dict(presence_penalty=1.5),
                                dict(repetition_penalty=1.5)])
def test_penalties_break_a_repetitive_greedy_continuation(engine, kw):
    plain = greedy(engine, SHORT)
    assert len(set(plain)) < len(plain)                  # the plain continuation repeats itself
    penalized = greedy(engine, SHORT, **kw)
    assert penalized != plain and len(set(penalized)) > len(set(plain))


def test_logit_bias_forces_and_forbids_tokens(engine):
    plain = greedy(engine, SHORT)
    assert set(greedy(engine, SHORT, logit_bias=((7, 100.0),))) == {7}
    banned = greedy(engine, SHORT, logit_bias=((plain[0], -100.0),))
    assert banned[0] != plain[0]


def test_top_logprobs_are_sorted_n_long_and_contain_the_greedy_token(engine):
    out = engine.generate([SHORT], SamplingParams(max_tokens=5, temperature=0, top_logprobs=4,
                                                  ignore_eos=True))[0]
    for token, lp, top in zip(out.token_ids, out.logprobs, engine_tops(engine, SHORT, 4)):
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0] == (token, pytest.approx(lp, abs=1e-6))


def engine_tops(engine: Engine, prompt, k: int) -> list[list[tuple[int, float]]]:
    engine.add_request("tops", prompt, SamplingParams(max_tokens=5, temperature=0, top_logprobs=k, ignore_eos=True))
    tops = []
    while engine.has_unfinished():
        tops += [t for o in engine.step() for t in o.top_logprobs]
    return tops


SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["n", "tags"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["bool-enum", "int-array"])
def test_json_schema_output_parses_and_validates(engine, schema):
    jsonschema = pytest.importorskip("jsonschema")
    for temperature in (0.0, 1.0):
        out = engine.generate([SHORT], SamplingParams(max_tokens=120, temperature=temperature, seed=3,
                                                      guide=("json_schema", json.dumps(schema))))[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(engine.tokenizer.decode(out.token_ids)), schema)


def test_unusable_schema_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequestError, match="response_format"):
        engine.add_request("bad-schema", SHORT, SamplingParams(guide=("json_schema", "{not json")))


def test_batch_sampler_min_p_and_per_row_parameters():
    logits = torch.tensor([[4.0, 3.9, 0.0, -2.0], [4.0, 3.9, 0.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    rows = [SampleRow(SamplingParams(temperature=1.0, min_p=0.5), g), SampleRow(SamplingParams(temperature=0.0))]
    drawn = set()
    for _ in range(100):
        out = sample_batch(logits, rows)
        assert out.tokens[1] == 0
        drawn.add(out.tokens[0])
    assert drawn == {0, 1}


@pytest.mark.parametrize("field,kw", [("n", dict(n=0)), ("presence_penalty", dict(presence_penalty=3)),
                                      ("repetition_penalty", dict(repetition_penalty=0)),
                                      ("min_p", dict(min_p=1.5)), ("logit_bias", dict(logit_bias=((1, 500.0),))),
                                      ("top_logprobs", dict(top_logprobs=21))])
def test_invalid_new_sampling_values_name_the_field(field, kw):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw).validate()


def test_json_object_mode_yields_an_object_even_when_an_array_is_pushed(engine):
    """OpenAI's JSON mode promises an object; the schema {"type": "object"} is compiled (as
    vLLM does), not the grammar of any JSON value, which let a model open a top-level array."""
    bracket = ord("[") + 3                                           # the byte tokenizer's id of "["
    out = engine.generate([SHORT], SamplingParams(max_tokens=60, temperature=0.0, guide=("json_object", ""),
                                                  logit_bias=((bracket, 100.0),)))[0]
    text = engine.tokenizer.decode(out.token_ids)
    assert text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    guide = engine.guides.guide(("json_object", ""))
    assert not guide.allowed()[bracket] and guide.allowed()[ord("{") + 3]


def test_logit_bias_outside_the_vocabulary_is_an_invalid_request_naming_it(engine):
    vocab = engine.args.vocab_size
    with pytest.raises(InvalidRequestError, match=r"logit_bias: token ids \[%d\] are outside" % vocab) as e:
        engine.add_request("bias-out", SHORT, SamplingParams(logit_bias=((vocab, 5.0),)))
    assert e.value.field == "logit_bias"
    engine.add_request("bias-in", SHORT, SamplingParams(max_tokens=1, logit_bias=((vocab - 1, 5.0),)))
    while engine.has_unfinished():
        engine.step()
