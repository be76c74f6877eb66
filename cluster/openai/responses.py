"""OpenAI response bodies, built from the chunks a generation streams.

A request has one or more prompts and n sequences per prompt; choice `p * n + i` is
sequence i of prompt p. `Choice` folds its chunks into text (stop strings applied),
token ids, logprobs and top logprobs; `Reply` shapes the choices as
`text_completion` / `chat.completion` objects or as their streamed `.chunk` events
(Server-Sent Events, `data: {...}` then `data: [DONE]`), with usage over all of them.

The token that ends a sequence (EOS, a `stop_token_ids` id) is never text, also when the
tokenizer does not mark it special. In DeepSeek-V4's chat format (`ReplyFormat`) the text is
decoded with its markup kept and parsed (cluster/chat/dsv4_parse.py) into `reasoning_content`,
`content` and `tool_calls`.
"""
from __future__ import annotations

import json
import time
from typing import NamedTuple

from kvmesh.cluster.chat.dsv4_parse import ReplyParser, ToolCall
from kvmesh.cluster.messages import Chunk
from kvmesh.cluster.chat.detokenizer import Detokenizer


class Delta(NamedTuple):
    text: str                        # content
    token_ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()


class ReplyFormat(NamedTuple):
    """How chat replies are parsed: V4's thinking/chat mode, tool calls looked for, parallel kept,
    content verbatim (a response_format JSON reply)."""
    mode: str
    tools: bool
    parallel: bool = True
    verbatim: bool = False


class Choice:
    def __init__(self, index: int, tokenizer, stops: list[str], echo: str = "",
                 stop_ids: frozenset[int] = frozenset(), fmt: ReplyFormat | None = None):
        self.index, self.echo, self.stop_ids = index, echo, stop_ids
        self.detok = Detokenizer(tokenizer.decode_markup if fmt else tokenizer.decode, stops,
                                 tokenizer.decode_stream(markup=bool(fmt)))
        self.parser = ReplyParser(*fmt) if fmt else None
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)

    def feed(self, chunk: Chunk) -> Delta:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        tops = list(chunk.top_logprobs) or [[] for _ in chunk.token_ids]
        self.tops += tops
        ids = chunk.token_ids
        if chunk.finished and chunk.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]               # the end-of-sequence token is not text
        text = self.detok.add(ids)
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif chunk.finished:
            text += self.detok.finish()
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"
        if self.parser is None:
            return Delta(text, chunk.token_ids, chunk.logprobs, tops)
        out = self.parser.feed(text, final=self.done)
        self.reasoning, self.content, self.calls = self.reasoning + out.reasoning, self.content + out.content, \
            self.calls + out.calls
        if self.calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return Delta(out.content, chunk.token_ids, chunk.logprobs, tops, out.reasoning, tuple(out.calls))

    def whole(self) -> Delta:
        return Delta(self.text, self.token_ids, self.logprobs, self.tops)

    def message(self) -> dict:
        """The chat message: content, and in V4's format reasoning_content (also as `reasoning`,
        vLLM's name) and tool_calls."""
        if self.parser is None:
            return {"role": "assistant", "content": self.text}
        msg = {"role": "assistant", "content": self.content if self.content or not self.calls else None,
               "reasoning_content": self.reasoning or None, "reasoning": self.reasoning or None}
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return msg


class Reply:
    def __init__(self, request_id: str, model: str, tokenizer, stops: list[str], prompts: list[list[int]],
                 n: int, keep: int | None = None, echo: list[str] | None = None,
                 stop_ids: frozenset[int] = frozenset(), fmt: ReplyFormat | None = None):
        """n sequences per prompt; keep: return only the best `keep` of them by cumulative
        logprob (best_of); echo: each prompt's text, prepended to its choices' text; stop_ids:
        the ids that end a sequence (their text is dropped); fmt: V4's reply parsing."""
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.tokenizer, self.prompts, self.n, self.keep = tokenizer, prompts, n, keep or n
        self.echo = echo
        self.prompt_logprobs: list[list] = [[] for _ in prompts]   # echo + logprobs: per prompt token
        self.choices = {p * n + i: Choice(p * n + i, tokenizer, stops, echo[p] if echo else "", stop_ids, fmt)
                        for p in range(len(prompts)) for i in range(n)}
        self.cached = [0] * len(prompts)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices.values())

    def feed(self, prompt: int, chunk: Chunk) -> tuple[Choice, Delta]:
        self.cached[prompt] = max(self.cached[prompt], chunk.cached_tokens)
        if chunk.prompt_logprobs and not self.prompt_logprobs[prompt]:
            self.prompt_logprobs[prompt] = chunk.prompt_logprobs
        choice = self.choices[prompt * self.n + chunk.index]
        return choice, choice.feed(chunk)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached)

    def usage(self) -> dict:
        n = sum(len(p) for p in self.prompts)
        done = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def token_text(self, token_id: int) -> str:
        """A token's text; one that is no text on its own (a special token, part of a UTF-8
        sequence) is named `token_id:N` (vLLM's spelling), so logprob keys stay distinct."""
        text = self.tokenizer.decode([token_id])
        return text if text and "\ufffd" not in text else f"token_id:{token_id}"

    def final_choices(self) -> list[Choice]:
        """Every choice in order, or with best_of the `keep` best of each prompt's, renumbered."""
        if self.keep == self.n:
            return [self.choices[i] for i in sorted(self.choices)]
        out = []
        for p in range(len(self.prompts)):
            group = [self.choices[p * self.n + i] for i in range(self.n)]
            out += sorted(group, key=lambda c: -c.cumulative_logprob)[:self.keep]
        for i, c in enumerate(out):
            c.index = i
        return out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- /v1/completions --------------------------------------------------------------------
    def completion_logprobs(self, delta: Delta, offset: int, top_n: int, prompt: int | None = None) -> dict:
        """OpenAI's legacy shape; with echo (`prompt` given) the prompt's tokens come first."""
        toks, lps, tops = [], [], []
        if prompt is not None:
            for t, entry in zip(self.prompts[prompt], self.prompt_logprobs[prompt]):
                toks.append(self.token_text(t))
                lps.append(entry[0] if entry else None)
                tops.append(self._top_dict(t, entry[0], entry[1], top_n) if entry else None)
        for t, lp, top in zip(delta.token_ids, delta.logprobs, delta.tops):
            toks.append(self.token_text(t))
            lps.append(lp)
            tops.append(self._top_dict(t, lp, top, top_n))
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _top_dict(self, token: int, logprob: float, top: list, top_n: int) -> dict:
        """The top-N alternatives plus the sampled token (vLLM returns N or N+1 entries)."""
        out = {self.token_text(t): lp for t, lp in top[:top_n]}
        out.setdefault(self.token_text(token), logprob)
        return out

    def completion(self, logprobs: int | None, return_token_ids: bool) -> dict:
        choices = []
        for c in self.final_choices():
            prompt = c.index // self.keep
            body = {"index": c.index, "text": c.echo + c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if logprobs is not None:
                body["logprobs"] = self.completion_logprobs(c.whole(), 0, logprobs, prompt if self.echo else None)
            if return_token_ids:
                body.update(prompt_token_ids=self.prompts[prompt], token_ids=c.token_ids)
            choices.append(body)
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage()}

    def completion_chunk(self, choice: Choice, delta: Delta, offset: int, logprobs: int | None,
                         return_token_ids: bool, first: bool) -> dict:
        prompt = choice.index // self.n
        echo = choice.echo if first else ""
        body = {"index": choice.index, "text": echo + delta.text, "finish_reason": choice.finish_reason,
                "logprobs": None}
        if logprobs is not None:
            body["logprobs"] = self.completion_logprobs(delta, offset, logprobs,
                                                        prompt if first and self.echo else None)
        if return_token_ids:
            body["token_ids"] = delta.token_ids
            if first:
                body["prompt_token_ids"] = self.prompts[prompt]
        return {**self._head("text_completion"), "choices": [body]}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def _chat_entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, delta: Delta, top_n: int) -> dict:
        content = []
        for t, lp, top in zip(delta.token_ids, delta.logprobs, delta.tops):
            entry = self._chat_entry(t, lp)
            entry["top_logprobs"] = [self._chat_entry(a, alp) for a, alp in top[:top_n]]
            content.append(entry)
        return {"content": content}

    def chat(self, logprobs: bool, top_n: int, return_token_ids: bool) -> dict:
        choices = []
        for c in self.final_choices():
            body = {"index": c.index, "message": c.message(), "finish_reason": c.finish_reason, "logprobs": None}
            if logprobs:
                body["logprobs"] = self.chat_logprobs(c.whole(), top_n)
            if return_token_ids:
                body["token_ids"] = c.token_ids
            choices.append(body)
        out = {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}
        if return_token_ids:
            out["prompt_token_ids"] = self.prompts[0]
        return out

    def chat_opening(self, return_token_ids: bool) -> dict:
        """The opening chunk: the assistant role for every choice, empty content."""
        body = {**self._head("chat.completion.chunk"),
                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in sorted(self.choices)]}
        if return_token_ids:
            body["prompt_token_ids"] = self.prompts[0]
        return body

    def chat_chunk(self, choice: Choice, delta: Delta, logprobs: bool, top_n: int, return_token_ids: bool) -> dict:
        out: dict = {}
        if delta.reasoning:
            out["reasoning_content"] = out["reasoning"] = delta.reasoning
        if delta.text:
            out["content"] = delta.text
        if delta.calls:
            out["tool_calls"] = [piece for c in delta.calls for piece in _call_deltas(c)]
        body: dict = {"index": choice.index, "delta": out,
                      "logprobs": self.chat_logprobs(delta, top_n) if logprobs else None,
                      "finish_reason": choice.finish_reason}
        if return_token_ids:
            body["token_ids"] = delta.token_ids
        return {**self._head("chat.completion.chunk"), "choices": [body]}

    def usage_chunk(self, obj: str) -> dict:
        return {**self._head(obj), "choices": [], "usage": self.usage()}


def _call_deltas(call: ToolCall) -> list[dict]:
    """A call as a stream sends it: index, id and name once, then the arguments in pieces."""
    head = {"index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [head] + [{"index": call.index, "function": {"arguments": p}} for p in call.pieces]


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
