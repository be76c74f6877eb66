"""Replay a request trace through one engine, one request at a time, in arrival order.

Each request's prompt is its hash ids' deterministic blocks (`kvmesh.kvstore.policy.trace`); it runs to
its first token (outputs are not replayed: a conversation's next turn carries them as
hash ids of its own). Per request it records what reuse did — tokens restored from each
tier, tokens recomputed, time to first token — and the first token and its logprob, which
must equal a cold run's.
"""
from __future__ import annotations

import time
from typing import NamedTuple

from kvmesh.kvstore.policy.trace import TraceRequest, prompt_token_ids
from kvmesh.workers.engine.engine import Engine
from kvmesh.workers.sampling.params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class ReplayRecord(NamedTuple):
    prompt_tokens: int
    hit_tokens: int                  # prompt tokens restored (cached_tokens)
    recompute_tokens: int            # tokens rerun before the hit (zero policy)
    device_tokens: int               # block tokens restored from each tier
    host_tokens: int
    store_tokens: int
    ttft_s: float
    token: int
    logprob: float


def run_request(engine: Engine, req: TraceRequest, request_id: str) -> ReplayRecord:
    """One request to its first token; the store writes it queued are flushed after the
    timed span (a write-behind runs beside serving, not in front of it)."""
    bt, vocab, stats = engine.config.block_tokens, engine.args.vocab_size, engine.prefix.stats
    prompt = prompt_token_ids(req, bt, vocab)
    counters = lambda: (stats.recomputed_tokens, stats.blocks_from_memory, stats.blocks_from_host,  # noqa: E731
                        stats.blocks_from_store)
    before = counters()
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, FIRST_TOKEN)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o if o.finished else out
    ttft = time.perf_counter() - t0
    engine.flush()
    if out is None or out.error:
        raise RuntimeError(f"request {request_id} failed: {out.error if out else 'no output'}")
    recomputed, memory, host, store = (a - b for a, b in zip(counters(), before))
    return ReplayRecord(len(prompt), out.cached_tokens, recomputed, (memory - host) * bt, host * bt, store * bt,
                        ttft, out.token_ids[0], out.logprobs[0])


def replay(engine: Engine, requests: list[TraceRequest], tag: str = "r") -> list[ReplayRecord]:
    return [run_request(engine, req, f"{tag}-{i}") for i, req in enumerate(requests)]


def stored_payload(engine: Engine) -> dict[str, tuple[int, int]]:
    """kind -> (objects, tensor bytes) in the engine's store, read back and verified."""
    store = engine.prefix.store
    out = {}
    for kind in ("block", "checkpoint"):
        n = size = 0
        for h in store.list(kind):
            obj = store.get(kind, h)
            if obj is not None:
                n += 1
                size += sum(t.numel() * t.element_size() for t in obj.tensors.values())
        out[kind] = (n, size)
    return out
