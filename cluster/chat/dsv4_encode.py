"""DeepSeek-V4's chat format, implemented here (the released checkpoints ship no Jinja
template; their format is DeepSeek's `encoding/encoding_dsv4.py`, which kvmesh never runs).

    BOS [max-effort prefix] system [tools block] <｜latest_reminder｜>…
        <｜User｜>{user, <tool_result>…</tool_result> blocks}<｜Assistant｜><think>       thinking mode
        <｜User｜>…<｜Assistant｜></think>                                                 chat mode
    an earlier assistant turn:  [{reasoning}</think>]{content}[\\n\\n<｜DSML｜tool_calls>…]<｜end▁of▁sentence｜>

Rules kept exactly as the reference encoder has them (the tests pin its published cases):
* thinking mode drops the reasoning of assistant turns before the last user message (and
  developer messages there) unless any message carries tools; chat mode never shows it;
* request tools go into the first system message's tools block (one is made when none);
* `tool` messages merge into a user turn as `<tool_result>` blocks, ordered by the calls of
  the assistant turn before them; a user message right after joins that turn;
* assistant `tool_calls` re-render as DSML: `string="true"` for string values, JSON otherwise.

Where the reference writes text as is, kvmesh escapes what would break the markup, so any
text reads back exactly (cluster/chat/dsv4_parse.py) and the forced-call grammar writes the
same: a tool or parameter name escapes `&`, `"`, `<`, `>` and control characters as XML
character references (`&amp;`, `&quot;`, `&lt;`, `&gt;`, `&#10;`); a string value that contains
the closing `</｜DSML｜parameter>` is written as JSON (`string="false"`), any other as is.

Messages are plain dicts in OpenAI's shape (`reasoning` / `reasoning_content`, `tool_calls`,
`tool_call_id`); `encode_messages` returns the prompt text (tokenize without adding BOS).

`encode_segments` returns the same text cut into markup and content: what a client wrote (message
text, reasoning, tool results, tool schemas, history calls' names and arguments) is content, to be
tokenized as text, so that `<｜Assistant｜>` typed by a user never becomes the turn token
(`Tokenizer.encode_segments`). While rendering, content travels wrapped in two lone surrogates,
code points no valid text holds (a JSON body cannot carry them), and is cut out at the end.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK, END_THINK = "<think>", "</think>"
USER, ASSISTANT, LATEST_REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
PARAM_CLOSE = f"</{DSML}parameter>"
_ENTITIES = {"&": "&amp;", '"': "&quot;", "<": "&lt;", ">": "&gt;"}
_NAMED = {v[1:-1]: k for k, v in _ENTITIES.items()}
_UNSAFE = re.compile(r'[&"<>\x00-\x1f\x7f]')
_REFERENCE = re.compile(r"&(amp|quot|lt|gt|#[0-9]{1,7});")
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK, END_THINK)
TASK_TOKENS = {t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title", "read_url")}
THINKING, CHAT = "thinking", "chat"
CONTENT_OPEN, CONTENT_CLOSE = "\ud800", "\udfff"        # lone surrogates: never in valid text
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTENT = re.compile(f"{CONTENT_OPEN}(.*?){CONTENT_CLOSE}", re.DOTALL)
_UNMARK = {ord(CONTENT_OPEN): None, ord(CONTENT_CLOSE): None}

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """OpenAI `tools` ([{"type": "function", "function": {...}}]) -> the tools block."""
    schemas = "\n".join(to_json(t["function"]) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def escape_name(name: str) -> str:
    """A tool or parameter name as the DSML attribute holds it."""
    return _UNSAFE.sub(lambda m: _ENTITIES.get(m.group(), f"&#{ord(m.group())};"), name)


def unescape_name(text: str) -> str:
    """`escape_name`'s inverse (other `&` text stays as written)."""
    def one(m: re.Match) -> str:
        ref = m.group(1)
        if ref[0] != "#":
            return _NAMED[ref]
        return chr(int(ref[1:])) if int(ref[1:]) <= 0x10FFFF else m.group()
    return _REFERENCE.sub(one, text)


def render_parameter(name: str, value: Any) -> str:
    """One DSML parameter: a string as is unless it holds the closing tag, anything else as JSON."""
    raw = isinstance(value, str) and PARAM_CLOSE not in value
    return (f'<{DSML}parameter name="{escape_name(name)}" string="{"true" if raw else "false"}">'
            f'{value if raw else to_json(value)}{PARAM_CLOSE}')


def render_arguments(arguments: str | dict | None) -> str:
    """A call's arguments (JSON text or a dict) as DSML parameters, one per line."""
    args = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else arguments
    return "\n".join(render_parameter(k, v) for k, v in (args or {}).items())


def render_tool_calls(calls: list[dict]) -> str:
    invokes = "\n".join(f'<{DSML}invoke name="{escape_name(c["function"]["name"])}">\n'
                        f'{render_arguments(c["function"].get("arguments"))}\n</{DSML}invoke>' for c in calls)
    return f"\n\n{CALLS_OPEN}\n{invokes}\n{CALLS_CLOSE}"


def _last_user(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)


def _with_tool_results(messages: list[dict]) -> list[dict]:
    """User and `tool` messages -> user turns of content blocks (consecutive ones join one turn);
    each turn remembers the call order of the assistant turn before it."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id") or "", "content": m.get("content") or ""}
            joins = out and out[-1]["role"] == "user"
        elif m["role"] == "user":
            block = {"type": "text", "text": m.get("content") or ""}
            joins = out and out[-1]["role"] == "user" and out[-1].get("task") is None
        else:
            out.append(m)
            continue
        if joins:
            out[-1]["blocks"].append(block)
        else:
            out.append({"role": "user", "blocks": [block], **({"task": m["task"]} if "task" in m else {})})
    order: dict[str, int] = {}
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: i for i, c in enumerate(m["tool_calls"]) if c.get("id")}
        elif m["role"] == "user":
            m["order"] = order
    return out


def _blocks_text(msg: dict) -> str:
    order = msg.get("order") or {}
    results = iter(sorted((b for b in msg["blocks"] if b["type"] == "tool_result"),
                          key=lambda b: order.get(b["id"], 0)))
    parts = [next(results) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return "\n\n".join(f"<tool_result>{b['content']}</tool_result>" if b["type"] == "tool_result" else b["text"]
                       for b in parts)


def _drop_reasoning(messages: list[dict]) -> list[dict]:
    last = _last_user(messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last or m["role"] in ("user", "system", "tool", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning"})
    return out


def _with_tools_block(text: str, m: dict) -> str:
    if m.get("tools"):
        text += "\n\n" + render_tools(m["tools"])
    if m.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT.format(schema=to_json(m["response_format"]))
    return text


def _render(i: int, messages: list[dict], mode: str, drop: bool, effort: str | None, last: int) -> str:
    m = messages[i]
    role = m["role"]
    text = REASONING_EFFORT_MAX if i == 0 and mode == THINKING and effort == "max" else ""
    if role == "system":
        text += _with_tools_block(m.get("content") or "", m)
    elif role == "developer":
        text += USER + _with_tools_block(m.get("content") or "", m)
    elif role == "user":
        text += USER + _blocks_text(m)
    elif role == "latest_reminder":
        text += LATEST_REMINDER + (m.get("content") or "")
    elif role == "assistant":
        after_task = i > 0 and messages[i - 1].get("task") is not None
        shown = mode == THINKING and not after_task and (not drop or i > last)
        reasoning = (m.get("reasoning") or "") + END_THINK if shown else ""
        calls = render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
        text += reasoning + (m.get("content") or "") + calls + EOS
    else:
        raise ValueError(f"unknown role {role!r}")
    if i + 1 < len(messages) and messages[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return text
    task = m.get("task")
    if task is not None:
        if task != "action":
            return text + TASK_TOKENS[task]
        return text + ASSISTANT + (THINK if mode == THINKING else END_THINK) + TASK_TOKENS[task]
    if role in ("user", "developer"):
        opens = mode == THINKING and (not drop or i >= last)
        text += ASSISTANT + (THINK if opens else END_THINK)
    return text


def encode_messages(messages: list[dict], mode: str = THINKING, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None, add_bos: bool = True) -> str:
    """The prompt text of a conversation; `tools` (the request's) join the first system message."""
    return _encode_marked(messages, mode, reasoning_effort, tools, add_bos).translate(_UNMARK)


def encode_segments(messages: list[dict], mode: str = THINKING, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None, add_bos: bool = True) -> list[tuple[str, bool]]:
    """`encode_messages`' text as (text, is_content) pieces in order, markup and content
    alternating (the first and last are markup, possibly empty)."""
    marked = _encode_marked(messages, mode, reasoning_effort, tools, add_bos)
    out, pos = [], 0
    for m in _CONTENT.finditer(marked):
        out += [(marked[pos:m.start()], False), (m.group(1), True)]
        pos = m.end()
    return out + [(marked[pos:], False)]


def _encode_marked(messages: list[dict], mode: str, reasoning_effort: str | None, tools: list[dict] | None,
                   add_bos: bool) -> str:
    """The prompt text with every piece of content between CONTENT_OPEN and CONTENT_CLOSE."""
    if mode not in (THINKING, CHAT):
        raise ValueError(f"mode must be {THINKING!r} or {CHAT!r}, got {mode!r}")
    messages = [_normalized(m) for m in messages]
    tools = _content_tools(tools)
    if tools:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "tools": tools}
        else:
            messages.insert(0, {"role": "system", "tools": tools})
    messages = _with_tool_results(messages)
    drop = not any(m.get("tools") for m in messages)
    if mode == THINKING and drop:
        messages = _drop_reasoning(messages)
    last = _last_user(messages)
    return (BOS if add_bos else "") + "".join(_render(i, messages, mode, drop, reasoning_effort, last)
                                              for i in range(len(messages)))


def _normalized(m: dict) -> dict:
    """OpenAI's spellings -> the encoder's: `reasoning_content` is `reasoning`, list content is text;
    what the client wrote marked as content (history calls' arguments parsed to do so)."""
    m = copy.copy(m)
    if m.get("reasoning") is None and m.get("reasoning_content") is not None:
        m["reasoning"] = m["reasoning_content"]
    if isinstance(m.get("content"), list):
        m["content"] = "".join(p["text"] for p in m["content"] if p.get("type") == "text")
    for key in ("content", "reasoning", "response_format"):
        m[key] = _content_tree(m.get(key))
    m["tools"] = _content_tools(m.get("tools"))
    if m.get("tool_calls"):
        m["tool_calls"] = [{**c, "function": {**c["function"], "name": _content_tree(c["function"]["name"]),
                                              "arguments": _content_tree(_arguments(c["function"]))}}
                           for c in m["tool_calls"]]
    return m


def _arguments(function: dict) -> dict | None:
    args = function.get("arguments")
    return json.loads(args) if isinstance(args, str) and args.strip() else args


def _content_tools(tools: list[dict] | None) -> list[dict] | None:
    return tools and [{**t, "function": _content_tree(t["function"])} for t in tools]


def _content_tree(value: Any) -> Any:
    """`value` with every non-empty string in it (JSON keys too) marked as content."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ValueError("the text holds a lone surrogate code point, which is not valid Unicode")
        return CONTENT_OPEN + value + CONTENT_CLOSE if value else value
    if isinstance(value, dict):
        return {_content_tree(k): _content_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_content_tree(v) for v in value]
    return value
