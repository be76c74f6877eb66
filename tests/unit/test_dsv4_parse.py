"""DeepSeek-V4 replies parsed into reasoning_content, content and OpenAI tool_calls
(cluster/chat/dsv4_parse.py, cluster/openai/responses.py): whole and streamed (any cut of the text, any
cut of the tokens) give the same result; no markup reaches reasoning or content; a block cut
by max_tokens or malformed never fails the request; the token that ends a sequence is never
text, also when the tokenizer does not mark it special."""
from __future__ import annotations

import json

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cluster.chat.dsv4_encode import escape_name, render_tool_calls, unescape_name
from kvmesh.cluster.chat.dsv4_parse import ReplyParser
from kvmesh.cluster.messages import Chunk
from kvmesh.cluster.openai.responses import Reply, ReplyFormat
from tests.helpers import write_v4_tokenizer
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer

D = "｜DSML｜"


def invoke(name, *params):
    lines = [f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>' for k, s, v in params]
    return f'<{D}invoke name="{name}">\n' + "".join(line + "\n" for line in lines) + f"</{D}invoke>"


def block(*invokes):
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


WEATHER = invoke("get_weather", ("city", "true", "Zürich <north>"), ("days", "false", "3"),
                 ("opts", "false", '{"unit": "c", "hourly": [1, 2]}'))
SEARCH = invoke("search", ("query", "true", "kv cache\nline two"))
# text of a reply (markup kept) -> (mode, reasoning, content, [(name, arguments)])
TABLE = {
    "thinking_then_content": ("thinking", "Let me see.</think>Hello there.", "Let me see.", "Hello there.", []),
    "chat_mode_content": ("chat", "Hello <b>there</b>.", "", "Hello <b>there</b>.", []),
    "reasoning_never_closed": ("thinking", "still thinking <thi", "still thinking <thi", "", []),
    "stray_think_tags_dropped": ("chat", "<think>a</think>b", "", "ab", []),
    "one_call": ("thinking", "Need weather.</think>Checking." + block(WEATHER), "Need weather.", "Checking.",
                 [("get_weather", {"city": "Zürich <north>", "days": 3, "opts": {"unit": "c", "hourly": [1, 2]}})]),
    "two_calls_no_content": ("chat", block(WEATHER, SEARCH).lstrip(), "", "",
                             [("get_weather", {"city": "Zürich <north>", "days": 3,
                                               "opts": {"unit": "c", "hourly": [1, 2]}}),
                              ("search", {"query": "kv cache\nline two"})]),
    "call_without_parameters": ("chat", block(invoke("now")), "", "", [("now", {})]),
    "cut_inside_second_invoke": ("chat", "ok" + block(WEATHER, SEARCH)[:-40], "", "ok",
                                 [("get_weather", {"city": "Zürich <north>", "days": 3,
                                                   "opts": {"unit": "c", "hourly": [1, 2]}})]),
    "cut_inside_opener": ("chat", f"ok\n\n<{D}tool_ca", "", "ok", []),
    "malformed_value_stays_content": (
        "chat", "ok" + block(invoke("f", ("n", "false", "not json"))), "", "ok" + block(invoke("f", ("n", "false", "not json"))), []),
    "malformed_after_a_good_call": (
        "chat", block(SEARCH, f'<{D}invoke nam="x">').lstrip(), "", f'\n<{D}invoke nam="x">\n</{D}tool_calls>',
        [("search", {"query": "kv cache\nline two"})]),
    "text_after_the_block_is_content": ("chat", block(SEARCH) + "\nDone.", "", "Done.",
                                        [("search", {"query": "kv cache\nline two"})]),
}


def parse(mode, text, step):
    p = ReplyParser(mode, tools=True)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] if step else [text]
    outs = [p.feed(t) for t in pieces] + [p.finish()]
    return ("".join(o.reasoning for o in outs), "".join(o.content for o in outs),
            [c for o in outs for c in o.calls], outs)


@pytest.mark.parametrize("step", [0, 1, 2, 5, 13])
@pytest.mark.parametrize("case", sorted(TABLE))
def test_reply_parses_the_same_whole_and_streamed(case, step):
    mode, text, reasoning, content, calls = TABLE[case]
    got_r, got_c, got_calls, outs = parse(mode, text, step)
    assert (got_r, got_c) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.index for c in got_calls] == list(range(len(calls)))
    assert all("".join(c.pieces) == c.arguments for c in got_calls)
    if not case.startswith("malformed"):          # markup never reaches what users see
        for o in outs:
            assert not any(m in o.reasoning + o.content for m in ("<think>", "</think>", D))


def test_parallel_tool_calls_false_keeps_the_first_call():
    p = ReplyParser("chat", tools=True, parallel=False)
    out = p.feed(block(WEATHER, SEARCH))
    assert [c.name for c in out.calls + p.finish().calls] == ["get_weather"]


def test_without_tools_dsml_is_plain_content():
    p = ReplyParser("chat", tools=False)
    assert p.feed(block(SEARCH)).content + p.finish().content == block(SEARCH)


@pytest.fixture(params=[False, True], ids=["markup_added", "markup_special"])
def v4_tokenizer(tmp_path, request):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return load_tokenizer(write_v4_tokenizer(tmp_path, markup_special=request.param))


def chunks(ids, step, finish_reason):
    out = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        out.append(Chunk(ids[i:i + step], [0.0] * len(ids[i:i + step]), last, finish_reason if last else None, 5, 0))
    return out


def reply(tok, text, step, finish_reason="stop", mode="thinking"):
    ids = tok.encode_rendered(text) + ([tok.eos_id] if finish_reason == "stop" else [])
    r = Reply("chatcmpl-x", "m", tok, [], [[0]], 1, stop_ids=frozenset(tok.stop_token_ids),
              fmt=ReplyFormat(mode, tools=True))
    events = [r.chat_chunk(*r.feed(0, c), False, 0, False) for c in chunks(ids, step, finish_reason)]
    return r.chat(False, 0, False)["choices"][0], events


@pytest.mark.parametrize("step", [1, 3, 100])
def test_chat_body_and_stream_carry_reasoning_content_and_tool_calls(v4_tokenizer, step):
    text = "Need weather.</think>Checking." + block(WEATHER, SEARCH)
    whole, events = reply(v4_tokenizer, text, step)
    msg = whole["message"]
    assert whole["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == msg["reasoning"] == "Need weather." and msg["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Zürich <north>", "days": 3, "opts": {"unit": "c", "hourly": [1, 2]}}),
        ("search", {"query": "kv cache\nline two"})]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"id": c.get("id"), "name": c["function"].get("name"), "args": ""})
            assert "id" not in c or entry["id"] == c["id"]
            entry["args"] += c["function"]["arguments"]
    assert [(c["id"], c["name"], c["args"]) for c in calls.values()] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_block_cut_by_max_tokens_stays_out_of_content_and_ends_as_length(v4_tokenizer):
    whole, _ = reply(v4_tokenizer, "Sure." + block(WEATHER)[:-30], 2, finish_reason="length", mode="chat")
    assert whole["finish_reason"] == "length"
    assert whole["message"]["content"] == "Sure." and "tool_calls" not in whole["message"]


def test_the_end_of_sequence_token_is_not_text_even_when_not_marked_special(tmp_path):
    """vLLM's detokenizer drops the stop-terminated token; kvmesh used to print an EOS (or a
    stop_token_ids token) whose tokenizer entry is plain text."""
    write_v4_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "!"}))
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("Hello") + [tok.eos_id]
    assert tok.decode([tok.eos_id]) == "!"
    for stop_ids in (frozenset(tok.stop_token_ids), frozenset()):      # ended by EOS / by a stop_token_ids id
        r = Reply("cmpl-x", "m", tok, [], [[0]], 1, stop_ids=frozenset(stop_ids | {tok.eos_id}))
        for c in chunks(ids, 2, "stop"):
            r.feed(0, c)
        body = r.completion(None, True)["choices"][0]
        assert body["text"] == "Hello" and body["token_ids"] == ids
    r = Reply("cmpl-x", "m", tok, [], [[0]], 1, stop_ids=frozenset(tok.stop_token_ids))
    for c in chunks(ids, 2, "length"):          # ignore_eos / max_tokens: the token is ordinary output
        r.feed(0, c)
    assert r.completion(None, False)["choices"][0]["text"] == "Hello!"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_name_escapes_to_attribute_text_and_back(name):
    escaped = escape_name(name)
    assert not any(c in escaped for c in '"<>\n') and unescape_name(escaped) == name


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_names_and_values_of_any_characters_round_trip_through_the_encoder_and_the_parser(step):
    """History re-rendered by the encoder reads back exactly, whole or streamed: names with markup
    characters, a string holding `<` and `</think>` (as is), one holding the closing tag (as JSON),
    a nested value holding it too."""
    args = {'a<b\n"c&amp;': "x < y </z </think>", "k": "holds </｜DSML｜parameter> inside",
            "&#10;": {"n": ["</｜DSML｜parameter>", 1]}, "e": ""}
    text = render_tool_calls([{"function": {"name": "f", "arguments": json.dumps(args)}}])
    assert 'string="false">"holds </｜DSML｜parameter> inside"' in text
    parser = ReplyParser("chat", tools=True)
    parsed = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    assert [json.loads(c.arguments) for p in parsed for c in p.calls] == [args]
    assert "".join(p.content for p in parsed) == ""


@pytest.mark.parametrize("step", [1, 5, 10_000])
def test_a_guided_json_reply_keeps_think_text_in_its_strings(step):
    """response_format content is parsed verbatim: `<think>` / `</think>` inside a JSON string stay
    (unguided content drops them as stray markup)."""
    text = 'why </th not</think>{"a": "<think>", "b": "x</think>"}'
    parser = ReplyParser("thinking", tools=False, verbatim=True)
    parsed = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    assert "".join(p.reasoning for p in parsed) == "why </th not"
    assert json.loads("".join(p.content for p in parsed)) == {"a": "<think>", "b": "x</think>"}
