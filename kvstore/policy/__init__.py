"""Policy and its cost: which SWA checkpoints to keep, and what a restore reads.

    planner.py   SWA caching policies and the restore planner (a pure function)
    trace.py     request traces with prefix structure (Mooncake's format)
    cost.py      the SWA-policy cost model: a trace replayed against a model of the store

Builds on device/ (the cost model sizes objects from the layout).
"""
