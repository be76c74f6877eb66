"""Store object authentication with a deployment key (HMAC-SHA256, Python's `hmac`).

The XXH3 checksum of an object (kvstore.store.objects) catches accidents, not attackers:
anyone who can write to the store can forge an object with a valid checksum. With a
key, every object carries a MAC over its header and payload; readers with the same key
use only objects whose MAC verifies. Without a key the store trusts its writers.

Objects written under different keys live apart: the store and index namespaces carry the
key's `key_id` (kvstore.hashing.store_namespace), a keyed hash of a fixed label that
identifies the key without revealing anything about it. A node with a wrong key (a typo,
a rotation in progress) then misses and writes in its own namespace, never over the
objects of the nodes whose key is right.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from kvmesh.kvstore.hashing import KEY_ID_CHARS

MAC_NAME = "hmac-sha256"
MAC_SIZE = 32
MIN_KEY_BYTES = 16
_KEY_ID_LABEL = b"kvmesh-store-key-id-v1"   # fixed: the id is HMAC(key, label), never the key


class StoreKey:
    """A deployment's secret store key. Never printed: repr and str hide it."""

    def __init__(self, secret: str | bytes):
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the store key must be at least {MIN_KEY_BYTES} bytes "
                             f"(e.g. `openssl rand -hex 32`), got {len(key)}")
        self._key = key
        self.key_id = hmac.new(key, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:KEY_ID_CHARS]

    def mac(self, parts: Iterable[bytes | memoryview]) -> bytes:
        m = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            m.update(part)
        return m.digest()

    def verify(self, parts: Iterable[bytes | memoryview], tag: bytes | memoryview) -> bool:
        return hmac.compare_digest(self.mac(parts), bytes(tag))

    def __repr__(self) -> str:
        return "StoreKey(***)"

    __str__ = __repr__
