"""Forced tool calls hold their schema, as a property: hypothesis generates parameter schemas
(types, nested objects and arrays, enums, patterns, formats, length and numeric bounds, $defs
refs, property names and values of odd characters); each builds the forced-call grammar
(cluster/chat/dsv4_grammar.py), compiled by the engine's own GuideCompiler for the tiny V4
tokenizer; random walks over its token masks run until the grammar ends; the reply, decoded
as the engine decodes it, is read by the real parser, and every call's arguments validate
against the schema with `jsonschema`."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvmesh.cluster.chat.dsv4_encode import END_THINK, PARAM_CLOSE
from kvmesh.cluster.chat.dsv4_grammar import tool_call_grammar
from kvmesh.cluster.chat.dsv4_parse import ReplyParser
from tests.helpers import write_v4_tokenizer
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
from kvmesh.workers.sampling.grammar import GuideCompiler

jsonschema = pytest.importorskip("jsonschema")
VOCAB, EOS = 300, 1
STEPS, WALKS, FREE = 800, 2, 24
ODD = list('ab<>"&/\n\t ｜é') + ["</", "&amp;", PARAM_CLOSE, "</think>"]

names = st.lists(st.sampled_from(ODD), min_size=1, max_size=4).map("".join)
texts = st.lists(st.sampled_from(ODD + ["x", "1"]), max_size=4).map("".join)
PATTERNS = ["^[0-9]{3}$", "^[a-z]{1,4}$", "^(yes|no)$", "^<[a-z]{1,3}>$", "^[A-Z][a-z]{0,3}$"]


def strings():
    return st.one_of(
        st.just({"type": "string"}),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.sampled_from(["date", "uuid", "ipv4", "email"]).map(lambda f: {"type": "string", "format": f}),
        st.tuples(st.integers(0, 3), st.integers(0, 4)).map(
            lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
        st.lists(texts, min_size=1, max_size=3, unique=True).map(lambda v: {"type": "string", "enum": v}))


def scalars():
    return st.one_of(
        strings(), st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.tuples(st.integers(-50, 50), st.integers(0, 20)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.sampled_from([-1.5, 0, 2.25]).map(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}),
        st.lists(st.one_of(texts, st.integers(-3, 3), st.booleans(), st.none()), min_size=1, max_size=3,
                 unique_by=json.dumps).map(lambda v: {"enum": v}),
        st.just({"$ref": "#/$defs/Item"}))


def schemas():
    return st.recursive(scalars(), lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
        st.dictionaries(names, inner, min_size=1, max_size=3).flatmap(lambda props: st.builds(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False},
            st.lists(st.sampled_from(sorted(props)), unique=True))),
        st.lists(inner, min_size=2, max_size=2).map(lambda b: {"anyOf": b})), max_leaves=6)


def tools_strategy():
    item = st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 9},
                            {"type": "object", "properties": {"n": {"type": "string", "maxLength": 2},
                                                              "next": {"$ref": "#/$defs/Item"}},
                             "required": ["n"], "additionalProperties": False}])
    return st.tuples(st.dictionaries(names, schemas(), min_size=1, max_size=4), item).flatmap(
        lambda t: st.builds(lambda req: [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": t[0], "required": req, "$defs": {"Item": t[1]}}}}],
            st.lists(st.sampled_from(sorted(t[0])), unique=True)))


@pytest.fixture(scope="module")
def engine_parts(tmp_path_factory):
    path = write_v4_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)
    tok = load_tokenizer(path)
    compiler = GuideCompiler(tok, VOCAB, [EOS])
    yield tok, compiler
    compiler.close()


def walk(guide, tok, rng: random.Random) -> list[int]:
    """Random allowed tokens until the grammar ends or STEPS are taken. Free text (most tokens
    allowed) runs for up to FREE random tokens, then a closing literal that leaves it is written;
    after STEPS // 4 tokens, elsewhere the first allowed of the stop token and closing characters
    is taken, so that nesting winds down."""
    exits = [tok.encode_rendered(s) for s in (END_THINK, PARAM_CLOSE, '"', "]", "}", "\n")]
    closers = [EOS] + [t for c in ("</think>", '"', "]", "}", "/", "<") for t in tok.encode_rendered(c)]
    out: list[int] = []
    run, limit = 0, rng.randint(0, FREE)
    while len(out) < STEPS and not guide.done:
        allowed = guide.allowed().nonzero().flatten().tolist()
        assert allowed, f"the grammar allows no token after {tok.decode_markup(out)!r}"
        free = len(allowed) > VOCAB // 3
        run = run + 1 if free else 0
        choice = [rng.choice(allowed)]
        if free and run > limit:
            choice = next((ids for ids in exits if _fits(guide, ids)), choice)
            run, limit = 0, rng.randint(0, FREE)
        elif not free and len(out) > STEPS // 4:
            choice = [next((t for t in closers if t in allowed), choice[0])]
        for t in choice:
            guide.accept(t)
        out += choice
    return out


def _fits(guide, ids: list[int]) -> bool:
    """Accepts `ids` when the grammar takes them all and then leaves free text; else rolls back."""
    taken = 0
    for t in ids:
        if not guide.allowed()[t]:
            break
        guide.accept(t)
        taken += 1
    if taken == len(ids) and int(guide.allowed().sum()) <= VOCAB // 3:
        return True
    guide.matcher.rollback(taken)
    return False


def _check(tools, thinking, engine_parts, seed):
    tok, compiler = engine_parts
    ebnf = tool_call_grammar(tools, "thinking" if thinking else "chat", parallel=True)
    schema = tools[0]["function"]["parameters"]
    ended, cut = 0, ""
    for w in range(WALKS):
        guide = compiler.guide(("ebnf", ebnf))
        ids = walk(guide, tok, random.Random(seed * 31 + w))
        if not guide.done:
            cut = tok.decode_markup(ids)
            continue
        ended += 1
        parser = ReplyParser("thinking" if thinking else "chat", tools=True)
        text = tok.decode_markup(ids)
        parsed = [parser.feed(text), parser.finish()]
        calls = [c for p in parsed for c in p.calls]
        assert calls and all(c.name == "f" for c in calls), repr(text)
        assert "".join(p.content for p in parsed) == "", repr(text)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schema)
    assert ended, f"no walk reached the end of the grammar: {cut!r}"


# the same 12 examples every run, not shrunk (a few seconds); more, random: set derandomize=False
@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tools=tools_strategy(), thinking=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_every_forced_reply_parses_and_validates(engine_parts, tools, thinking, seed):
    _check(tools, thinking, engine_parts, seed)


def test_the_walk_reaches_hostile_text(engine_parts):
    """The free-text rules let `<`, `</` and the other closing literals' prefixes through: a
    reply whose reasoning and string value hold them parses back to them."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {'we<ird\n"name&': {"type": "string"}}, "required": ['we<ird\n"name&']}}}]
    tok, compiler = engine_parts
    guide = compiler.guide(("ebnf", tool_call_grammar(tools, "thinking")))
    value = "a < b </ c </｜DSML｜param"
    text = ("think </thin </ k" + END_THINK + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
            "<｜DSML｜parameter name=\"we&lt;ird&#10;&quot;name&amp;\" string=\"true\">" + value + PARAM_CLOSE
            + "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    for t in tok.encode_rendered(text) + [EOS]:
        assert guide.allowed()[t], t
        guide.accept(t)
    assert guide.done
    parser = ReplyParser("thinking", tools=True)
    parsed = [parser.feed(text), parser.finish()]
    assert parsed[0].reasoning == "think </thin </ k"
    assert [json.loads(c.arguments) for p in parsed for c in p.calls] == [{'we<ird\n"name&': value}]
