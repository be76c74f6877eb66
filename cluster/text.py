"""Text at the API edge: chat prompts and incremental detokenization with stop strings.

The plain chat template (used when a checkpoint ships none) is one header line per
message, then the assistant header the model continues from:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""
from __future__ import annotations

import json

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


class Detokenizer:
    """Turns a growing token list into text deltas that never change once sent.

    Held back until more tokens arrive: a trailing incomplete UTF-8 sequence, and any
    tail that could still become a stop string. When a stop string appears, the text
    ends just before it and `stopped` is set; `finish()` releases what was held back.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.token_ids: list[int] = []
        self.text = ""          # everything sent so far
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        full = self.decode(self.token_ids)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._send(full[:cut])
        safe = len(full.rstrip(REPLACEMENT))
        safe -= self._partial_stop(full[:safe])
        return self._send(full[:max(safe, len(self.text))])

    def finish(self) -> str:
        return "" if self.stopped else self._send(self.decode(self.token_ids))

    def _send(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto
        return delta

    def _stop_at(self, full: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
