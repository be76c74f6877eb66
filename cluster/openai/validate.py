"""A request's prompts against the workers' limits: every 400 a worker would otherwise meet is
decided here, before any worker sees the request (the body itself was checked by protocol.py).

    Prompts       what an endpoint makes of its body (token ids of each prompt, max_tokens, ...)
    gen_request   one prompt of it -> the GenRequest dispatch sends, or a 400 naming the field
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from kvmesh.workers.sampling.params import check_schema_size
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams

from kvmesh.cluster.chat.dsv4_grammar import after_reasoning
from kvmesh.cluster.errors import bad_request
from kvmesh.cluster.messages import GenRequest
from kvmesh.cluster.openai.limits import Limits
from kvmesh.cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, grammar_error
from kvmesh.cluster.openai.responses import ReplyFormat

Body = CompletionRequest | ChatCompletionRequest


class Prompts(NamedTuple):
    """What an endpoint makes of a request body; all but `ids` hold for every prompt."""
    ids: list[list[int]]              # the token ids of each prompt
    max_tokens: int | None            # None: as many as fit in the context
    logprobs: bool                    # the workers return each token's logprob
    field: str                        # the field an empty prompt is blamed on
    echo: bool = False                # the prompt's text starts each reply (completions)
    fmt: ReplyFormat | None = None    # replies parsed in DeepSeek-V4's chat format


def gen_request(body: Body, prompts: Prompts, ids: list[int], request_id: str, limits: Limits,
                client: str = "") -> GenRequest:
    """The GenRequest for one prompt (`ids`) of `body`; raises the 400 APIError that names the
    field at fault (prompt, logit_bias, max_tokens, response_format, tools, ...)."""
    _check_tokens(body, prompts.field, ids, limits.vocab_size)
    room = limits.max_model_len - len(ids)
    if room < 1 or (prompts.max_tokens is not None and prompts.max_tokens > room):
        raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({prompts.max_tokens}) exceeds the "
                          f"model's context of {limits.max_model_len} tokens", "max_tokens")
    try:
        params = _params(body, prompts, prompts.max_tokens or room, limits.max_schema_bytes)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.field) from None
    return GenRequest(request_id, ids, params, client)


def _check_tokens(body: Body, field: str, ids: list[int], vocab: int) -> None:
    """The prompt is not empty, and its ids and logit_bias's are in the vocabulary."""
    if not ids:
        raise bad_request("the prompt is empty", field)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
    outside = sorted(int(k) for k in body.logit_bias or {} if int(k) >= vocab)
    if outside:
        raise bad_request(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab})",
                          "logit_bias")


def _params(body: Body, prompts: Prompts, max_tokens: int, max_schema_bytes: int) -> SamplingParams:
    """The body's sampling parameters, validated; a guide over `max_schema_bytes` is refused, and
    in V4's thinking mode a JSON guide starts after the reasoning. Raises InvalidRequestError."""
    params = body.sampling_params(max_tokens, prompts.logprobs)
    if params.guide:
        check_schema_size(params.guide[1], max_schema_bytes,
                          "tools" if params.guide[0] == "ebnf" else "response_format")
    fmt = prompts.fmt
    if fmt and fmt.mode == "thinking" and params.guide and params.guide[0] != "ebnf":
        try:
            params = dataclasses.replace(params, guide=after_reasoning(params.guide))
        except RuntimeError as e:      # a schema xgrammar cannot turn into a grammar
            raise InvalidRequestError(f"the schema cannot be compiled: {grammar_error(e)}",
                                      "response_format") from None
    if prompts.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    params.validate()
    return params
