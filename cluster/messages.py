"""Messages that cross a process boundary between ingress and pools: one dataclass each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.kvstore.transfer.kv_transport import Offer, TransferReport
from kvmesh.workers.request import FirstToken
from kvmesh.workers.sampling.params import SamplingParams

if TYPE_CHECKING:       # the type only: importing the engine package here would load the whole engine
    from kvmesh.workers.engine.stats import EngineStats

__all__ = ["GenRequest", "RouteHint", "WorkerStats", "TransferReport", "Chunk", "Handoff"]


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt: list[int]               # token ids (the ingress tokenizes)
    params: SamplingParams
    client: str = ""                # who sent it: its API key's id, else its address (shares of grammar compiles)


@dataclass(frozen=True)
class RouteHint:
    """What the pool router reads (the request itself is opaque to it).

    prefix_blocks: cache location (worker id, or `{worker id}/dp{rank}`) -> leading prompt blocks
                   it holds in memory.
    loads: cache location -> its queued tokens (prefill left + the context of each waiting or
           running sequence) as its KV events last pushed them; empty without events (the router then reads each replica's
           routing stats, in requests).
    prompt_blocks, block_tokens: the prompt's whole blocks and their size, set with `loads`: a rank
           is then scored by the tokens a request would wait for and compute there.
    require_worker: route only to this worker (a follow-up to state it holds)."""
    prefix_blocks: dict[str, int] = field(default_factory=dict)
    require_worker: str | None = None
    loads: dict[str, float] = field(default_factory=dict)
    prompt_blocks: int = 0
    block_tokens: int = 0


@dataclass(frozen=True)
class WorkerStats:
    pool: str
    worker_id: str
    engine: EngineStats             # the engine's (data-parallel: its ranks' summed)
    nixl_bytes: int = 0             # bytes this worker read over NIXL
    ray_bytes: int = 0              # bytes moved as Ray objects (the fallback)
    fallbacks: int = 0
    held_timeouts: int = 0          # prefill: held caches released because decode never read them
    handoff_reused_blocks: int = 0  # decode: prompt blocks it already held, so no handoff moved them
    handoff_saved_bytes: int = 0    # decode: their bytes
    serving: int = 0                # requests holding one of the replica's serving slots now
    grammar_gate_waiting: int = 0   # requests waiting for their grammar's compile, holding no slot
    grammar_busy_refusals: int = 0  # requests refused with a 429: their client had too many compiles waiting
    ranks: tuple[EngineStats, ...] = ()     # data-parallel: each rank's, in rank order


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request, as a pool streams them to the ingress."""
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    transfer: TransferReport | None = None
    worker: WorkerStats | None = None       # on the last chunk: the replica's counters
    index: int = 0                          # which of the request's n sequences
    top_logprobs: list = field(default_factory=list)   # per token: [(id, logprob)] best first
    all_finished: bool = True               # with `finished`: every sequence of the request is done
    prompt_logprobs: list | None = None     # echo: per prompt token None (the first) or (logprob, top)


@dataclass(frozen=True)
class Handoff:
    """Prefill -> decode: everything decode needs to continue a request.

    `offer` says where the held blocks + state slot can be read (kvstore.transfer.kv_transport.Offer:
    a NIXL description of the prefill worker's registered memory, or a Ray object) and
    carries the prefill engine's fingerprint; None when the first token ended the request."""
    request_id: str
    prompt_len: int
    first: FirstToken               # sequence 0's first token (n > 1: it may end there, the others go on)
    finished: bool                  # the first token already ended the request
    finish_reason: str | None
    cached_tokens: int
    worker_id: str                  # the prefill worker holding the cache
    offer: Offer | None = None
    worker: WorkerStats | None = None       # the prefill worker's counters (for the ingress metrics)
    rng_state: Any = None                   # seeded sampler state after the first token (torch ByteTensor)
    siblings: tuple[FirstToken, ...] = ()   # n > 1: the first tokens of sequences 1..n-1
    prompt_logprobs: list | None = None
    mtp: Any = None                         # the prefill engine's MTP state (workers.request.MTPHandoff, a few
                                            # KB): decode drafts from its first step; None without speculation
