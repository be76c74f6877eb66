"""Limits at the HTTP edge: the request body, checked before it is all read, and the
workers' limits (context, vocabulary, schema size), asked of the pools once."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvmesh.cluster.errors import bad_request, body_too_large

if TYPE_CHECKING:
    from kvmesh.cluster.serve.locator import PrefixLocator


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


class Limits(NamedTuple):
    """What every worker accepts (the smallest over the pools asked)."""
    max_model_len: int          # prompt + generated tokens
    vocab_size: int             # token ids are in [0, vocab_size)
    max_schema_bytes: int       # the largest guide (JSON schema, tool grammar) a worker compiles


class WorkerLimits:
    """The workers' limits, asked of the pools on first use and then kept (every pool runs the
    same engine settings). The first answer also tells the prefix locator the workers'
    fingerprint, block size and index namespace, so routing hints start with it."""

    def __init__(self, mode: str, pools: dict, locator: PrefixLocator):
        self.names = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        self.pools, self.locator = pools, locator
        self._limits: Limits | None = None

    async def get(self) -> Limits:
        if self._limits is None:
            from kvmesh.cluster.serve.routing import detached     # lazy: Ray Serve's router, for serving only
            infos = [await detached(self.pools[n].info.remote) for n in self.names]
            self._limits = Limits(max_model_len=min(i["max_model_len"] for i in infos),
                                  vocab_size=infos[0]["vocab_size"],
                                  max_schema_bytes=min(i["max_schema_bytes"] for i in infos))
            self.locator.configure(infos[0].get("fingerprint"), infos[0]["block_tokens"],
                                   infos[0].get("index_namespace"))
        return self._limits
