"""DeepSeek-V4's own chat format (cluster/chat/dsv4_encode.py): prompts equal what the released
encoder gives — its published golden cases (tests/unit/fixtures/dsv4_golden.py says where
each comes from) and cases of our own — as text and as token ids on a tokenizer with V4's
special tokens; the request switches (thinking, reasoning_effort, tools, tool_choice) and
/tokenize's chat fields render the same prompt as the chat request."""
from __future__ import annotations

import json

import pytest

from kvmesh.cluster.errors import APIError
from kvmesh.cluster.openai.protocol import ChatCompletionRequest, TokenizeRequest, parse_body
from kvmesh.cluster.chat.dsv4_encode import BOS, REASONING_EFFORT_MAX, encode_messages
from kvmesh.cluster.chat.template import chat_prompt_ids
from tests.helpers import V4_SPECIAL, write_v4_tokenizer
from tests.unit.fixtures.dsv4_golden import GOLDEN
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": {"type": "object", "properties": {
                                                  "city": {"type": "string"}, "days": {"type": "integer"}},
                                                  "required": ["city"]}}}]


@pytest.fixture
def v4_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return load_tokenizer(write_v4_tokenizer(tmp_path))


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_prompt_text_equals_the_released_encoders_golden_case(case):
    messages, tools, mode, expected = GOLDEN[case]
    assert encode_messages(messages, mode, tools=tools) == expected


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_prompt_ids_equal_the_golden_text_tokenized_without_added_bos(v4_tokenizer, case):
    messages, tools, mode, expected = GOLDEN[case]
    ids = v4_tokenizer.encode_rendered(encode_messages(messages, mode, tools=tools))
    assert ids == v4_tokenizer._tok.encode(expected, add_special_tokens=False).ids
    assert ids[0] == v4_tokenizer.bos_id and ids.count(v4_tokenizer.bos_id) == 1
    one_id = {t: v4_tokenizer._tok.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "</think>")}
    assert all(i is not None and i in ids for t, i in one_id.items() if t in expected)


def chat(**body):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hello"}], **body})


@pytest.mark.parametrize("body,ending", [
    ({}, "<｜Assistant｜><think>"),                                          # V4 thinks by default
    ({"chat_template_kwargs": {"thinking": False}}, "<｜Assistant｜></think>"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "<｜Assistant｜></think>"),
    ({"chat_template_kwargs": {"thinking": True}}, "<｜Assistant｜><think>"),
    ({"thinking": {"type": "disabled"}}, "<｜Assistant｜></think>"),
    ({"thinking": {"type": "enabled"}}, "<｜Assistant｜><think>"),
    ({"reasoning_effort": "none"}, "<｜Assistant｜></think>"),
    ({"reasoning_effort": "high"}, "<｜Assistant｜><think>"),
    ({"reasoning_effort": "low"}, "<｜Assistant｜><think>"),
])
def test_switches_choose_thinking_or_chat_mode(v4_tokenizer, body, ending):
    b = chat(**body)
    text = encode_messages([m.as_dict() for m in b.messages], b.thinking_mode, b.effort, b.offered_tools)
    assert text == f"{BOS}<｜User｜>Hello{ending}"
    assert chat_prompt_ids(v4_tokenizer, b) == v4_tokenizer.encode_rendered(text)


@pytest.mark.parametrize("effort,prefixed", [("max", True), ("xhigh", True), ("high", False), ("medium", False)])
def test_reasoning_effort_max_adds_its_prefix_in_thinking_mode_only(effort, prefixed):
    b = chat(reasoning_effort=effort)
    text = encode_messages([m.as_dict() for m in b.messages], b.thinking_mode, b.effort)
    assert text.startswith(BOS + REASONING_EFFORT_MAX) == prefixed
    assert REASONING_EFFORT_MAX not in encode_messages([{"role": "user", "content": "x"}], "chat", "max")


def test_reasoning_content_of_earlier_turns_is_dropped_unless_tools_are_present():
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "because", "content": "A1"},
                {"role": "user", "content": "Q2"}]
    assert encode_messages(messages) == f"{BOS}<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>" \
                                        "<｜User｜>Q2<｜Assistant｜><think>"
    with_tools = encode_messages(messages, tools=WEATHER)
    assert "<｜Assistant｜><think>because</think>A1<｜end▁of▁sentence｜>" in with_tools
    assert with_tools.endswith("<｜User｜>Q2<｜Assistant｜><think>")


def test_tool_results_follow_the_call_order_not_the_arrival_order():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": json.dumps({"city": c, "days": 2})}}
             for i, c in enumerate(["Paris", "Zürich"])]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "snow"},
                {"role": "tool", "tool_call_id": "c0", "content": "sun"},
                {"role": "user", "content": "Thanks"}]
    text = encode_messages(messages, "chat", tools=WEATHER)
    assert text.endswith(
        '<｜User｜>Weather?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '</｜DSML｜tool_calls><｜end▁of▁sentence｜>'
        '<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>snow</tool_result>\n\nThanks<｜Assistant｜></think>')


def test_request_tools_join_the_first_system_message_or_make_one():
    alone = encode_messages([{"role": "user", "content": "x"}], "chat", tools=WEATHER)
    assert alone.startswith(BOS + "\n\n## Tools\n\n")
    with_system = encode_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
                                  "chat", tools=WEATHER)
    assert with_system.startswith(BOS + "Be brief.\n\n## Tools\n\n") and with_system.count("## Tools") == 1


def test_tool_choice_none_leaves_the_tools_out_and_other_formats_refuse_tools(tmp_path):
    b = chat(tools=WEATHER, tool_choice="none")
    assert b.offered_tools == []
    plain = load_tokenizer(tmp_path)          # no tokenizer.json: the byte tokenizer, plain format
    with pytest.raises(Exception, match="tools need a checkpoint in DeepSeek-V4's chat format"):
        chat_prompt_ids(plain, chat(tools=WEATHER))


def test_tokenize_takes_the_chat_fields_and_gives_the_chat_requests_ids(v4_tokenizer):
    fields = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
              "tools": WEATHER, "reasoning_effort": "max", "chat_template_kwargs": {"thinking": True}}
    as_tokenize = chat_prompt_ids(v4_tokenizer, TokenizeRequest.model_validate(fields).as_chat())
    assert as_tokenize == chat_prompt_ids(v4_tokenizer, ChatCompletionRequest.model_validate(fields))
    assert v4_tokenizer.decode_markup(as_tokenize).startswith(REASONING_EFFORT_MAX + "Be brief.\n\n## Tools")


def test_a_template_still_wins_and_a_tokenizer_without_v4_turn_tokens_stays_plain(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    write_v4_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(tmp_path).chat_format == "template"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["<｜User｜>hello<｜Assistant｜>world"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=V4_SPECIAL[:3], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(plain / "tokenizer.json"))
    assert load_tokenizer(plain).chat_format == "plain"        # BOS / EOS / pad only: the turns are bytes


@pytest.mark.parametrize("arguments,says", [("{oops", "must be JSON text"), ("[1,2]", "of an object"),
                                             ("1", "of an object"), ("true", "of an object"),
                                             ('{"a": NaN}', "must be JSON text")])
def test_bad_history_arguments_are_a_bad_request(arguments, says):
    raw = json.dumps({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "user", "content": "y"}]}).encode()
    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(APIError, match=says) as e:
            parse_body(raw, model)
        assert e.value.status == 400 and e.value.param == "messages.1.tool_calls.0.function.arguments"


def test_tokenize_refuses_what_the_chat_request_refuses_with_a_400():
    with pytest.raises(APIError) as e:
        TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                        "tool_choice": "required"}).as_chat()
    assert e.value.status == 400 and e.value.param == "tool_choice" and "needs tools" in e.value.message
