"""Messages for moving a prefilled request from one engine to another.

The source engine holds the request (`HeldKV`, kvstore.kv_transport) and a KVTransport
offers it; the destination engine continues it from a `Resume`, whose `load` fills the
blocks and slot it allocated (usually `KVTransport.load` of the offer)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kvstore.kv_transport import HeldKV

__all__ = ["HeldKV", "Resume"]


class Resume(NamedTuple):
    """Decode side: continue a request another engine prefilled.

    `load(cache, block_ids, slot)` runs on the engine thread and fills the freshly
    allocated blocks and slot (a KVTransport.load, or CacheTensors.scatter of a payload);
    whatever it raises fails this request only."""
    first_token: int
    first_logprob: float
    load: Callable
    cached_tokens: int = 0
    rng_state: torch.Tensor | None = None   # continue the seeded sampler where prefill left it
    siblings: tuple = ()                    # n > 1: (token, logprob, top, finish reason | None) of forks 1..n-1
    first_top: tuple = ()                   # the first token's top logprobs
    first_finish: str | None = None         # n > 1: sequence 0 ended on its first token; others go on
