"""The grammar a V4 reply follows under `tool_choice` "required" or a named function
(xgrammar EBNF, compiled and enforced by the engine like `response_format`):

    root     ::= [reasoning "</think>"] "\\n\\n" block                   (reasoning in thinking mode)
    block    ::= "<｜DSML｜tool_calls>\\n" invoke ("\\n" invoke)* "\\n</｜DSML｜tool_calls>"
    invoke   ::= one alternative per allowed tool:
                 "<｜DSML｜invoke name=\\"f\\">\\n" param* "</｜DSML｜invoke>"
    param    ::= "<｜DSML｜parameter name=\\"k\\" string=\\"true\\">" raw-text "</｜DSML｜parameter>\\n"
               | "<｜DSML｜parameter name=\\"k\\" string=\\"false\\">" JSON-of-k's-schema "</｜DSML｜parameter>\\n"

Each tool's parameters schema is checked first (cluster/chat/json_schema.py): what the engine
cannot enforce, or what no value satisfies, is an InvalidRequestError naming the keyword and
its place (`tools[0].function.parameters.properties.code.pattern`), never a looser grammar.
Its declared properties come in schema order, the required ones always, the others optionally.
Any value may be written as JSON following its schema (xgrammar's JSON-schema grammar, rules
renamed per parameter, `$ref`s resolved against the tool's whole parameters schema, so
`#/$defs/…` and recursion work); a string may also be written as is (`string="true"`) where
that text alone can hold the schema: any text without the closing tag, an enum / const
value, text within minLength / maxLength without `<`, or a pattern's text where the pattern
cannot write `<` (a format, a pattern that can: JSON only).
Names are escaped as dsv4_encode.escape_name writes them, and the parser reads them back.

Free text ends at the first exact closing literal: reasoning may hold `</` but not
`</think>`, a raw string value `<` but not `</｜DSML｜parameter>` (`_excluding` writes "text
without S" as a regular expression, so the parser's first-match reading is the grammar's).
"""
from __future__ import annotations

import json
import re

from kvmesh.workers.sampling.params import InvalidRequestError

from kvmesh.cluster.chat import json_schema
from kvmesh.cluster.chat.dsv4_encode import CALLS_CLOSE, CALLS_OPEN, DSML, END_THINK, PARAM_CLOSE, escape_name

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX_ESCAPE = re.compile(r"\\(\\|x([0-9a-fA-F]{2}))")
TOP_LEVEL = {"type", "properties", "required", "additionalProperties", "unevaluatedProperties"}
NOT = "[^\\uD800-\\uDFFF"    # a negated class: xgrammar reads UTF-8-encoded surrogates as characters,
                               # which decode to three U+FFFD each (a maxLength broken), so none is one
SHARED = "basic_"              # xgrammar's rules every JSON-schema grammar has alike
ROOT_DEF = "kvmesh_root"        # where a parameter's grammar finds the tool's whole schema for $refs


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _excluding(s: str) -> str:
    """EBNF for any text that does not contain `s` (whose first character occurs only there):
    runs of partial matches of `s`, each ended by a character that breaks the match."""
    assert s[0] not in s[1:]
    first = s[0]

    def cls(c: str) -> str:
        return NOT + "".join("\\" + x if x in "\\]^-" else x for x in sorted({c, first})) + "]"
    partial = ""                     # "<" ("/" ("t" …)?)?: a prefix of s not followed by its next character
    broken = cls(s[-1])              # the same prefixes, each followed by a character breaking the match
    for k in range(len(s) - 2, 0, -1):
        partial = f"{_lit(s[k])} {partial}".strip() if not partial else f"{_lit(s[k])} ({partial})?"
        broken = f"{cls(s[k])} | {_lit(s[k])} ({broken})"
    partial = f"{_lit(first)} ({partial})?"
    broken = f"{_lit(first)} ({broken})"
    return f"({NOT}{first}] | ({partial})* ({broken}))* ({partial})*"


def _unambiguous(m: re.Match) -> str:
    return m.group() if m.group(1) == "\\" else "\\u00" + m.group(2)


def _renamed(ebnf: str, prefix: str, keep: str = "\0") -> str:
    """xgrammar's EBNF with every rule name prefixed. String literals and classes stay, but for
    their `\\xHH` escapes, which xgrammar prints and then reads with the hex digits after them
    ("\\xe9b" is "é" "b" printed, read as U+0E9B): written `\\u00HH`; and negated classes
    exclude surrogates (NOT). Rules whose names start with `keep` keep them."""
    names = {n for n in re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", ebnf, flags=re.MULTILINE)
             if not n.startswith(keep)}
    out, i = [], 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            text = _HEX_ESCAPE.sub(_unambiguous, ebnf[i:j + 1])
            out.append(NOT + text[2:] if text.startswith("[^") else text)
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
    """xgrammar's grammar of `schema`, its rules prefixed but for its `basic_` ones (string,
    number, any value: the same in every schema's grammar, kept once by `_joined`)."""
    import xgrammar as xgr
    return _renamed(str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)), prefix, SHARED)


def _joined(rules: list[str]) -> str:
    """The rules as one grammar, each shared rule once (a grammar of 300 string parameters is
    30x smaller, and compiles that much sooner, than with a copy per parameter)."""
    lines = dict.fromkeys(line for r in rules for line in r.splitlines() if line.strip())
    names = [line.split(" ::= ", 1)[0] for line in lines]
    if len(set(names)) < len(names):
        raise ValueError("xgrammar wrote two different `basic_` rules of one name")
    return "\n".join(lines)


def _with_root(schema: dict, root: dict) -> dict:
    """`schema` (a part of `root`) whose `$ref`s ("#…", meant for `root`) still resolve: root
    rides along under $defs and each reference is moved under it."""
    text = json.dumps(schema)
    if '"$ref"' not in text:
        return schema

    def moved(node):
        if isinstance(node, dict):
            return {k: (f"#/$defs/{ROOT_DEF}{v[1:]}" if k == "$ref" and isinstance(v, str)
                        else v if k in ("enum", "const", "default", "examples") else moved(v))
                    for k, v in node.items()}
        return [moved(v) for v in node] if isinstance(node, list) else node
    out = moved(schema)
    out["$defs"] = {**out.get("$defs", {}), ROOT_DEF: moved(root)}
    return out


def _may_hold(pattern: str, char: str) -> bool:
    """Whether text matching the regular expression can hold `char` (True when unsure)."""
    import re._parser as sre
    c = ord(char)

    def node(op, av) -> bool:
        name = str(op)
        if name == "LITERAL":
            return av == c
        if name == "NOT_LITERAL":
            return av != c
        if name == "IN":
            hit = any(str(o) == "LITERAL" and a == c or str(o) == "RANGE" and a[0] <= c <= a[1]
                      or str(o) == "CATEGORY" and "NOT" in str(a) for o, a in av)
            return hit != any(str(o) == "NEGATE" for o, _ in av)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            return av[1] > 0 and seq(av[2])
        if name in ("SUBPATTERN", "ATOMIC_GROUP"):
            return seq(av[-1] if name == "SUBPATTERN" else av)
        if name == "BRANCH":
            return any(seq(b) for b in av[1])
        return name != "AT"              # ANY, anything unforeseen: maybe

    def seq(items) -> bool:
        return any(node(op, av) for op, av in items)
    return seq(sre.parse(pattern))


def _raw_string(schema: dict, prefix: str, rules: list[str]) -> str | None:
    """EBNF of a string value written as is that holds `schema` (a string schema), or None."""
    if "enum" in schema or "const" in schema:
        values = [v for v in schema.get("enum", [schema.get("const")]) if PARAM_CLOSE not in v]
        return " | ".join(_lit(v) for v in values) or None
    if "format" in schema or "pattern" in schema and _may_hold(schema["pattern"], "<"):
        return None
    if "pattern" in schema:
        import xgrammar as xgr
        rules.append(_renamed(str(xgr.Grammar.from_regex(schema["pattern"])), prefix))
        return f"{prefix}root"
    if "minLength" in schema or "maxLength" in schema:
        return f'{NOT}<]{{{schema.get("minLength", 0)},{schema.get("maxLength", "")}}}'
    rules.append(f"raw_text ::= {_excluding(PARAM_CLOSE)}")       # one rule, however many use it
    return "raw_text"


def _param(tool: int, k: int, key: str, schema: dict, root: dict, rules: list[str]) -> str:
    name = f"t{tool}_p{k}"
    head, tail = f'<{DSML}parameter name="{escape_name(key)}" string=', _lit(PARAM_CLOSE + "\n")
    rules.append(_json_rules(_with_root(schema, root), f"{name}_"))
    alts = [f'{_lit(head + chr(34) + "false" + chr(34) + ">")} {name}_root']
    raw = _raw_string(schema, f"{name}_raw_", rules) if schema.get("type") == "string" else None
    if raw is not None:
        alts.append(f'{_lit(head + chr(34) + "true" + chr(34) + ">")} ({raw})')
    rules.append(f"{name} ::= ({' | '.join(alts)}) {tail}")
    return name


def _checked_parameters(fn: dict, where: str) -> dict:
    """A tool's parameters schema, checked (json_schema.check) and with what DSML can carry at
    its top: an object of declared properties. Raises InvalidRequestError naming the keyword."""
    params = fn.get("parameters")
    params = {"type": "object", **params} if isinstance(params, dict) else params if params is not None else {}
    params = json_schema.check(params, where)
    if params.get("type", "object") != "object":
        raise InvalidRequestError("`type` must be \"object\": a call's arguments are named parameters",
                                  f"{where}.type")
    extra = [k for k in params if k not in TOP_LEVEL and k not in json_schema.ANNOTATIONS]
    if extra:
        raise InvalidRequestError(f"`{extra[0]}` is not supported at the top of a tool's parameters "
                                  "(a call's arguments are DSML parameters)", f"{where}.{extra[0]}")
    return params


def _invoke(i: int, fn: dict, where: str, rules: list[str]) -> str:
    params = _checked_parameters(fn, where)
    required = set(params.get("required") or [])
    parts = []
    for k, (key, schema) in enumerate((params.get("properties") or {}).items()):
        rule = _param(i, k, key, schema if isinstance(schema, dict) else {}, params, rules)
        parts.append(rule if key in required else f"({rule})?")
    opener = f'<{DSML}invoke name="{escape_name(fn["name"])}">\n'
    rules.append(f't{i} ::= {_lit(opener)} {" ".join(parts)} {_lit(f"</{DSML}invoke>")}')
    return f"t{i}"


def tool_call_grammar(tools: list[dict], mode: str, parallel: bool = True, name: str | None = None) -> str:
    """EBNF for a reply that is a tool-call block calling `name` (or any of `tools`). Raises
    InvalidRequestError (field `tools[i].function.parameters…`) for a schema it cannot enforce."""
    rules: list[str] = []
    alts = [_invoke(i, t["function"], f"tools[{i}].function.parameters", rules)
            for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]
    rules.append(f"invoke ::= {' | '.join(alts)}")
    more = ' ("\\n" invoke)*' if parallel and name is None else ""
    rules.append(f'block ::= {_lit(CALLS_OPEN + chr(10))} invoke{more} {_lit(chr(10) + CALLS_CLOSE)}')
    if mode == "thinking":
        rules.append(f"reasoning ::= {_excluding(END_THINK)}")
        rules.append(f'root ::= reasoning {_lit(END_THINK)} "\\n\\n" block')
    else:
        rules.append('root ::= "\\n\\n" block')
    return _joined(rules)


def after_reasoning(guide: tuple[str, str]) -> tuple[str, str]:
    """A `response_format` guide for a V4 reply in thinking mode: the reasoning, `</think>`, then
    the JSON (the guide alone would force JSON where the reasoning goes)."""
    kind, schema = guide
    rules = _json_rules(json.loads(schema) if kind == "json_schema" else {"type": "object"}, "json_")
    return ("ebnf", _joined([rules, f"reasoning ::= {_excluding(END_THINK)}",
                               f"root ::= reasoning {_lit(END_THINK)} json_root"]))
