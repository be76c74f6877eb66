"""Device memory: what one engine's cache is made of (DESIGN §1).

    layout.py         one frozen spec per layer type: the tensors a block and a state slot hold
    fp8_kv.py         FP8 cache entries, byte-laid-out as V4's reference kernels store them
    cache_tensors.py  the cache tensors allocated from a layout (paged blocks, state slots)
    block_pool.py     the classical blocks: free list, refcounts, hash -> block
    state_slots.py    the fixed pool of state slots (SWA rings, compressor tails)
    mirror.py         rank 0's record of cache writes, replayed by the other TP ranks

Imports no other kvstore subpackage.
"""
