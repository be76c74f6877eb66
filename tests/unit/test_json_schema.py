"""A schema the grammar engine cannot enforce exactly, or that no value satisfies, is a 400 naming
the keyword and where it is (cluster/chat/json_schema.py), for `response_format` and for forced
tool calls alike; what it can enforce (bounds, patterns, $ref into $defs / definitions, recursion
with a way out) builds a grammar that holds exactly the schema's values."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from kvmesh.cluster.chat.dsv4_encode import render_tool_calls
from kvmesh.cluster.chat.dsv4_grammar import tool_call_grammar
from kvmesh.cluster.chat.json_schema import check
from kvmesh.cluster.errors import APIError
from kvmesh.cluster.openai.protocol import ChatCompletionRequest
from kvmesh.workers.sampling.params import InvalidRequestError

WHERE = "response_format.json_schema.schema"


@pytest.mark.parametrize("schema, field", [
    ({"enum": []}, "enum"),
    ({"type": "string", "enum": [1, 2]}, "enum"),
    ({"type": "integer", "const": "x"}, "const"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "minimum"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "minimum"),
    ({"type": "string", "minLength": 5, "maxLength": 1}, "minLength"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
      "additionalProperties": False}, "required"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}, "minProperties"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1},
     "maxProperties"),
    ({"type": "object", "properties": {"a": {}}, "required": "a"}, "required"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 2}, "minItems"),
    ({"type": "string", "pattern": "^(?=a)a$"}, "pattern"),
    ({"type": "string", "pattern": "^[0-9]+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": "(("}, "pattern"),
    ({"type": "string", "format": "iri"}, "format"),
    ({"maxLength": 3}, "maxLength"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["a"]}},
     "dependentRequired"),
    ({"$ref": "#/$defs/A", "maxLength": 2, "$defs": {"A": {"type": "string"}}}, "maxLength"),
    ({"$ref": "https://example.com/a.json"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
])
def test_unenforceable_or_unsatisfiable_schemas_are_refused_naming_the_keyword(schema, field):
    with pytest.raises(InvalidRequestError) as e:
        check(schema, WHERE)
    assert e.value.field.endswith("." + field), e.value.field
    assert f"`{field}`" in e.value.message


def test_the_refusal_says_where_in_the_schema():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": []}}}}
    with pytest.raises(InvalidRequestError) as e:
        check(schema, WHERE)
    assert e.value.field == f"{WHERE}.properties.a.items.enum"


def test_recursion_without_a_way_out_is_refused_and_with_one_accepted():
    endless = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    with pytest.raises(InvalidRequestError, match="recurses"):
        check(endless, WHERE)
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/definitions/Node"}}}, "required": ["v"],
        "definitions": {"Node": {"$ref": "#"}}}
    assert check(tree, WHERE) == tree


def test_integer_bounds_are_rounded_inward_and_failing_enum_values_dropped():
    assert check({"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4}, WHERE) == \
        {"type": "integer", "minimum": 2, "maximum": 3}
    assert check({"type": "string", "enum": ["a", 1, "b"]}, WHERE)["enum"] == ["a", "b"]


def _grammar(schema: dict):
    return xgr.Grammar.from_json_schema(json.dumps(check(schema, WHERE)), any_whitespace=False)


def test_a_ref_into_defs_is_enforced():
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
              "$defs": {"P": {"type": "string", "pattern": "^[0-9]{3}$"}}}
    g = _grammar(schema)
    assert accepts(g, '{"p": "123"}') and not accepts(g, '{"p": "a sentence"}')


def request(tools, **body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 "tool_choice": "required", "reasoning_effort": "none", **body})


def tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_forced_tool_calls_refuse_an_empty_enum_with_a_400_naming_it():
    body = request(tool({"type": "object", "properties": {"u": {"type": "string", "enum": []}}}))
    with pytest.raises(APIError) as e:
        _ = body.guide
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters.properties.u.enum"
    assert "`enum`" in e.value.message


def test_response_format_refuses_an_empty_enum_with_a_400_naming_it():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": []}}}})
    with pytest.raises(APIError) as e:
        _ = body.guide
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema.enum"


@pytest.mark.parametrize("parameters, field", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
    ({"type": "array"}, "type"),
    ({"anyOf": [{"type": "object"}]}, "anyOf"),
])
def test_what_dsml_cannot_carry_at_the_top_of_parameters_is_a_400(parameters, field):
    with pytest.raises(APIError) as e:
        _ = request(tool(parameters)).guide
    assert e.value.param == f"tools[0].function.parameters.{field}"


def test_the_grammar_holds_a_pattern_in_raw_and_json_form_and_names_of_any_characters():
    name = 'we<ird\n"na&me'
    tools = tool({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{3}$"},
                                                   name: {"$ref": "#/$defs/N"}},
                  "required": ["code", name], "$defs": {"N": {"type": "integer", "minimum": 2, "maximum": 5}}})
    g = xgr.Grammar.from_ebnf(tool_call_grammar(tools, "chat"))

    def text(args: dict) -> str:
        return render_tool_calls([{"function": {"name": "f", "arguments": json.dumps(args)}}])
    assert accepts(g, text({"code": "123", name: 3}))
    assert accepts(g, text({"code": "123", name: 3}).replace('string="true">123', 'string="false">"123"'))
    assert not accepts(g, text({"code": "a sentence", name: 3}))
    assert not accepts(g, text({"code": "123", name: 7}))


def test_reasoning_may_hold_a_closing_slash_and_string_values_a_less_than_sign():
    tools = tool({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    g = xgr.Grammar.from_ebnf(tool_call_grammar(tools, "thinking"))
    call = render_tool_calls([{"function": {"name": "f", "arguments": json.dumps({"s": "a < b </x"})}}])
    assert accepts(g, "x </b> y </thin" + "</think>" + call)
    assert not accepts(g, "x </think> y" + "</think>" + call)


def _bytes_accepted(ebnf: str, data: bytes) -> bool:
    vocab = [bytes([b]) for b in range(256)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=256, stop_token_ids=[0])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf), terminate_without_stop_token=True)
    return all(matcher.accept_token(b) for b in data) and matcher.is_terminated()


def test_non_ascii_enum_values_and_lengths_survive_the_grammar_text():
    """xgrammar prints "é" "b" as "\\xe9b" and reads it back as U+0E9B; and it reads a UTF-8-encoded
    surrogate (which decodes to three U+FFFD) as one character. The grammar text avoids both."""
    tools = tool({"type": "object", "properties": {"e": {"type": "array", "items": {"enum": ["éb"]}},
                                                   "s": {"type": "string", "maxLength": 2}},
                  "required": ["e", "s"]})
    ebnf = tool_call_grammar(tools, "chat")

    def text(s: str) -> bytes:
        return render_tool_calls([{"function": {"name": "f", "arguments": json.dumps({"e": ["éb"], "s": "x"})}}]
                                 ).replace('string="true">x<', f'string="true">{s}<').encode("utf-8", "surrogatepass")
    assert _bytes_accepted(ebnf, text("éS"))
    assert not _bytes_accepted(ebnf, text("\ud800S"))
