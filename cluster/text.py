"""Text at the API edge: chat prompts and incremental detokenization with stop strings.

A chat request's prompt comes from the checkpoint's Jinja template when it has one, else
from DeepSeek-V4's own format (cluster/chat_dsv4.py) for a V4 tokenizer, else from the
plain template below.

The plain chat template (used when a checkpoint ships none) is one header line per
message, then the assistant header the model continues from:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""
from __future__ import annotations

import json

from . import chat_dsv4

REPLACEMENT = "\ufffd"   # what a decoder emits for an incomplete UTF-8 sequence


def plain_chat_prompt(messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(template: str | None, messages: list[tuple[str, str]], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **template_kwargs) -> str:
    """The checkpoint's Jinja chat template rendered as transformers' `apply_chat_template`
    renders it (the tokenizer's special tokens, then `chat_template_kwargs` such as V4's
    `thinking` switch, over them), or the plain one."""
    if not template:
        return plain_chat_prompt(messages, add_generation_prompt)
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise ValueError(message)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    variables = {"bos_token": bos_token, "eos_token": eos_token, **template_kwargs}
    return env.from_string(template).render(
        messages=[{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=add_generation_prompt, **variables)


def chat_prompt_ids(tokenizer, body) -> list[int]:
    """A ChatCompletionRequest's prompt ids in the tokenizer's chat format; every refusal is a 400."""
    from .api import bad_request
    if tokenizer.chat_format == "dsv4":
        try:
            messages = [m.as_dict() for m in body.messages]
            text = chat_dsv4.encode_messages(messages, body.thinking_mode, body.effort, body.offered_tools)
        except ValueError as e:      # a malformed message (InvalidRequestError names its field)
            field = getattr(e, "field", None)
            raise bad_request(str(e) if field else f"messages: {e}", field or "messages") from None
        if not body.add_generation_prompt:
            text = text.removesuffix(chat_dsv4.THINK).removesuffix(chat_dsv4.END_THINK) \
                .removesuffix(chat_dsv4.ASSISTANT)
        return tokenizer.encode_rendered(text)
    if body.tools and body.tool_choice != "none":
        raise bad_request("tools need a checkpoint in DeepSeek-V4's chat format (its tokenizer, no template)",
                          "tools")
    kwargs = {**tokenizer.special_tokens, **(body.chat_template_kwargs or {})}
    try:
        text = render_chat(tokenizer.chat_template, [(m.role, m.text) for m in body.messages],
                           body.add_generation_prompt, **kwargs)
    except Exception as e:  # a template's raise_exception, or a broken template
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
    return (tokenizer.encode_rendered if tokenizer.chat_template else tokenizer.encode)(text)


class Detokenizer:
    """Turns a growing token list into text deltas that never change once sent.

    Held back until more tokens arrive: a trailing incomplete UTF-8 sequence, and any
    tail that could still become a stop string. When a stop string appears, the text
    ends just before it and `stopped` is set; `finish()` releases what was held back.

    Incremental: each `add` decodes only the new tokens plus a few of context (vLLM's
    prefix/read offsets) and searches for stop strings only in the text that could
    newly contain one, so a long output costs linear, not quadratic, time.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._full = ""          # text of token_ids[:read_offset] (+ undecided tail kept out)
        self._sent = 0           # chars of _full already sent
        self._prefix_offset = self._read_offset = 0
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._full[:self._sent]

    def add(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        self._full += self._decode_new()
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            return self._send(cut)
        return self._send(len(self._full) - self._partial_stop())

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._full += self._undecided()
        self._prefix_offset = self._read_offset = len(self.token_ids)
        cut = self._stop_at()
        self.stopped = cut is not None
        return self._send(len(self._full) if cut is None else cut)

    def _decode_new(self) -> str:
        """Text the tokens since the last commit add, once it no longer ends mid-character."""
        prefix = self.decode(self.token_ids[self._prefix_offset:self._read_offset])
        new = self.decode(self.token_ids[self._prefix_offset:])
        if len(new) > len(prefix) and not new.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return new[len(prefix):]
        return ""

    def _undecided(self) -> str:
        prefix = self.decode(self.token_ids[self._prefix_offset:self._read_offset])
        return self.decode(self.token_ids[self._prefix_offset:])[len(prefix):]

    def _send(self, upto: int) -> str:
        upto = max(upto, self._sent)
        delta = self._full[self._sent:upto]
        self._sent = upto
        return delta

    def _stop_at(self) -> int | None:
        start = max(0, self._sent - self._longest)
        hits = [i for i in (self._full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self._full[-self._longest:] if self._longest else ""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
