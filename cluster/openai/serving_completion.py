"""POST /v1/completions: prompts as text or token ids (one, or a batch), rendered as
`text_completion` objects; echo prepends each prompt's text (and its logprobs, when asked for).

Choice `p * n + i` is sequence i of prompt p; a streamed choice carries its prompt's ids and
echo on its first event only, and its logprobs' text offsets continue from what was sent."""
from __future__ import annotations

from kvmesh.cluster.openai.protocol import CompletionRequest
from kvmesh.cluster.openai.responses import Choice, Delta, Reply
from kvmesh.cluster.openai.serving import OpenAIServing
from kvmesh.cluster.openai.validate import Prompts


class ServingCompletion(OpenAIServing):
    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    request_model = CompletionRequest

    def prompts(self, body: CompletionRequest) -> Prompts:
        """Text prompts tokenized as they are (no chat template); id prompts taken as given."""
        encode = self.ctx.tokenizer.encode
        ids = [encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
        return Prompts(ids, body.max_tokens, body.logprobs is not None, field="prompt", echo=body.echo)

    def render(self, reply: Reply, body: CompletionRequest) -> dict:
        return reply.completion(body.logprobs, body.return_token_ids)

    def render_chunk(self, reply: Reply, body: CompletionRequest, choice: Choice, delta: Delta, offset: int,
                     first: bool) -> dict:
        return reply.completion_chunk(choice, delta, offset, body.logprobs, body.return_token_ids, first)
