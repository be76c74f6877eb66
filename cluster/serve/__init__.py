"""The Serve side: pools of engines and how a request travels between them.

    pools.py      Prefill / Decode / Colocated deployments, each owning one AsyncEngine
    ranks.py      the rank actors of a tensor- or data-parallel replica in its placement group
    routing.py    KVAwareRouter: choosing a replica inside a pool (run in the caller)
    locator.py    which prefill replica already holds a prompt's prefix (from the prefix index)
    dispatch.py   one request -> a stream of Chunks across the pools, retries, time budgets
    transfer.py   the handoff's transports: NIXL and Ray objects, the decode-side Loader
    metrics.py    the ingress's Prometheus metrics and the pools' scraped stats
"""
