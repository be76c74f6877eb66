"""The engine: one process, one model, many requests.

    engine.py      the loop (schedule -> run -> process outputs), intake, the handoff API, stats
    protocol.py    EngineProtocol: the API Engine and DataParallelEngine both offer (run_to_completion)
    builder.py     wiring the parts from an EngineConfig: model, cache, tiers, manager, runner
    output.py      sampling calls, stop checks, finishing / holding, n > 1 forks, RequestOutput
    grammar_wait.py guided requests waiting for their grammar outside the batch
    scheduler.py   continuous batching under a token budget (decodes first, then prefill chunks)
    kv_manager.py  the only allocator of blocks and state slots (get_computed_blocks / allocate_slots)
    runner.py      a batch -> StepInput -> the model's forward (and the CUDA-graph decode path)
    cuda_graphs.py the fixed-shape decode path and its graphs
    stats.py       EngineStats and its typed counters (EngineCounters, ReuseCounters, StoreCounters,
                   GrammarCounters: the metrics surface), summed over data-parallel ranks; the queue-time histogram
    async_engine.py the engine on a background thread, with async streams
    data_parallel.py data-parallel attention + expert parallelism: the front over N engines (open_engine)
    dp_rank.py     one DP rank: the tick messages and what each rank does with a tick

Contracts: only the engine thread mutates the scheduler, the KV-cache manager and the cache;
`stats()` may be read racily from another thread. The engine depends on model/, checkpoint/,
sampling/, spec/, reuse/ and parallel/; none of them imports it.
"""
from importlib import import_module

from kvmesh.workers.engine_config import EngineConfig

# the rest on first use (PEP 562): the API layer reads `kvmesh.workers.engine.stats` (its metrics' types)
# and must not load torch and the model by importing this package (tests/unit/test_layering.py)
_LAZY = {"StoreUnavailable": ".builder", "DataParallelEngine": ".data_parallel", "open_engine": ".data_parallel",
         "Engine": ".engine", "EngineProtocol": ".protocol"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["DataParallelEngine", "Engine", "EngineConfig", "EngineProtocol", "StoreUnavailable", "open_engine"]
