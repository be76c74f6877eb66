"""The serving layer's pure parts, without Ray: text deltas and stop strings, chat
prompts, replica ranking, retry continuations, request validation."""
from __future__ import annotations

import pytest

from cluster.errors import APIError
from cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from cluster.serve.dispatch import continuation
from cluster.messages import GenRequest, RouteHint
from cluster.serve.routing import location, rank_hint, rank_replicas
from cluster.chat.detokenizer import Detokenizer
from cluster.chat.template import plain_chat_prompt, render_chat
from workers.checkpoint.tokenizer import ByteTokenizer
from workers.sampling.params import SamplingParams

TOK = ByteTokenizer()


def stream(text_tokens: list[list[int]], stops: list[str]) -> tuple[str, Detokenizer]:
    d = Detokenizer(TOK.decode, stops)
    out = ""
    for ids in text_tokens:
        out += d.add(ids)
        if d.stopped:
            break
    return out + d.finish(), d


def test_deltas_concatenate_to_the_decoded_text_and_hold_back_partial_utf8():
    ids = TOK.encode("héllo €uro")
    d = Detokenizer(TOK.decode, [])
    deltas = [d.add([t]) for t in ids]
    assert "".join(deltas) + d.finish() == "héllo €uro"
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_spanning_chunks_ends_the_text_before_it():
    ids = TOK.encode("abc STOP def")
    text, d = stream([[t] for t in ids], ["STOP"])
    assert text == "abc " and d.stopped


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    text, d = stream([TOK.encode("abc ST"), TOK.encode("ar")], ["STOP"])
    assert text == "abc STar" and not d.stopped


def test_earliest_of_several_stop_strings_wins():
    text, _ = stream([TOK.encode("one two three")], ["three", "two"])
    assert text == "one "


def test_plain_chat_template_is_documented_format():
    assert plain_chat_prompt([("system", "be brief"), ("user", "hi")]) == \
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_checkpoint_chat_template_is_rendered_with_jinja():
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    assert render_chat(template, [("user", "hi")]) == "[user]hi[bot]"
    with pytest.raises(ValueError):
        render_chat("{{ raise_exception('no system role') }}", [("system", "x")])


def test_longest_in_memory_prefix_wins_then_load_then_free_kv():
    replicas = [("a", 0.5, 1.0), ("b", 0.0, 1.0), ("c", 0.0, 0.1)]
    assert rank_replicas(replicas, RouteHint(prefix_blocks={"a": 3, "c": 1}), 1.0) == ["a", "c", "b"]
    assert rank_replicas(replicas, RouteHint(), 1.0) == ["b", "a", "c"]      # c: little free KV
    assert rank_replicas(replicas, RouteHint(), 0.0)[-1] == "a"              # load alone


def test_a_data_parallel_rank_is_a_cache_location_of_its_replica():
    replicas = [("a", 0.0, 1.0), ("b", 0.0, 1.0)]
    hint = RouteHint(prefix_blocks={"a/dp0": 1, "b/dp1": 4, "b/dp0": 2})
    assert rank_replicas(replicas, hint, 1.0) == ["b", "a"]                  # b's best rank holds the most
    assert (rank_hint(hint, "b"), rank_hint(hint, "a"), rank_hint(hint, "c")) == (1, 0, None)
    assert rank_hint(RouteHint(prefix_blocks={"b/dp0": 3, "b/dp1": 3}), "b") is None   # a tie: the front decides
    assert rank_hint(RouteHint(prefix_blocks={"b": 3}), "b") is None         # not data-parallel
    assert location("x/y/dp12") == ("x/y", 12) and location("w") == ("w", None)


def test_retry_continues_after_the_tokens_already_sent():
    req = GenRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4))
    assert continuation(req, []) is req
    cont = continuation(req, [7, 8, 9])
    assert cont.prompt == [1, 2, 3, 7, 8, 9] and cont.params.max_tokens == 7 and cont.params.min_tokens == 1
    assert cont.request_id != req.request_id


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
