"""`tool_choice` "required" / a named function: the reply is constrained (xgrammar, the
EBNF of cluster/chat/dsv4_grammar.py) to a DSML block whose invokes name allowed tools and whose
parameters follow each tool's schema — so even a random tiny model returns calls that parse
and validate, in thinking and chat mode."""
from __future__ import annotations

import json

import pytest

from kvmesh.cluster.openai.protocol import ChatCompletionRequest
from kvmesh.cluster.chat.dsv4_parse import ReplyParser
from kvmesh.cluster.chat.template import chat_prompt_ids
from tests.helpers import tiny_engine, write_tiny_checkpoint, write_v4_tokenizer
from kvmesh.workers.sampling.params import InvalidRequestError

NAME = "swa_csa_hca"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                                         "note": {"type": "string"}},
        "required": ["flags"]}}},
    {"type": "function", "function": {"name": "now"}},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    write_v4_tokenizer(path)
    return tiny_engine(path, NAME)


def request(**body):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "What's the weather in Beijing?"}], "tools": TOOLS,
         "max_tokens": 200, **body})


def run(engine, body, seed):
    assert engine.tokenizer.chat_format == "dsv4"
    ids = chat_prompt_ids(engine.tokenizer, body)
    params = body.sampling_params(body.token_limit, False)
    out = engine.generate([ids], params.__class__(**{**params.__dict__, "temperature": 1.0, "seed": seed}))[0]
    parser = ReplyParser(body.thinking_mode, tools=True, parallel=body.parallel_tool_calls)
    text = engine.tokenizer.decode_markup(out.token_ids)
    parsed = [parser.feed(text), parser.finish()]
    return out, [c for p in parsed for c in p.calls], "".join(p.content for p in parsed)


def valid(call) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    schema = next(t["function"].get("parameters") or {"type": "object"} for t in TOOLS
                  if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    return True


@pytest.mark.parametrize("thinking", [False, True])
def test_required_gives_schema_valid_calls_from_a_random_model(engine, thinking):
    body = request(tool_choice="required", parallel_tool_calls=False,
                   reasoning_effort=None if thinking else "none", max_tokens=300 if thinking else 200)
    finished = 0
    for seed in range(3):
        out, calls, content = run(engine, body, seed)
        if out.finish_reason == "stop":          # the grammar finished (a random model may ramble to max_tokens)
            finished += 1
            assert len(calls) == 1 and valid(calls[0]) and content == ""
    assert finished >= 1


def test_a_named_function_is_the_only_one_called(engine):
    """A random model may ramble in the optional string `note` (it ends only at the exact closing
    tag) up to max_tokens: the seeds whose reply ends are checked."""
    body = request(tool_choice={"type": "function", "function": {"name": "set_flags"}}, reasoning_effort="none")
    finished = 0
    for seed in range(4):
        out, calls, _ = run(engine, body, seed)
        if out.finish_reason == "stop":
            finished += 1
            assert [c.name for c in calls] == ["set_flags"] and valid(calls[0])
    assert finished >= 1


def test_tool_choice_needs_known_tools_and_excludes_json_mode():
    with pytest.raises(Exception, match="not among the tools"):
        request(tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(Exception, match="needs tools"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "tool_choice": "required"})
    with pytest.raises(Exception, match="cannot be combined"):
        _ = request(tool_choice="required", response_format={"type": "json_object"}).guide


def test_an_uncompilable_grammar_is_an_invalid_request_naming_tools(engine):
    from kvmesh.workers.sampling.params import SamplingParams
    with pytest.raises(InvalidRequestError, match="tools"):
        engine.add_request("bad-ebnf", [5, 6], SamplingParams(guide=("ebnf", "root ::= (")))


def test_json_mode_in_thinking_mode_reasons_first_then_gives_the_object(engine):
    """response_format with V4 thinking: the grammar lets the reasoning and `</think>` come
    first, so the JSON lands in content, not in reasoning_content."""
    from kvmesh.cluster.chat.dsv4_grammar import after_reasoning
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    ids = chat_prompt_ids(engine.tokenizer, body)
    params = body.sampling_params(200, False)
    guide = after_reasoning(params.guide)
    for seed in range(3):
        out = engine.generate([ids], params.__class__(**{**params.__dict__, "guide": guide, "temperature": 1.0,
                                                         "seed": seed}))[0]
        if out.finish_reason != "stop":
            continue
        parser = ReplyParser("thinking", tools=False)
        parsed = [parser.feed(engine.tokenizer.decode_markup(out.token_ids)), parser.finish()]
        assert json.loads("".join(p.content for p in parsed)) in ({"ok": True}, {"ok": False})
        return
    pytest.fail("no seed finished")
