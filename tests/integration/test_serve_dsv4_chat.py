"""DeepSeek-V4's chat format end to end through the `openai` client, on a random tiny V4
checkpoint whose tokenizer has V4's special tokens (colocated, one app on the
session's Ray): thinking on and off with reasoning_content, tool_choice required / named / none
(streamed too) giving schema-valid calls, a conversation sent back with reasoning_content
and tool results, /tokenize giving the chat request's prompt ids, logit_bias outside the
vocabulary a 400."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import ASK, BLOCK_TOKENS, TOOLS, write_tiny_checkpoint, write_v4_tokenizer
from tests.local_serve import small_config

pytestmark = pytest.mark.slow     # a Ray cluster and a Serve app

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

NAME = "swa_csa_hca"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def url(tmp_path_factory, local_serve):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    write_v4_tokenizer(path)
    config = small_config("colocated", engine={"model": str(path), "block_tokens": BLOCK_TOKENS[NAME]})
    return local_serve.deploy("dsv4", config, "/")


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def create(client, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, **kw)


def tokenize(url, **body) -> list[int]:
    return httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]


def test_thinking_by_default_and_off_by_the_switches(url, client):
    on = create(client, messages=ASK, max_tokens=12, temperature=0.0, extra_body={"return_token_ids": True})
    msg = on.choices[0].message
    assert msg.model_extra["reasoning_content"] and msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]
    assert not any(m in msg.model_extra["reasoning_content"] + (msg.content or "") for m in ("<think>", "</think>"))
    assert on.model_extra["prompt_token_ids"] == tokenize(url, messages=ASK)
    for switch in ({"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}},
                   {"chat_template_kwargs": {"thinking": False}}):
        off = create(client, messages=ASK, max_tokens=12, temperature=0.0, extra_body={**switch, "return_token_ids": True})
        assert off.choices[0].message.content and off.choices[0].message.model_extra["reasoning_content"] is None
        assert off.model_extra["prompt_token_ids"] == tokenize(url, messages=ASK, **switch)
        assert off.model_extra["prompt_token_ids"] != on.model_extra["prompt_token_ids"]


def streamed_calls(client, **kw):
    calls, finish, content = {}, None, ""
    for ev in create(client, stream=True, **kw):
        ch = ev.choices[0]
        content += ch.delta.content or ""
        for c in ch.delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": c.id, "name": c.function.name, "arguments": ""})
            entry["arguments"] += c.function.arguments or ""
        finish = ch.finish_reason or finish
    return list(calls.values()), finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_flags"}}])
def test_forced_tool_choice_gives_schema_valid_calls_whole_and_streamed(client, choice):
    """A random model may ramble inside a string value until max_tokens: the first seed whose
    reply ends is checked (whole, then streamed with the same seed: the same call)."""
    for seed in range(6):
        kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=300,
                  temperature=1.0, seed=seed, extra_body={"reasoning_effort": "none"})
        whole = create(client, **kw).choices[0]
        assert not whole.message.content                  # the grammar admits nothing but the block
        if whole.finish_reason != "length":
            break
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    if isinstance(choice, dict):
        assert call.function.name == "set_flags"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, finish, content = streamed_calls(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_calls_nothing_and_leaves_the_tools_out(url, client):
    out = create(client, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls
    assert tokenize(url, messages=ASK, tools=TOOLS, tool_choice="none") == tokenize(url, messages=ASK)
    calls, finish, _ = streamed_calls(client, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert calls == [] and finish != "tool_calls"


def test_a_conversation_comes_back_with_reasoning_content_and_tool_results(url, client):
    for seed in range(6):
        first = create(client, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0,
                       seed=seed, extra_body={"reasoning_effort": "none"}).choices[0].message
        if first.tool_calls:
            break
    assert first.tool_calls
    back = first.model_dump(exclude_none=True)
    back["reasoning_content"] = back.get("reasoning_content") or "I should call a tool."
    history = ASK + [back] + [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": i})}
                              for i, c in reversed(list(enumerate(first.tool_calls)))]
    again = create(client, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokenize(url, messages=history, tools=TOOLS)},
                      timeout=60).json()["prompt"]
    assert back["reasoning_content"] in text                   # tools present: earlier reasoning is kept
    assert f'<tool_result>{json.dumps({"ok": 0})}</tool_result>' in text
    assert f'invoke name="{first.tool_calls[0].function.name}"' in text


def test_logit_bias_outside_the_vocabulary_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, messages=ASK, max_tokens=2, logit_bias={"300": 1})
    assert e.value.body["param"] == "logit_bias"
