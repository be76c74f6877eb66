"""KV events over Redis Streams: the transport between engine ranks and routers when the index is Redis.

Keys, `ns` the index namespace (kvstore.index.redis_index's layout)::

    kvmesh:{ns}:events          stream   one entry per event (XADD ... MAXLEN ~ maxlen)
    kvmesh:{ns}:events:resync   set      locations a router asked for a snapshot

An entry's fields: `l` location, `e` epoch, `q` seq, `k` kind, `t` tier, `n` load, `h` the hashes as
big-endian u64s; a snapshot has `h:{tier}` per tier instead of `t` / `h`. Routers read with XREAD
from the stream's end at start (every publisher then resyncs by snapshot), each router on its own,
so any number of ingress replicas follow one stream. A publisher consumes a request with SREM when
it beats. Trimming is approximate (`~`): a router that falls `maxlen` behind sees gaps and resyncs.

Faults: `send` and `snapshot_requested` raise redis errors (the publisher logs them once and the
router resyncs the gap); `read` raises too (the follower logs and retries). Redis restarted empty
loses the stream and the requests: the next events show gaps and the publishers resync.
"""
from __future__ import annotations

import struct

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.kvstore.index.kv_events import SNAPSHOT, KvEvent
from kvmesh.kvstore.index.redis_index import KEY_PREFIX

__all__ = ["RedisEventStream"]

MAXLEN = 100_000            # entries kept (approximately): ~100 s of a busy 256-rank cluster
_READ_COUNT = 4096          # entries per XREAD


def _pack(hashes) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


def _unpack(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f">{len(data) // 8}Q", data)


def encode(e: KvEvent) -> dict[str, bytes | str | int | float]:
    fields: dict = {"l": e.location, "e": e.epoch, "q": e.seq, "k": e.kind, "n": e.load}
    if e.kind == SNAPSHOT:
        fields.update({f"h:{tier}": _pack(hashes) for tier, hashes in e.held})
    else:
        fields.update(t=e.tier, h=_pack(e.hashes))
    return fields


def decode(fields: dict[bytes, bytes]) -> KvEvent:
    f = {k.decode(): v for k, v in fields.items()}
    held = tuple((k[2:], _unpack(v)) for k, v in f.items() if k.startswith("h:"))
    return KvEvent(f["l"].decode(), f["e"].decode(), int(f["q"]), f["k"].decode(), f.get("t", b"").decode(),
                   _unpack(f.get("h", b"")), float(f["n"]), held)


class RedisEventStream:
    """EventTransport over one namespace's stream (see the module docstring). A publisher and a
    router each open their own; `read` keeps this reader's position."""

    def __init__(self, url: str, namespace: str, maxlen: int = MAXLEN, socket_timeout_s: float = 2.0):
        self.key = f"{KEY_PREFIX}:{namespace}:events"
        self.resync_key = f"{self.key}:resync"
        self.maxlen = maxlen
        self._timeout_s = socket_timeout_s
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0))
        self._last: str | None = None     # the last entry id read (None: start at the stream's end)

    def send(self, event: KvEvent) -> None:
        self._client.xadd(self.key, encode(event), maxlen=self.maxlen, approximate=True)

    def snapshot_requested(self, location: str) -> bool:
        return bool(self._client.srem(self.resync_key, location))

    def request_snapshot(self, location: str) -> None:
        self._client.sadd(self.resync_key, location)

    def read(self, timeout_s: float = 0.0) -> list[KvEvent]:
        if self._last is None:
            top = self._client.xrevrange(self.key, count=1)
            self._last = top[0][0].decode() if top else "0-0"
        block = max(1, int(min(timeout_s, self._timeout_s / 2) * 1000)) if timeout_s > 0 else None
        got = self._client.xread({self.key: self._last}, count=_READ_COUNT, block=block)
        events = []
        for _, entries in got:
            for entry_id, fields in entries:
                events.append(decode(fields))
                self._last = entry_id.decode()
        return events

    def close(self) -> None:
        self._client.close()
