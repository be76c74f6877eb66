"""The grammar a V4 reply follows under `tool_choice` "required" or a named function
(xgrammar EBNF, compiled and enforced by the engine like `response_format`):

    root     ::= ["…reasoning…" "</think>"] "\\n\\n" block              (reasoning in thinking mode)
    block    ::= "<｜DSML｜tool_calls>\\n" invoke ("\\n" invoke)* "\\n</｜DSML｜tool_calls>"
    invoke   ::= one alternative per allowed tool:
                 "<｜DSML｜invoke name=\\"f\\">\\n" param* "</｜DSML｜invoke>"
    param    ::= "<｜DSML｜parameter name=\\"k\\" string=\\"true\\">" text-without-< "</｜DSML｜parameter>\\n"
               | "<｜DSML｜parameter name=\\"k\\" string=\\"false\\">" JSON-of-k's-schema "</｜DSML｜parameter>\\n"

Each tool's declared properties come in schema order, the required ones always, the others
optionally; a string property (or a string enum) is written as is, anything else as JSON
following its schema (xgrammar's own JSON-schema grammar, its rules renamed per parameter).
Reasoning may not contain "</", so the first `</think>` ends it, as the parser reads it.
"""
from __future__ import annotations

import json
import re

from cluster.chat.dsv4_encode import CALLS_CLOSE, CALLS_OPEN, DSML, END_THINK

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _renamed(ebnf: str, prefix: str) -> str:
    """xgrammar's EBNF with every rule name prefixed (string literals and classes left alone)."""
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", ebnf, flags=re.MULTILINE))
    out, i = [], 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif (m := _IDENT.match(ebnf, i)) and (i == 0 or not ebnf[i - 1].isalnum()):
            word = m.group()
            out.append(prefix + word if word in names else word)
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _json_rules(schema: dict, prefix: str) -> str:
    import xgrammar as xgr
    return _renamed(str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)), prefix)


def _param(tool: int, k: int, key: str, schema: dict, rules: list[str]) -> str:
    name = f"t{tool}_p{k}"
    head = f'<{DSML}parameter name="{key}" string='
    if schema.get("type") == "string":
        value = " | ".join(_lit(v) for v in schema["enum"]) if "enum" in schema else "[^<]*"
        rules.append(f'{name} ::= {_lit(head + chr(34) + "true" + chr(34) + ">")} ({value}) '
                     f'{_lit(f"</{DSML}parameter>" + chr(10))}')
    else:
        rules.append(_json_rules(schema, f"{name}_"))
        rules.append(f'{name} ::= {_lit(head + chr(34) + "false" + chr(34) + ">")} {name}_root '
                     f'{_lit(f"</{DSML}parameter>" + chr(10))}')
    return name


def _invoke(i: int, fn: dict, rules: list[str]) -> str:
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    parts = []
    for k, (key, schema) in enumerate((params.get("properties") or {}).items()):
        rule = _param(i, k, key, schema if isinstance(schema, dict) else {}, rules)
        parts.append(rule if key in required else f"({rule})?")
    rules.append(f't{i} ::= {_lit(f"<{DSML}invoke name=" + chr(34) + fn["name"] + chr(34) + ">" + chr(10))} '
                 f'{" ".join(parts)} {_lit(f"</{DSML}invoke>")}')
    return f"t{i}"


def tool_call_grammar(tools: list[dict], mode: str, parallel: bool = True, name: str | None = None) -> str:
    """EBNF for a reply that is a tool-call block calling `name` (or any of `tools`)."""
    rules: list[str] = []
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    alts = [_invoke(i, fn, rules) for i, fn in enumerate(fns)]
    rules.append(f"invoke ::= {' | '.join(alts)}")
    more = ' ("\\n" invoke)*' if parallel and name is None else ""
    rules.append(f'block ::= {_lit(CALLS_OPEN + chr(10))} invoke{more} {_lit(chr(10) + CALLS_CLOSE)}')
    if mode == "thinking":
        rules.append('reasoning ::= ([^<] | "<" [^/<])*')
        rules.append(f'root ::= reasoning {_lit(END_THINK)} "\\n\\n" block')
    else:
        rules.append('root ::= "\\n\\n" block')
    return "\n".join(rules)


def after_reasoning(guide: tuple[str, str]) -> tuple[str, str]:
    """A `response_format` guide for a V4 reply in thinking mode: the reasoning, `</think>`, then
    the JSON (the guide alone would force JSON where the reasoning goes)."""
    kind, schema = guide
    rules = _json_rules(json.loads(schema) if kind == "json_schema" else {"type": "object"}, "json_")
    return ("ebnf", "\n".join([rules, 'reasoning ::= ([^<] | "<" [^/<])*',
                               f"root ::= reasoning {_lit(END_THINK)} json_root"]))
