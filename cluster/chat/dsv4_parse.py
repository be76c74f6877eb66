"""DeepSeek-V4's reply, parsed as it streams: reasoning, content and DSML tool calls.

    [reasoning]</think>[content][\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="f">\\n
        <｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>\\n ... </｜DSML｜invoke>\\n
    ...</｜DSML｜tool_calls>]                         (thinking mode; chat mode starts at the content)

`ReplyParser.feed(text)` takes the reply's text as decoded with the markup tokens kept
(BOS/EOS gone) and returns what became final: reasoning and content pieces, and each tool
call once its invoke closes well-formed. Text that could still be the start of a marker is
held back, so no `<think>`, `</think>` or DSML text ever reaches reasoning or content.
`finish()` ends the reply. Streamed and whole replies give the same result: the whole one is
one `feed` and `finish`.

Names are unescaped (dsv4_encode.escape_name's XML character references); a `string="true"`
value is the text up to the first `</｜DSML｜parameter>` (it may hold `<`), a `string="false"`
value is one JSON value, so a JSON string may hold the closing tag itself.

Malformed DSML (an unknown shape, a `string="false"` value that is not JSON) is not a call:
from the first malformed invoke on, the text is content, as the model wrote it. A block cut
by the end of the reply (max_tokens) loses only its unfinished invoke.
"""
from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from kvmesh.cluster.chat.dsv4_encode import CALLS_CLOSE, CALLS_OPEN, DSML, END_THINK, PARAM_CLOSE, THINK, unescape_name

INVOKE_OPEN, INVOKE_CLOSE = f'<{DSML}invoke name="', f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
STRAY = (THINK, END_THINK)           # dropped wherever they appear in content


class ToolCall(NamedTuple):
    index: int
    id: str
    name: str
    arguments: str                   # JSON text of an object
    pieces: tuple[str, ...]          # the arguments in the pieces a stream sends (they join to it)


class Parsed(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCall]


class _Partial(Exception):
    """The text ends inside an invoke that may still become well-formed."""


class _Malformed(Exception):
    pass


def _expect(s: str, p: int, literal: str) -> int:
    if s.startswith(literal, p):
        return p + len(literal)
    if literal.startswith(s[p:]):
        raise _Partial
    raise _Malformed


def _until(s: str, p: int, end: str, forbidden: str = "<\n") -> tuple[str, int]:
    q = s.find(end, p)
    if q < 0:
        if any(c in s[p:] for c in forbidden):
            raise _Malformed
        raise _Partial
    if any(c in s[p:q] for c in forbidden):
        raise _Malformed
    return s[p:q], q + len(end)


def _skip_space(s: str, p: int) -> int:
    while p < len(s) and s[p] in " \n":
        p += 1
    return p


def _value(s: str, p: int, is_string: str) -> tuple[object, int]:
    """The parameter value at s[p:] -> (value, index of its closing tag)."""
    q = s.find(PARAM_CLOSE, p)
    if is_string == "true":
        if q < 0:
            raise _Partial
        return s[p:q], q
    inside = True                # no closing tag yet: the value may still come
    while q >= 0:                # the first closing tag after a whole JSON value (a JSON string may hold one)
        try:
            return json.loads(s[p:q], strict=False), q    # xgrammar lets raw control characters into strings
        except (ValueError, RecursionError) as e:
            inside = getattr(e, "msg", "").startswith("Unterminated string")    # the tag sits in a string
        q = s.find(PARAM_CLOSE, q + 1)
    raise _Partial if inside else _Malformed


def scan_invoke(s: str, p: int) -> tuple[str, dict, int]:
    """One `<｜DSML｜invoke …>…</｜DSML｜invoke>` at s[p:] -> (name, arguments, end)."""
    p = _expect(s, p, INVOKE_OPEN)
    name, p = _until(s, p, '">')
    name = unescape_name(name)
    p = _skip_space(s, p)
    args: dict = {}
    while True:
        if s.startswith(INVOKE_CLOSE, p):
            return name, args, p + len(INVOKE_CLOSE)
        if not s.startswith(PARAM_OPEN, p):
            if INVOKE_CLOSE.startswith(s[p:]) or PARAM_OPEN.startswith(s[p:]):
                raise _Partial
            raise _Malformed
        key, p = _until(s, p + len(PARAM_OPEN), '" string="')
        key = unescape_name(key)
        is_string, p = _until(s, p, '">')
        if is_string not in ("true", "false") or key in args:
            raise _Malformed
        args[key], q = _value(s, p, is_string)
        p = _skip_space(s, q + len(PARAM_CLOSE))


def argument_pieces(args: dict) -> tuple[str, ...]:
    """`json.dumps(args)` cut after each parameter: '{"a": 1', ', "b": 2', '}'."""
    if not args:
        return ("{}",)
    items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in args.items()]
    return ("{" + items[0], *(", " + i for i in items[1:]), "}")


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    for k in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ReplyParser:
    """One choice's reply. mode "thinking" starts in the reasoning; `tools`: parse DSML calls
    (with none, DSML text is content); `parallel`: keep more than the first call; `verbatim`:
    content is kept as written, stray `<think>` text too (a grammar-guided JSON reply, whose
    strings may hold it)."""

    def __init__(self, mode: str, tools: bool, parallel: bool = True, verbatim: bool = False):
        self.state = "reasoning" if mode == "thinking" else "content"
        self.tools, self.parallel, self.verbatim = tools, parallel, verbatim
        self.buf = ""
        self.calls: list[ToolCall] = []
        self._after_block = False
        self._fresh = False          # in a block: no call parsed yet (buf still starts with the opener)

    def feed(self, text: str, final: bool = False) -> Parsed:
        self.buf += text
        reasoning, content, calls = [], [], []
        while True:
            before = (self.state, len(self.buf))
            if self.state == "reasoning":
                reasoning.append(self._reasoning(final))
            elif self.state == "content":
                content.append(self._content(final))
            elif self.state == "calls":
                calls += self._calls(final)
            else:                        # "raw": after a block, text is content as written
                if self._after_block:    # the blank between the block and text after it is no text
                    self.buf = self.buf.lstrip(" \n")
                    self._after_block = not self.buf
                content.append(self._strip(self.buf))
                self.buf = ""
            if (self.state, len(self.buf)) == before:
                break
        self.calls += calls
        return Parsed("".join(reasoning), "".join(content), calls)

    def finish(self) -> Parsed:
        return self.feed("", final=True)

    def _reasoning(self, final: bool) -> str:
        q = self.buf.find(END_THINK)
        if q >= 0:
            out, self.buf, self.state = self.buf[:q], self.buf[q + len(END_THINK):], "content"
            return out.replace(THINK, "")
        keep = 0 if final else _held(self.buf, STRAY)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out.replace(THINK, "")

    def _content(self, final: bool) -> str:
        q = self.buf.find(CALLS_OPEN) if self.tools else -1
        if q >= 0:                   # the block is kept as written (its values may hold `</think>`)
            before = self._strip(self.buf[:q])
            head = before.rstrip(" \n")
            self.buf, self.state, self._fresh = before[len(head):] + self.buf[q:], "calls", True
            return head
        text = self._strip(self.buf)
        markers = (() if self.verbatim else STRAY) + ((CALLS_OPEN,) if self.tools else ())
        keep = _held(text, markers)
        if final:                # a cut opener (it starts with a full-width bar, never prose) is dropped
            cut = self.tools and keep and text[len(text) - keep:].startswith(CALLS_OPEN[:2])
            self.buf = ""
            return text[:len(text) - keep].rstrip(" \n") if cut else text
        if self.tools:                       # blank lines may be the separator before a block
            keep = len(text) - len(text[:len(text) - keep].rstrip(" \n"))
        self.buf = text[len(text) - keep:]
        return text[:len(text) - keep]

    def _strip(self, text: str) -> str:
        if self.verbatim:
            return text
        for m in STRAY:
            text = text.replace(m, "")
        return text

    def _calls(self, final: bool) -> list[ToolCall]:
        """Invokes that closed since the last feed. `buf` holds the block from its blank line and
        opener (until the first call) or from the end of the last call: raw text, so that a
        malformed rest can stay content as written."""
        out: list[ToolCall] = []
        s = self.buf
        p = _skip_space(s, 0) + len(CALLS_OPEN) if self._fresh else 0
        try:
            while True:
                p = _skip_space(s, p)
                if s.startswith(CALLS_CLOSE, p):
                    self.buf, self.state, self._after_block = s[p + len(CALLS_CLOSE):], "raw", True
                    return out
                if p == len(s) or CALLS_CLOSE.startswith(s[p:]):
                    raise _Partial
                name, args, p = scan_invoke(s, p)
                if self.parallel or not (self.calls or out):
                    out.append(ToolCall(len(self.calls) + len(out), f"call_{uuid.uuid4().hex[:24]}", name,
                                        json.dumps(args, ensure_ascii=False), argument_pieces(args)))
                s, p, self._fresh = s[p:], 0, False
                self.buf = s
        except _Partial:
            if final:                    # cut by the end of the reply: the unfinished invoke is dropped
                self.buf, self.state = "", "raw"
        except _Malformed:               # calls before it stand; from here on the text is content
            self.state = "raw"
        return out
