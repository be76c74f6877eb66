"""POST /tokenize and POST /detokenize (vLLM's extension endpoints): a prompt or chat messages
-> token ids as a completion or chat request would have them; token ids -> text."""
from __future__ import annotations

from cluster.chat.template import chat_prompt_ids
from cluster.errors import bad_request
from cluster.openai.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from cluster.openai.serving import ServingContext


class ServingTokenize:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def tokenize(self, raw: bytes) -> dict:
        """The ids (and their count) of `prompt` as it is, or of `messages` in the chat format,
        with the context they must fit in."""
        body = parse_body(raw, TokenizeRequest)
        if body.prompt is not None:
            ids = self.ctx.tokenizer.encode(body.prompt)
        else:
            ids = chat_prompt_ids(self.ctx.tokenizer, body.as_chat())
        return {"tokens": ids, "count": len(ids), "max_model_len": (await self.ctx.limits.get()).max_model_len}

    async def detokenize(self, raw: bytes) -> dict:
        """The text of `tokens`; an id outside the vocabulary is a 400."""
        body = parse_body(raw, DetokenizeRequest)
        vocab = (await self.ctx.limits.get()).vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.ctx.tokenizer.decode(body.tokens)}
