"""The cache below the engine: device memory, the shared store, the prefix index, transfers, policy.

Device memory (what one engine's cache is made of):
    layout.py         one frozen spec per layer type: the tensors a block and a state slot hold
    fp8_kv.py         FP8 cache entries, byte-laid-out as V4's reference kernels store them
    cache_tensors.py  the cache tensors allocated from a layout (paged blocks, state slots)
    block_pool.py     the classical blocks: free list, refcounts, hash -> block
    state_slots.py    the fixed pool of state slots (SWA rings, compressor tails)
    mirror.py         rank 0's record of cache writes, replayed by the other TP ranks

The store (DESIGN §4; the truth about what is cached):
    hashing.py        model fingerprints, block hash chains, store namespaces
    mac.py            object authentication with a deployment key (HMAC-SHA256)
    objects.py        the self-verifying object format (one file per block or checkpoint)
    store_fs.py       filesystem primitives over pyarrow.fs: atomic writes, mapped reads, listings
    store.py          ObjectStore: put / get / list, corrupt objects as misses
    quarantine.py     objects no read may touch (unremovable corrupt ones), kept across restarts
    scrub.py          checks every object of a namespace, never-read ones too (`kvmesh store scrub`, background)
    persist.py        write-behind: store puts on a background thread, off the request path
    tiers.py          one interface for every place objects live outside the device pool
    host_cache.py     the host-memory tier (LRU by bytes)
    timed_io.py       blocking calls with a deadline (a FIFO or a hung mount must not hang the engine)
    log_once.py       warn once per cause (store, index, write-behind, prefix cache)
    redact.py         URLs without their password, for logs

The prefix index (DESIGN §4; a hint, rebuilt from the store):
    index_base.py     the PrefixIndex contract, LookupResult, IndexStats
    index.py          EmbeddedIndex (in-process) and make_index
    redis_index.py    RedisIndex: the cluster index in Redis, one server-side walk per lookup
    kv_events.py      KV events: what each engine rank holds, pushed to the router's per-rank index
    kv_event_stream.py  the events over a Redis stream (one per namespace)

Transfers (prefill -> decode handoffs):
    kv_transport.py   the handoff interface, any transport
    nixl_transfer.py  NIXL (UCX) agents moving cache regions between workers

Policy and its cost:
    planner.py        SWA caching policies and the restore planner (a pure function)
    trace.py          request traces with prefix structure (Mooncake's format)
    cost.py           the SWA-policy cost model: a trace replayed against a model of the store

Layering: nothing here imports `workers` or `cluster`; inside, the store builds on hashing,
mac, objects and store_fs, the index on index_base and hashing (kv events on index_base, their
stream on redis_index), transfers on cache_tensors,
and cost on planner, layout and trace (tests/unit/test_layering.py fails on any import ring,
module- or subpackage-level).
"""
