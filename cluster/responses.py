"""OpenAI response bodies, built from the chunks a generation streams.

`Generation` folds chunks into text (stop strings applied), token ids and logprobs;
the functions below shape them as `text_completion` / `chat.completion` objects or as
their streamed `.chunk` events (Server-Sent Events, `data: {...}` then `data: [DONE]`).
"""
from __future__ import annotations

import json
import time
from typing import NamedTuple

from .messages import Chunk
from .text import Detokenizer


class Delta(NamedTuple):
    text: str
    token_ids: list[int]
    logprobs: list[float]


class Generation:
    def __init__(self, request_id: str, model: str, tokenizer, stops: list[str], prompt_ids: list[int]):
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.detok = Detokenizer(tokenizer.decode, stops)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def feed(self, chunk: Chunk) -> Delta:
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        text = self.detok.add(chunk.token_ids)
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif chunk.finished:
            text += self.detok.finish()
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"
        return Delta(text, chunk.token_ids, chunk.logprobs)

    def usage(self) -> dict:
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": len(self.token_ids),
                "total_tokens": n + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def token_text(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]

    # ---- /v1/completions --------------------------------------------------------------------
    def completion_logprobs(self, delta: Delta, offset: int) -> dict:
        toks = self.token_text(delta.token_ids)
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": delta.logprobs,
                "top_logprobs": [{t: lp} for t, lp in zip(toks, delta.logprobs)], "text_offset": offsets}

    def completion(self, logprobs: bool, return_token_ids: bool) -> dict:
        choice = {"index": 0, "text": self.text, "finish_reason": self.finish_reason, "logprobs": None}
        if logprobs:
            choice["logprobs"] = self.completion_logprobs(Delta(self.text, self.token_ids, self.logprobs), 0)
        if return_token_ids:
            choice.update(prompt_token_ids=self.prompt_ids, token_ids=self.token_ids)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def completion_chunk(self, delta: Delta, offset: int, logprobs: bool, return_token_ids: bool,
                         first: bool) -> dict:
        choice = {"index": 0, "text": delta.text, "finish_reason": self.finish_reason, "logprobs": None}
        if logprobs:
            choice["logprobs"] = self.completion_logprobs(delta, offset)
        if return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                choice["prompt_token_ids"] = self.prompt_ids
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def chat_logprobs(self, delta: Delta, top: int) -> dict:
        content = []
        for tok, lp in zip(self.token_text(delta.token_ids), delta.logprobs):
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            entry["top_logprobs"] = [dict(entry)] if top else []
            content.append(entry)
        return {"content": content}

    def chat(self, logprobs: bool, top: int, return_token_ids: bool) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                  "finish_reason": self.finish_reason, "logprobs": None}
        if logprobs:
            choice["logprobs"] = self.chat_logprobs(Delta(self.text, self.token_ids, self.logprobs), top)
        if return_token_ids:
            choice["token_ids"] = self.token_ids
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}
        if return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chat_chunk(self, delta: Delta | None, logprobs: bool, top: int, return_token_ids: bool) -> dict:
        """delta None = the opening chunk (the assistant role, empty content)."""
        choice: dict = {"index": 0, "logprobs": None,
                        "finish_reason": self.finish_reason if delta is not None else None}
        if delta is None:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice["delta"] = {"content": delta.text} if delta.text else {}
            if logprobs:
                choice["logprobs"] = self.chat_logprobs(delta, top)
            if return_token_ids:
                choice["token_ids"] = delta.token_ids
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}
        if delta is None and return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def usage_chunk(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
