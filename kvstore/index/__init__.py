"""The prefix index (DESIGN §4; a hint, rebuilt from the store) and KV events.

    base.py             the PrefixIndex contract, LookupResult, IndexStats
    embedded.py         EmbeddedIndex (in-process) and make_index
    redis_index.py      RedisIndex: the cluster index in Redis, one server-side walk per lookup
    kv_events.py        KV events: what each engine rank holds, pushed to the router's per-rank index
    kv_event_stream.py  the events over a Redis stream (one per namespace)

Builds on kvstore's hashing, log_once and redact; imports no other subpackage (kv events on base,
their stream on redis_index).
"""
