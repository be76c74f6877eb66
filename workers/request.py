"""A request's life in the engine: tokens, progress, cache handles, outputs, and the messages
for moving a prefilled request from one engine to another.

The source engine holds the request (`HeldKV`, kvstore.transfer.kv_transport) and a KVTransport
offers it; the destination engine continues it from a `Resume`, whose `load` fills the
blocks and slot it allocated (usually `KVTransport.load` of the offer).

This is the leaf of `workers/`: the engine, the scheduler, the KV-cache manager, the prefix
cache and the speculators all import it, and it imports only sampling params."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

from kvmesh.kvstore.transfer.kv_transport import HeldKV
from kvmesh.workers.sampling.params import SamplingParams

if TYPE_CHECKING:     # types only: the API layer builds requests without torch
    import torch

__all__ = ["FirstToken", "HeldKV", "MTPHandoff", "RequestOutput", "Resume", "Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    HELD = "held"           # prefilled, out of the batch; its blocks + slot wait for a handoff


@dataclass(frozen=True)
class FirstToken:
    """The first token of one of a request's n sequences, as the prefill engine sampled it:
    what a handoff carries so that decode continues (or forks) each sequence after it."""
    token: int
    logprob: float
    top: tuple = ()                 # its top logprobs: ((id, logprob), ...) best first
    finish: str | None = None       # the sequence ended on this token ("stop" | "length"); None: it goes on
    index: int = 0                  # which of the request's n sequences


@dataclass(frozen=True)
class MTPHandoff:
    """The MTP layer's state for a prefilled request (workers/spec/mtp.py), handed to decode beside
    the cache so that its first step drafts exactly as a colocated run's: the layer's window ring
    of the request's state slot ([window, head_dim], a CPU copy; rows are indexed by position %
    window, so they need no moving), the first position whose ring row is valid (0, or where a
    restored prefix ended), and the drafts the layer made for the token after the first one.
    A few KB: it travels in the handoff message itself, beside any transport of the cache."""
    ring: torch.Tensor
    ring_from: int
    drafts: tuple[int, ...]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]            # all generated so far
    new_token_ids: list[int]        # generated since the previous output for this request
    logprobs: list[float]
    text: str                       # the decoded output; set on the final output only ("" before)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | "error" | "held" (see `held`)
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    index: int = 0                  # which of the request's n sequences
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)   # per new token
    all_finished: bool = True       # every sequence of the request has finished (n > 1)
    prompt_logprobs: list | None = None    # on the first output, when asked: [None, (logprob, top), ...]
    first: FirstToken | None = None        # prefill role (hold_kv): sequence 0's first token, and whether
                                           # it ended there (with n > 1 the others may go on)
    siblings: list[FirstToken] = field(default_factory=list)   # prefill role, n > 1: sequences 1..n-1's
    held: bool = False                     # prefill role: the request stopped after its first token and
                                           # its cache is held for a handoff (finish_reason "held")


@dataclass(eq=False)   # identity: the scheduler's `seq in running` must not compare fields
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival: float = 0.0
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0           # tokens whose KV/state is in the cache
    cached_tokens: int = 0          # prompt tokens restored instead of computed
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    hashed_blocks: int = 0          # leading blocks already named by their prefix hash
    ring_from: int = 0              # window rows before this position are invalid (zero-policy recompute)
    keep_tokens: int = 0            # compressed entries of windows ending <= this were restored
    hold_kv: bool = False           # stop after the first token and keep blocks + slot (prefill role)
    resume: object | None = None    # handoff.Resume: cache filled by another engine (decode role)
    chain: list[int] = field(default_factory=list)   # prefix hashes of full blocks, computed lazily
    branch_at: int = 0              # auto policy: checkpoint this block boundary when passing it
    prefetched: object | None = None    # prefix_cache.Prefetch: its store reads ran off the step (find reads no store)
    end_state: tuple | None = None  # (position, slot state) at the latest block boundary while decoding
    finish_reason: str | None = None
    emitted: int = 0                # output tokens already reported
    index: int = 0                  # which of the request's n sequences (children fork from 0)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    guide: object | None = None     # workers.sampling.grammar.Guide when the output is grammar-constrained
    siblings: list[FirstToken] = field(default_factory=list)   # the request's other first tokens: prefill
                                    # role, sampled with this one; decode role, the forks still to come
    prompt_lps: list = field(default_factory=list)   # prompt logprobs computed so far (echo)
    first_finish: str | None = None # held with n > 1: why sequence 0 ended on its first token
    scheduled: bool = False         # ran in a step at least once (queue time is measured to then)
    mtp_handoff: MTPHandoff | None = None   # prefill role, held: the MTP layer's state for decode

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole prompt + output list."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p:end - p]
        return self.prompt[start:end] + (self.output[:end - p] if end > p else [])

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def remaining_prefill(self) -> int:
        """Tokens to run before the next sample (the whole known sequence)."""
        return self.length - self.num_computed


class Resume(NamedTuple):
    """Decode side: continue a request another engine prefilled.

    `load(cache, block_ids, slot, reused)` runs on the engine thread and fills the freshly
    allocated blocks and slot (a KVTransport.load, or CacheTensors.scatter of a payload);
    `block_ids[:reused]` already hold the prompt's first `reused` blocks (this engine's prefix
    cache had them) and must not be written. Whatever it raises fails this request only."""
    first: FirstToken                       # sequence 0's (n > 1: it may have ended there, the others go on)
    load: Callable
    cached_tokens: int = 0
    rng_state: torch.Tensor | None = None   # continue the seeded sampler where prefill left it
    siblings: tuple[FirstToken, ...] = ()   # n > 1: sequences 1..n-1's
    mtp: MTPHandoff | None = None           # the prefill engine's MTP state: drafting from the first step
