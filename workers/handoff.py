"""Messages for moving a prefilled request from one engine to another."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class HeldKV(NamedTuple):
    """A prefilled request whose blocks and state slot stay allocated until released."""
    request_id: str
    block_ids: list[int]
    slot: int
    num_tokens: int          # prompt tokens in the cache (the first output token is not)
    tokens: list[int]        # prompt + first token
    rng_state: torch.Tensor | None = None   # the request's sampler state after the first token


class Resume(NamedTuple):
    """Decode side: continue a request another engine prefilled.

    `load(cache, block_ids, slot)` runs on the engine thread and fills the freshly
    allocated blocks and slot (a NIXL READ, or CacheTensors.scatter of a Ray payload)."""
    first_token: int
    first_logprob: float
    load: Callable
    cached_tokens: int = 0
    rng_state: torch.Tensor | None = None   # continue the seeded sampler where prefill left it
    siblings: tuple = ()                    # n > 1: (token, logprob, top, finish reason | None) of forks 1..n-1
    first_top: tuple = ()                   # the first token's top logprobs
    first_finish: str | None = None         # n > 1: sequence 0 ended on its first token; others go on
