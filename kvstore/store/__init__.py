"""The shared store (DESIGN §4; the truth about what is cached) and the tiers objects live in.

    mac.py            object authentication with a deployment key (HMAC-SHA256)
    objects.py        the self-verifying object format (one file per block or checkpoint)
    store_fs.py       filesystem primitives over pyarrow.fs: atomic writes, mapped reads, listings
    object_store.py   ObjectStore: put / get / list, corrupt objects as misses
    nixl_reader.py    restore reads through NIXL's POSIX backend into registered memory
    read_buffers.py   host buffers restore reads land in, reused once no object views them
    quarantine.py     objects no read may touch (unremovable corrupt ones), kept across restarts
    scrub.py          checks every object of a namespace, never-read ones too (`kvmesh store scrub`, background)
    persist.py        write-behind: store puts on a background thread, off the request path
    tiers.py          one interface for every place objects live outside the device pool
    host_cache.py     the host-memory tier (LRU by bytes)

Builds on kvstore's hashing, log_once and timed_io, and on the index (a store publishes what it
holds and unpublishes what it removes).
"""
