"""Transfers: prefill -> decode handoffs of a request's blocks and state slot.

    kv_transport.py   the handoff interface, any transport (`offer` / `load`, one HandoffError)
    nixl_transfer.py  NIXL (UCX) agents moving cache regions between workers

Builds on device/ (the cache tensors it moves).
"""
