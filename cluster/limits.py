"""Limits at the HTTP edge: the request body (checked before it is all read) and the
prefill time budget (a long prompt gets longer than the inter-token timeout)."""
from __future__ import annotations

from .api import APIError, bad_request


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes "
                         "(ingress.max_body_bytes)", type="invalid_request_error", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The body of a Starlette request, refused with 413 as soon as it exceeds `limit`:
    a declared Content-Length beyond it is refused before reading anything."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise body_too_large(limit)
        except ValueError:
            raise bad_request(f"invalid Content-Length {declared[:32]!r}") from None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return bytes(body)


def prefill_budget_s(prompt_tokens: int, token_timeout_s: float, s_per_1k_tokens: float) -> float:
    """How long the first token may take: the inter-token timeout plus a share per prompt token."""
    return token_timeout_s + prompt_tokens / 1000 * s_per_1k_tokens
