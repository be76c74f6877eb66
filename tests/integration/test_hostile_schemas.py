"""Hostile schemas over HTTP (issue 31 item 1), on the default tiny app (the session's shared
colocated app): with tool_choice required a string `pattern` holds, a property name holding `<`
and a newline comes back as a parsed tool call, a `$ref` into `$defs` is followed; `enum: []`
is a 400 naming `enum`; response_format json_schema holds a pattern, and `<think>` text inside
its strings."""
from __future__ import annotations

import json
import re

import httpx
import pytest


pytestmark = pytest.mark.slow     # a Serve app on the session's Ray

jsonschema = pytest.importorskip("jsonschema")
ASK = [{"role": "user", "content": "Call the tool."}]
ODD = 'a<b\nc"&'


@pytest.fixture(scope="module")
def url(local_serve):
    return local_serve.deploy_many({}, shared=("colocated",))["colocated"]     # the session's default app


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as c:
        yield c


def chat(http, url, **body) -> httpx.Response:
    return http.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 160, "temperature": 1.0,
                                                         "reasoning_effort": "none", **body})


def tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def forced_calls(http, url, parameters: dict) -> list[dict]:
    """The arguments of the first seed's reply that ends (a model may ramble in a free value up to
    max_tokens); each validated against `parameters`."""
    for seed in range(4):
        r = chat(http, url, tools=tool(parameters), tool_choice="required", seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        args = [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        for a in args:
            jsonschema.validate(a, parameters)
        return args
    pytest.fail("no seed's reply ended within max_tokens")


def test_a_pattern_holds_under_tool_choice_required(http, url):
    params = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{3}$"}},
              "required": ["code"]}
    assert all(re.fullmatch("[0-9]{3}", a["code"]) for a in forced_calls(http, url, params))


def test_a_property_name_with_markup_characters_comes_back_as_a_call(http, url):
    params = {"type": "object", "properties": {ODD: {"type": "integer", "minimum": 3, "maximum": 5}},
              "required": [ODD]}
    assert all(list(a) == [ODD] and 3 <= a[ODD] <= 5 for a in forced_calls(http, url, params))


def test_a_ref_into_defs_is_followed(http, url):
    params = {"type": "object", "properties": {"when": {"$ref": "#/$defs/Day"}}, "required": ["when"],
              "$defs": {"Day": {"type": "string", "enum": ["mon", "tue"]}}}
    assert all(a["when"] in ("mon", "tue") for a in forced_calls(http, url, params))


def test_an_empty_enum_is_a_400_naming_it(http, url):
    params = {"type": "object", "properties": {"u": {"type": "string", "enum": []}}, "required": ["u"]}
    r = chat(http, url, tools=tool(params), tool_choice="required")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools[0].function.parameters.properties.u.enum" and "`enum`" in error["message"]
    r = chat(http, url, response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": []}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema.enum"


def test_response_format_json_schema_holds_a_pattern(http, url):
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["zip"], "additionalProperties": False}
    for seed in range(4):
        r = chat(http, url, seed=seed, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "z", "schema": schema}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            return
    pytest.fail("no seed's reply ended within max_tokens")


def test_response_format_keeps_think_markup_inside_json_strings(http, url):
    schema = {"type": "object", "properties": {"t": {"const": "<think>a</think>"}}, "required": ["t"],
              "additionalProperties": False}
    r = chat(http, url, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"t": "<think>a</think>"}
