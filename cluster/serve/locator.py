"""Which worker rank already holds a prompt's prefix in memory, and how loaded each rank is.

With a shared index (Redis) the locator follows the engines' KV events (kvstore/index/kv_events.py)
on a thread of its own: a hint is a walk of an in-memory per-rank index, no round trip. While no
publisher is heard from (events not flowing yet, or the stream down), it asks the prefix index
instead, one lookup per request. With the embedded index every worker has its own, so the
ingress sees nothing and routing is by load alone.
"""
from __future__ import annotations

import logging

from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.index.embedded import PrefixIndex, make_index
from kvmesh.kvstore.index.kv_events import KvEventFollower, KvEventIndex

from kvmesh.cluster.messages import RouteHint

log = logging.getLogger(__name__)
SHARED_INDEX_SCHEMES = ("redis://", "rediss://", "unix://")


class PrefixLocator:
    def __init__(self, index_spec: str):
        self.spec = index_spec
        self.hasher: PrefixHasher | None = None
        self.index: PrefixIndex | None = None
        self.events: KvEventIndex | None = None
        self._follower: KvEventFollower | None = None
        self.hints = {"events": 0, "index": 0}      # hints by source (/metrics kvmesh_route_hints_total)

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
        if self.index is None or self.hasher is None:
            return RouteHint()
        hashes = self.hasher.hashes(prompt)
        if not hashes:
            return self.load_hint()
        if self.events is not None and self.events.live():
            self.hints["events"] += 1
            return RouteHint(prefix_blocks=self.events.longest_prefix(hashes), loads=self.events.loads(),
                             prompt_blocks=len(hashes), block_tokens=self.hasher.block_tokens)
        self.hints["index"] += 1
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
