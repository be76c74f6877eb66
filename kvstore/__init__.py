"""The cache below the engine (`kvmesh.kvstore`): device memory, the shared store, the prefix index,
transfers, policy. One subpackage each; the modules left here are shared by several of them.

    device/      what one engine's cache is made of: layouts, FP8 entries, cache tensors, blocks, slots
    store/       the shared object store (DESIGN §4; the truth about what is cached) and its tiers
    index/       the prefix index (a hint, rebuilt from the store) and KV events
    transfer/    prefill -> decode handoffs: the transport interface and NIXL
    policy/      SWA caching policies, the restore planner, traces and the cost model

    hashing.py   model fingerprints, block hash chains, store namespaces (store, index, engine)
    log_once.py  warn once per cause (store, index, write-behind, prefix cache)
    timed_io.py  blocking calls with a deadline (a FIFO or a hung mount must not hang the engine)
    redact.py    URLs without their password, for logs

Layering: nothing here imports `workers` or `cluster`. Between the subpackages the edges are
store -> index (the store's listings publish and unpublish), transfer -> device, policy -> device,
and every subpackage may use the four shared modules above; device imports no other subpackage
(tests/unit/test_layering.py fails on any import ring, module- or subpackage-level).
"""
