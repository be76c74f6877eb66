"""The engine API: what `AsyncEngine`, the Serve pools, the CLI and the benchmarks call.

`Engine` (one process, or one data-parallel rank) and `DataParallelEngine` (the front over N
ranks, not a subclass) both satisfy `EngineProtocol`; `run_to_completion` is the `generate`
both offer, written once against the protocol.

Contract: every method but `stats` / `rank_stats` runs on the thread that steps the engine
(AsyncEngine's loop); `stats()` may be read racily from another thread.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvmesh.kvstore.transfer.kv_transport import KVTransport, Offer
from kvmesh.kvstore.transfer.nixl_transfer import NixlTransport
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ModelArgs
from kvmesh.workers.request import HeldKV, RequestOutput, Resume
from kvmesh.workers.reuse.prefix_cache import PrefixCache
from kvmesh.workers.sampling.grammar import GuideCompiler
from kvmesh.workers.sampling.params import SamplingParams

from .stats import EngineStats


@runtime_checkable
class EngineProtocol(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self): ...

    @property
    def args(self) -> ModelArgs: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def model_dir(self) -> Path: ...

    @property
    def prefix(self) -> PrefixCache:
        """The prefix cache (data-parallel: rank 0's): its hasher, and the index every rank publishes to."""

    @property
    def guides(self) -> GuideCompiler: ...

    # ---- requests and the step ----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    hold_kv: bool = False, resume: Resume | None = None, wait: bool = True):
        """Queue a request (InvalidRequestError / PromptTooLongError when it cannot run).
        `wait` False: a grammar not compiled yet never blocks the call; the request waits for
        it outside the batch (Engine.add_request)."""

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def reap_landing(self) -> bool: ...

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]: ...

    # ---- handoff (prefill role) ----
    def held_handle(self, request_id: str) -> HeldKV: ...

    def is_held(self, request_id: str) -> bool: ...

    def offer_held(self, request_id: str, transport: KVTransport, skip: int = 0) -> Offer: ...

    def release_held(self, request_id: str) -> None: ...

    def release_read(self, transport: NixlTransport) -> list[str]: ...

    def open_nixl(self, name: str, node_ip: str, backend: str, timeout_s: float) -> NixlTransport | None: ...

    # ---- stats and lifetime ----
    def stats(self) -> EngineStats: ...

    @property
    def rank_stats(self) -> list[EngineStats]:
        """Each rank's stats, in rank order (one entry unless data-parallel)."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


def run_to_completion(engine: EngineProtocol, prompts: list[str | list[int]],
                      params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    """Run all prompts concurrently to completion; results in input order (a request with
    n > 1 gives its n outputs one after another, by index)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(rid, prompt, p)
    final: dict[tuple[str, int], RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id, out.index] = out
    return [final[r, i] for r, p in zip(ids, params_list) for i in range(p.n)]
