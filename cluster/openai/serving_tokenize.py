"""POST /tokenize and POST /detokenize (vLLM's extension endpoints): a prompt or chat messages
-> token ids as a completion or chat request would have them; token ids -> text. Both run on
the prepare threads (serving.py), the JSON of the answer too (a long prompt's ids are a large body)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from kvmesh.cluster.chat.template import chat_prompt_ids
from kvmesh.cluster.errors import bad_request
from kvmesh.cluster.openai.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from kvmesh.cluster.openai.serving import ServingContext


class ServingTokenize:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def tokenize(self, raw: bytes) -> JSONResponse:
        """The ids (and their count) of `prompt` as it is, or of `messages` in the chat format
        (message text as text unless ingress.allow_special_tokens_in_content), with the context
        they must fit in."""
        ids = await self.ctx.off_loop(self._ids, raw)
        max_model_len = (await self.ctx.limits.get()).max_model_len
        return await self.ctx.off_loop(JSONResponse, {"tokens": ids, "count": len(ids), "max_model_len": max_model_len})

    def _ids(self, raw: bytes) -> list[int]:
        body = parse_body(raw, TokenizeRequest)
        if body.prompt is not None:
            return self.ctx.tokenizer.encode(body.prompt)
        return chat_prompt_ids(self.ctx.tokenizer, body.as_chat(), self.ctx.special_in_content)

    async def detokenize(self, raw: bytes) -> JSONResponse:
        """The text of `tokens`; an id outside the vocabulary is a 400."""
        body = await self.ctx.off_loop(parse_body, raw, DetokenizeRequest)
        return await self.ctx.off_loop(self._text, body.tokens, (await self.ctx.limits.get()).vocab_size)

    def _text(self, tokens: list[int], vocab: int) -> JSONResponse:
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.ctx.tokenizer.decode(tokens)})
