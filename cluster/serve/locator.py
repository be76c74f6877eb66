"""Which worker rank already holds a prompt's prefix in memory, and how loaded each rank is.

With a shared index (Redis) the locator follows the engines' KV events (kvstore/index/kv_events.py)
on a thread of its own: a hint is a walk of an in-memory per-rank index, no round trip. While no
publisher is heard from (events not flowing yet, or the stream down), it asks the prefix index
instead, one lookup per request. With the embedded index every worker has its own, so the
ingress sees nothing and routing is by load alone.

The ingress asks through `hint_async`, which never blocks its event loop: the lookup runs on a
thread of the locator's own, waited for at most `lookup_budget_s`; past it, or while every lookup
thread is still held by a slow or paused Redis, the request is routed by load at once (a routing
miss, never a stalled stream). `hint` is the same answer, blocking (tools and tests).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.index.embedded import PrefixIndex, make_index
from kvmesh.kvstore.index.kv_events import KvEventFollower, KvEventIndex

from kvmesh.cluster.messages import RouteHint

log = logging.getLogger(__name__)
SHARED_INDEX_SCHEMES = ("redis://", "rediss://", "unix://")
LOOKUP_BUDGET_S = 0.25      # a request waits this long for the index's answer, then is routed by load
LOOKUP_THREADS = 2          # index lookups in flight at most; beyond them a request is routed by load


class PrefixLocator:
    def __init__(self, index_spec: str, lookup_budget_s: float = LOOKUP_BUDGET_S):
        self.spec = index_spec
        self.lookup_budget_s = lookup_budget_s
        self.hasher: PrefixHasher | None = None
        self.index: PrefixIndex | None = None
        self.events: KvEventIndex | None = None
        self._follower: KvEventFollower | None = None
        self._lookups: ThreadPoolExecutor | None = None
        self.lookups_in_flight = 0                  # index lookups running on the lookup threads now
        # hints by source (/metrics kvmesh_route_hints_total): the event index; an index lookup; none
        # because the lookup outlasted its budget ("index_slow") or every lookup thread was busy ("index_busy")
        self.hints = {"events": 0, "index": 0, "index_slow": 0, "index_busy": 0}

    def configure(self, fingerprint: str | None, block_tokens: int, namespace: str | None = None) -> None:
        """Called once the workers report their model fingerprint and index namespace (which
        carries their store key's id; None: the engine has no index)."""
        if fingerprint and self.spec.startswith(SHARED_INDEX_SCHEMES) and self.index is None:
            from kvmesh.kvstore.index.kv_event_stream import RedisEventStream  # lazy: embedded users need no redis

            self.hasher = PrefixHasher(fingerprint, block_tokens)
            self.index = make_index(self.spec, fingerprint, namespace=namespace)
            stream = RedisEventStream(self.spec, self.index.namespace)
            self.events = KvEventIndex(stream.request_snapshot)
            self._follower = KvEventFollower(stream, self.events).start()

    def hint(self, prompt: list[int]) -> RouteHint:
        """The prefix hint for `prompt`, blocking on an index lookup when one is needed."""
        hashes, quick = self._quick_hint(prompt)
        if quick is not None:
            return quick
        self.hints["index"] += 1
        return self._index_hint(hashes)

    async def hint_async(self, prompt: list[int]) -> RouteHint:
        """The same answer without ever blocking the caller's event loop (see the module's doc)."""
        hashes, quick = self._quick_hint(prompt)
        if quick is not None:
            return quick
        if self.lookups_in_flight >= LOOKUP_THREADS:
            self.hints["index_busy"] += 1
            return RouteHint()
        if self._lookups is None:
            self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvmesh-index-lookup")
        self.hints["index"] += 1       # counted here, on the loop: the lookup threads only read
        self.lookups_in_flight += 1
        lookup = asyncio.get_running_loop().run_in_executor(self._lookups, self._index_hint, hashes)
        lookup.add_done_callback(self._lookup_ended)     # when the thread returns, not when we stop waiting
        try:
            return await asyncio.wait_for(asyncio.shield(lookup), self.lookup_budget_s)
        except asyncio.TimeoutError:
            self.hints["index_slow"] += 1
            return RouteHint()

    def _lookup_ended(self, _lookup) -> None:
        self.lookups_in_flight -= 1

    def _quick_hint(self, prompt: list[int]) -> tuple[list[int], RouteHint | None]:
        """(the prompt's block hashes, the hint if it needs no index lookup, else None)."""
        if self.index is None or self.hasher is None:
            return [], RouteHint()
        hashes = self.hasher.hashes(prompt)
        if not hashes:
            return hashes, self.load_hint()
        if self.events is not None and self.events.live():
            self.hints["events"] += 1
            return hashes, RouteHint(prefix_blocks=self.events.longest_prefix(hashes), loads=self.events.loads(),
                                     prompt_blocks=len(hashes), block_tokens=self.hasher.block_tokens)
        return hashes, None

    def _index_hint(self, hashes: list[int]) -> RouteHint:
        try:
            return RouteHint(prefix_blocks=dict(self.index.lookup(hashes).memory))
        except Exception as e:  # the index is a hint: routing falls back to load, loudly
            log.warning("prefix index lookup failed (%s); routing prefill by load", e)
            return RouteHint()

    def load_hint(self) -> RouteHint:
        """Each rank's queued tokens as its events last pushed them (no hint while none flow):
        for a short prompt, and for decode, which needs no prefix."""
        if self.events is None or self.hasher is None or not self.events.live():
            return RouteHint()
        return RouteHint(loads=self.events.loads(), block_tokens=self.hasher.block_tokens)

    def close(self) -> None:
        """Stop following the events (the ingress's process ending does the same)."""
        if self._follower is not None:
            self._follower.close()
        if self._lookups is not None:
            self._lookups.shutdown(wait=False)
