"""Limits at the HTTP edge: the request body, checked before it is all read."""
from __future__ import annotations

from cluster.errors import bad_request, body_too_large


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
