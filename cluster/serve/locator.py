"""Which prefill worker already holds a prompt's prefix in memory (from the prefix index).

Only a shared index (Redis) can answer across workers; with the embedded index every
worker has its own, so the ingress sees nothing and prefill routing is by load alone.
"""
from __future__ import annotations

import logging

from kvstore.hashing import PrefixHasher
from kvstore.index import PrefixIndex, make_index

from cluster.messages import RouteHint

log = logging.getLogger(__name__)
SHARED_INDEX_SCHEMES = ("redis://", "rediss://", "unix://")


class PrefixLocator:
    def __init__(self, index_spec: str):
        self.spec = index_spec
        self.hasher: PrefixHasher | None = None
        self.index: PrefixIndex | None = None

    def configure(self, fingerprint: str | None, block_tokens: int, namespace: str | None = None) -> None:
        """Called once the workers report their model fingerprint and index namespace (which
        carries their store key's id; None: the engine has no index)."""
        if fingerprint and self.spec.startswith(SHARED_INDEX_SCHEMES) and self.index is None:
            self.hasher = PrefixHasher(fingerprint, block_tokens)
            self.index = make_index(self.spec, fingerprint, namespace=namespace)

    def hint(self, prompt: list[int]) -> RouteHint:
        if self.index is None or self.hasher is None:
            return RouteHint()
        hashes = self.hasher.hashes(prompt)
        if not hashes:
            return RouteHint()
        try:
            return RouteHint(prefix_blocks=dict(self.index.lookup(hashes).memory))
        except Exception as e:  # the index is a hint: routing falls back to load, loudly
            log.warning("prefix index lookup failed (%s); routing prefill by load", e)
            return RouteHint()
