"""The Serve side: pools of engines and how a request travels between them.

    pools.py      Prefill / Decode / Colocated deployments, each owning one AsyncEngine
    grammar_gate.py  a replica's serving slots, and the wait for a grammar outside them (429 past a client's bound)
    ranks.py      the rank actors of a tensor- or data-parallel replica in its placement group
    routing.py    KVAwareRouter: choosing a replica (by its best data-parallel rank) inside a pool
    locator.py    which rank holds a prompt's prefix, and each rank's load (from KV events, else the index)
    dispatch.py   one request -> a stream of Chunks across the pools, retries, time budgets
    transfer.py   the handoff's transports: NIXL and Ray objects, the decode-side Loader
    metrics.py    the ingress's Prometheus metrics and the pools' scraped stats
    replica_logs.py  what a replica logs for a refused (one WARNING line per cause) or cancelled request
    planner.py    the P/D planner: one decision sizes the pools from TTFT / ITL targets and replicas' reports
    autoscale.py  the planner as Serve's application-level autoscaling policy (decisions in /metrics)
    pd_sim.py     simulated pools on a replayed trace: the planner against its baselines (`kvmesh simulate --pd`)
"""
