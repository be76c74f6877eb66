"""A pool replica's serving slots, and the wait for a grammar outside them (issue 48).

A guided request whose grammar is not compiled yet used to hold one of its replica's
`max_ongoing_requests` for its whole compile: one client's slow schemas filled every slot and
plain requests from everyone waited behind them. Here the replica keeps its serving slots
itself, `max_ongoing_requests` of them, and a request takes one only once its grammar is ready:

    gate = GrammarGate(engine.guides, slots=32, waiting=32, per_client=4, retry_after_s=1)   # a GuideCompiler
    async with gate.admitted(req):          # waits for the grammar (no slot), then for a slot
        ...run it...

Serve's own limit for the replica is `max_ongoing_requests + max_grammar_waiting`
(PoolConfig.serve_max_ongoing_requests), so requests waiting for their grammar fit beside the
serving ones. A grammar that is refused (remembered, too large, or failing its compile) raises
InvalidRequestError (a 400) without a slot ever taken. A client (GenRequest.client: its API key,
else its address) may have at most `per_client` requests waiting for a compile on a replica, and
the replica `waiting` in all; past either the request gets TooManyRequests (a 429 with
Retry-After), at once, and starts no compile. A request whose grammar is cached waits for nothing. Decode
(`refuse=False`) never refuses: prefill already admitted the request, and its first token is
out; its compile (decode's own cache) waits outside the slots all the same.

A plain request takes a slot as before. When every slot is held, requests wait for one in the
replica (first come, first served) rather than in Serve's queue; that happens only while fewer
than `waiting` requests wait for grammars, so the replica never holds more than Serve's limit.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator

from kvmesh.cluster.errors import TooManyRequests
from kvmesh.cluster.messages import GenRequest
from kvmesh.workers.sampling.grammar import GuideCompiler


class GrammarGate:
    def __init__(self, compiler: GuideCompiler, slots: int, waiting: int, per_client: int, retry_after_s: int):
        self.compiler = compiler
        self.slots, self.max_waiting, self.per_client, self.retry_after_s = slots, waiting, per_client, retry_after_s
        self._free: asyncio.Semaphore | None = None       # made on the replica's loop, at first use
        self.serving = 0                        # slots held now
        self.waiting: Counter[str] = Counter()  # client -> its requests waiting for a compile now
        self.refused = 0                        # requests refused with a 429 since start

    @property
    def grammar_waiting(self) -> int:
        return sum(self.waiting.values())

    @asynccontextmanager
    async def admitted(self, req: GenRequest, refuse: bool = True) -> AsyncIterator[None]:
        """Hold a serving slot for the body, once `req`'s grammar (if any) is compiled."""
        if req.params.guide:
            await self._grammar(req, refuse)
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        async with self._free:
            self.serving += 1
            try:
                yield
            finally:
                self.serving -= 1

    async def _grammar(self, req: GenRequest, refuse: bool) -> None:
        spec, client = req.params.guide, req.client
        future = self.compiler.known(spec)      # cached, refused before, or compiling: no new work
        if future is not None and future.done():
            future.result()             # cached, or refused from memory: at once
            return
        mine = self.waiting[client] >= self.per_client
        if refuse and (mine or self.grammar_waiting >= self.max_waiting):
            self.refused += 1
            what, key, limit = ((f"{self.waiting[client]} of this client's requests", "grammar_waiting_per_client",
                                 self.per_client) if mine else
                                (f"{self.grammar_waiting} requests", "max_grammar_waiting", self.max_waiting))
            raise TooManyRequests(f"{what} are waiting for their grammar to compile on this worker, the limit "
                                  f"({key}: {limit}); retry once one has ended", self.retry_after_s)
        if future is None:
            future = self.compiler.compile_async(spec, client)     # raises when refused before any work
        self.waiting[client] += 1
        try:
            # shielded: the compile is shared (other requests, the cache); a client leaving only stops waiting
            await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self.waiting[client] -= 1
            if not self.waiting[client]:
                del self.waiting[client]
