"""Prefix reuse inside one engine: prefix_cache.py finds a hit across the tiers (memory, host
cache, shared store) and fills the blocks the KV-cache manager gives it, persists new blocks
and checkpoints (write-behind) and publishes them; auto_policy.py is the `auto` SWA policy's
period tuner (branch points, cost model)."""
