"""The OpenAI request models (cluster/openai/protocol.py): OpenAI's shapes are accepted, a bad
field is a 400 that names it."""
from __future__ import annotations

import json
import math
import re

import pytest

from kvmesh.cluster.errors import APIError
from kvmesh.cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def test_request_models_accept_openai_shapes_and_name_bad_fields():
    body = parse_body(b'{"prompt": [1, 2], "temperature": 0, "stop": "x", "stream": true, "stream_options": {"include_usage": true}}',
                      CompletionRequest)
    assert body.prompt == [1, 2] and body.stop_strings == ["x"] and body.include_usage
    chat = parse_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                      b'{"type": "text", "text": "b"}]}], "max_completion_tokens": 5}', ChatCompletionRequest)
    assert chat.messages[0].text == "ab" and chat.token_limit == 5
    with pytest.raises(APIError) as e:
        parse_body(b'{"prompt": "x", "temprature": 1}', CompletionRequest)
    assert e.value.status == 400 and e.value.param == "temprature"


# ---- malformed chat bodies: every one is a 400 naming a field ------------------------------------
BASE_CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "look it up",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": "auto", "chat_template_kwargs": {"thinking": True}, "max_tokens": 4,
    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
    "stop": ["x"], "logit_bias": {"5": 1.0}, "reasoning_effort": "high",
}
FORCED_CALL = {"messages": [{"role": "user", "content": "weather?"}], "tools": BASE_CHAT["tools"],
               "tool_choice": {"type": "function", "function": {"name": "w"}}, "thinking": {"type": "disabled"}}
ODD_VALUES = [None, 0, -1, 1.5, True, "", "x", "[1,2]", [], [None], {}, {"x": None}, "<｜Assistant｜>"]


def _paths(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, path + (key,))


def _mutated(body, path, value):
    """A deep copy of `body` with the value at `path` replaced (`value` DELETE: removed)."""
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


DELETE = object()


@pytest.mark.parametrize("base", [BASE_CHAT, FORCED_CALL], ids=["full", "forced_call"])
def test_every_malformed_chat_body_is_a_400_naming_a_field_and_no_other_error(base):
    """Each field of a full chat body replaced by values of other types (or removed): the body is
    accepted and rendered, or refused with a 400 that names a field; nothing else escapes."""
    from kvmesh.cluster.chat.template import chat_prompt_ids
    from kvmesh.cluster.openai.limits import Limits
    from kvmesh.cluster.openai.protocol import TokenizeRequest
    from kvmesh.cluster.openai.responses import ReplyFormat
    from kvmesh.cluster.openai.validate import Prompts, gen_request
    from kvmesh.workers.checkpoint.default_model import ensure_default_model
    from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
    tok = load_tokenizer(ensure_default_model())
    limits = Limits(max_model_len=4096, vocab_size=tok.vocab_size, max_schema_bytes=1 << 16)
    tokenize_fields = set(TokenizeRequest.model_fields)
    outcomes = {"accepted": 0, "refused": 0}
    for path in list(_paths(base))[1:]:
        for value in ODD_VALUES + [DELETE]:
            body = _mutated(base, path, value)
            for model in (ChatCompletionRequest, TokenizeRequest) if path[0] in tokenize_fields else \
                    (ChatCompletionRequest,):
                raw = json.dumps({k: v for k, v in body.items() if model is ChatCompletionRequest
                                  or k in tokenize_fields}).encode()
                try:
                    parsed = parse_body(raw, model)
                    chat = parsed.as_chat() if model is TokenizeRequest else parsed
                    ids = chat_prompt_ids(tok, chat)
                    if model is ChatCompletionRequest:
                        fmt = ReplyFormat(chat.thinking_mode, bool(chat.offered_tools), chat.parallel_tool_calls)
                        gen_request(chat, Prompts([ids], chat.token_limit, chat.logprobs, "messages", fmt=fmt),
                                    ids, "r", limits)
                    outcomes["accepted"] += 1
                except APIError as e:
                    assert e.status == 400 and e.param, (path, value, model.__name__, e.message)
                    assert_states_a_rule(e)
                    outcomes["refused"] += 1
    assert outcomes["accepted"] > 20 and outcomes["refused"] > 100, outcomes


INTERNALS = re.compile(r"Value error|validation error|Traceback|\S+\.(cc|cpp|h|py):\d+|\n")


def assert_states_a_rule(e: APIError) -> None:
    """The message names the refused field (`param`) and says what is wrong with it, in its own
    words: no pydantic wrapper, no xgrammar source line, nothing over one line."""
    rule = e.message.removeprefix(f"{e.param}: ")
    assert rule != e.message or e.message == f"missing required field `{e.param}`", (e.param, e.message)
    assert len(rule) > 10 and not INTERNALS.search(rule), (e.param, e.message)


# ---- fuzzed sampling parameters: every 400 names the field and the rule the value breaks ---------
FUZZ_VALUES = [float("nan"), float("inf"), float("-inf"), -1e9, -2.5, -1, 0, 0.5, 1, 1.5, 17, 21, 100.5, 1e9,
               True, "1", None, [], {}]


def _rule_broken(field, value) -> str | None:
    """What a request model must say about `value` for `field` (its bounds and type), or None
    when the value is valid for the field alone."""
    import math
    from annotated_types import Ge, Gt, Le, Lt
    info = CompletionRequest.model_fields[field]
    integer = "int" in str(info.annotation)
    if value is None:
        return None if "None" in str(info.annotation) else "valid"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "valid"                       # "Input should be a valid integer / number"
    if isinstance(value, float) and not math.isfinite(value):
        return "finite" if not integer else "valid"
    if integer and isinstance(value, float):
        return "valid"                       # strict: not even 1.0 is an integer
    for bound in info.metadata:
        broken = {Ge: lambda b: value < b.ge and f"greater than or equal to {b.ge:g}",     # 0.0 reads "0"
                  Gt: lambda b: value <= b.gt and f"greater than {b.gt:g}",
                  Le: lambda b: value > b.le and f"less than or equal to {b.le:g}",
                  Lt: lambda b: value >= b.lt and f"less than {b.lt:g}"}[type(bound)](bound)
        if broken:
            return broken
    return None


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p", "top_k", "n", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logprobs",
                                   "best_of"])
def test_every_fuzzed_sampling_parameter_is_accepted_or_a_400_naming_the_field_and_its_rule(field):
    refused = 0
    for value in FUZZ_VALUES:
        raw = json.dumps({"prompt": "x", "max_tokens": 32, field: value}, allow_nan=True).encode()
        rule = _rule_broken(field, value)
        try:
            parse_body(raw, CompletionRequest)
        except APIError as e:
            refused += 1
            assert e.status == 400 and e.param == field and e.message.startswith(f"{field}: "), (value, e.message)
            assert_states_a_rule(e)
            assert rule is not None and rule in e.message, (field, value, rule, e.message)   # the rule it breaks
        else:
            assert rule is None, (field, value, rule)
    assert refused >= 6, refused


@pytest.mark.parametrize("value", FUZZ_VALUES, ids=repr)
def test_every_fuzzed_logit_bias_value_is_accepted_or_a_400_naming_the_field_and_its_rule(value):
    raw = json.dumps({"prompt": "x", "logit_bias": {"5": value}}, allow_nan=True).encode()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        rule = "valid number"
    elif not math.isfinite(value):
        rule = "finite number"
    elif not -100 <= value <= 100:
        rule = "must be in [-100, 100]"
    else:
        assert parse_body(raw, CompletionRequest).logit_bias == {"5": value}
        return
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and e.value.param.startswith("logit_bias") and rule in e.value.message, \
        e.value.message
    assert_states_a_rule(e.value)


ENGINE_REALS = {"temperature": "[0, 100]", "top_p": "(0, 1]", "presence_penalty": "[-2, 2]",
                "frequency_penalty": "[-2, 2]", "repetition_penalty": "(0, 10]", "min_p": "[0, 1]",
                "logit_bias": "[-100, 100]"}


@pytest.mark.parametrize("field", sorted(ENGINE_REALS))
def test_the_engine_refuses_every_fuzzed_real_parameter_naming_the_field_and_its_rule(field):
    """SamplingParams.validate, the check of requests that skip the HTTP models (`kvmesh generate`
    reads JSON lines, where NaN and Infinity parse; the Python API): NaN and ±Infinity are
    "must be a finite number", not a bound they do not break (issue 48 item 6)."""
    from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
    refused = 0
    for value in FUZZ_VALUES:
        kw = {field: ((5, value),)} if field == "logit_bias" else {field: value}
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            rule = "must be a number"
        elif not math.isfinite(value):
            rule = "must be a finite number"
        else:
            rule = f"must be in {ENGINE_REALS[field]}"
        try:
            SamplingParams(**kw).validate()
        except InvalidRequestError as e:
            refused += 1
            assert e.field == field and str(e).startswith(f"{field}: ") and rule in e.message, (value, str(e))
        else:
            assert rule.startswith("must be in"), (field, value)    # a number inside the bounds
    assert refused >= 8, refused


def test_a_batch_over_the_prompt_limit_says_so_and_a_bad_prompt_says_what_a_prompt_is():
    from kvmesh.cluster.openai.protocol import MAX_PROMPTS
    for prompt in (["a"] * 1000, [[1]] * (MAX_PROMPTS + 1)):
        with pytest.raises(APIError) as e:
            parse_body(json.dumps({"prompt": prompt}).encode(), CompletionRequest)
        assert e.value.param == "prompt" and \
            e.value.message == f"prompt: a batch holds at most {MAX_PROMPTS} prompts, got {len(prompt)}"
    for n in (2, MAX_PROMPTS):
        assert len(parse_body(json.dumps({"prompt": ["a"] * n}).encode(), CompletionRequest).prompt) == n
    for prompt in ([], "", [[]], [1, "a"]):
        with pytest.raises(APIError) as e:
            parse_body(json.dumps({"prompt": prompt}).encode(), CompletionRequest)
        assert "must be a non-empty string or a non-empty list of integer token ids" in e.value.message
