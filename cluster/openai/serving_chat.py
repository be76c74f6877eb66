"""POST /v1/chat/completions: messages rendered in the checkpoint's chat format (its template,
DeepSeek-V4's encoder, or the plain one), replies as `chat.completion` objects.

In V4's format a reply is parsed into reasoning, content and tool calls (`ReplyFormat`); a
stream opens with the assistant role for every choice before any token."""
from __future__ import annotations

from kvmesh.cluster.chat.template import chat_prompt_ids
from kvmesh.cluster.openai.protocol import ChatCompletionRequest
from kvmesh.cluster.openai.responses import Choice, Delta, Reply, ReplyFormat
from kvmesh.cluster.openai.serving import OpenAIServing
from kvmesh.cluster.openai.validate import Prompts


class ServingChat(OpenAIServing):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    request_model = ChatCompletionRequest

    def prompts(self, body: ChatCompletionRequest) -> Prompts:
        """One prompt: the messages in the chat format (every refusal of a message is a 400)."""
        ids = chat_prompt_ids(self.ctx.tokenizer, body, self.ctx.special_in_content)
        return Prompts([ids], body.token_limit, body.logprobs, field="messages", fmt=self.reply_format(body))

    def reply_format(self, body: ChatCompletionRequest) -> ReplyFormat | None:
        """Replies in V4's format are parsed into reasoning, content and tool calls; others are text."""
        if self.ctx.tokenizer.chat_format != "dsv4":
            return None
        guided = body.response_format is not None and body.response_format.type != "text"
        return ReplyFormat(body.thinking_mode, bool(body.offered_tools), body.parallel_tool_calls, guided)

    def render(self, reply: Reply, body: ChatCompletionRequest) -> dict:
        return reply.chat(body.logprobs, body.top_n, body.return_token_ids)

    def render_opening(self, reply: Reply, body: ChatCompletionRequest) -> list[dict]:
        return [reply.chat_opening(body.return_token_ids)]

    def render_chunk(self, reply: Reply, body: ChatCompletionRequest, choice: Choice, delta: Delta, offset: int,
                     first: bool) -> dict:
        return reply.chat_chunk(choice, delta, body.logprobs, body.top_n, body.return_token_ids)
