"""Wiring one engine from its config: the parts `Engine` runs, built once at start-up.

    ranks = start_ranks(config, model_dir, launcher)      # TP > 1: ranks 1..N-1, else None
    parts = build(config, model_dir, ranks)               # model, cache, tiers, manager, runner

Order matters and is fixed here: the model decides the cache layout; the layout and the memory
budget size the block and slot pools; the fingerprint (model config, weights, dtype, layout)
and the store key's id name the store and index namespace; the prefix cache sits on the pools and the tiers; the
KV-cache manager is the only allocator over all of them.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.kvstore.device.block_pool import BlockPool
from kvmesh.kvstore.device.cache_tensors import CacheTensors, size_pools
from kvmesh.kvstore.hashing import PrefixHasher, model_fingerprint, store_namespace
from kvmesh.kvstore.store.host_cache import HostCache
from kvmesh.kvstore.index.embedded import PrefixIndex, make_index
from kvmesh.kvstore.index.kv_events import KvEventPublisher
from kvmesh.kvstore.device.layout import LAYOUT_VERSION, CacheLayout, LayoutParams
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.device.mirror import MirroredCache
from kvmesh.kvstore.policy.planner import SwaPolicy, recompute_span
from kvmesh.kvstore.redact import redact_url
from kvmesh.kvstore.store.scrub import Scrubber, ScrubSchedule
from kvmesh.kvstore.device.state_slots import SlotPool
from kvmesh.kvstore.store.object_store import ObjectStore
from kvmesh.workers.checkpoint.loader import load_model
from kvmesh.workers.checkpoint.sharding import check_sizes
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
from kvmesh.workers.checkpoint.weights_id import weights_identity
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ModelArgs
from kvmesh.workers.model.shard import SINGLE, Shard
from kvmesh.workers.model.transformer import Transformer
from kvmesh.workers.parallel.collectives import Collectives
from kvmesh.workers.parallel.expert_balance import balancer, start_placement
from kvmesh.workers.parallel.replica import (ExpertGroup, Leader, LocalProcessLauncher, RankLauncher, group_device,
                                             grouped_shard, run_rank)
from kvmesh.workers.reuse.auto_policy import AutoPeriod
from kvmesh.workers.reuse.prefix_cache import PrefixCache

from .kv_manager import KVCacheManager
from .runner import ModelRunner

log = logging.getLogger(__name__)
STORE_STAGING_BYTES = 32 << 20     # the store reads restored blocks into this reused buffer


class StoreUnavailable(RuntimeError):
    """`require_store` is set and the store or index could not be opened."""


@dataclass(frozen=True)
class EngineParts:
    """What `build` wires, read by name. Under tensor parallelism `cache` is rank 0's recording
    mirror (kvstore/device/mirror.py) of the cache the forward writes, which only the runner holds."""
    args: ModelArgs
    model: Transformer
    tokenizer: object
    layout: CacheLayout
    policy: SwaPolicy
    cache: CacheTensors | MirroredCache    # what the engine writes through (records calls under TP)
    blocks: BlockPool
    slots: SlotPool
    fingerprint: str
    prefix: PrefixCache
    kv: KVCacheManager
    runner: ModelRunner
    max_model_len: int


def start_ranks(config: EngineConfig, model_dir: Path, launcher: RankLauncher | None,
                dp: Collectives | None = None) -> Leader | None:
    """With tensor_parallel_size N > 1, start ranks 1..N-1 (default: local processes) and
    return rank 0's side of the replica; None at N = 1. Bad sizes fail here, before any load.
    `dp`: this engine is a data-parallel rank, its N ranks a TP group inside it: always local
    processes (a group never spans nodes), joining the replica's expert group."""
    if config.tensor_parallel_size == 1:
        return None
    check_sizes(ModelArgs.from_file(model_dir / "config.json"), config.tensor_parallel_size,
                config.enable_expert_parallel)
    if dp is None:
        return Leader(config, launcher or LocalProcessLauncher())
    experts = ExpertGroup(dp.init_method, dp.rank, config.tensor_parallel_size, dp.size * config.tensor_parallel_size)
    group = LocalProcessLauncher(main=functools.partial(run_rank, experts=experts), device_of=group_device)
    return Leader(config, group, experts, dp.store)


def build(config: EngineConfig, model_dir: Path, ranks: Leader | None, dp: Collectives | None = None
          ) -> EngineParts:
    """`dp`: this engine is rank dp.rank of a data-parallel replica (experts split, the rest whole;
    with `ranks`, the rest split over its TP group as under tensor parallelism)."""
    shard = SINGLE if ranks is None else Shard(0, config.tensor_parallel_size, config.enable_expert_parallel,
                                               comm=ranks.comm)
    if dp is not None and ranks is not None:
        shard = grouped_shard(config, model_dir, ranks.comm, ranks.experts)
    elif dp is not None:
        shard = Shard(expert_parallel=True, dp_rank=dp.rank, dp_size=dp.size, exchange=dp,
                      placement=start_placement(config, model_dir))
    args, model = load_model(model_dir, config.dtype, config.device, config.kernel_backend, shard)
    dtype = model.head.weight.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    layout = CacheLayout.build(
        LayoutParams(args.layer_types, args.head_dim, args.index_head_dim, args.csa_ratio, args.hca_ratio,
                     args.sliding_window, dtype_name, config.kv_cache_dtype, args.rope_head_dim),
        config.block_tokens)
    policy = config.policy
    swa_blocks = policy.kind == "full"
    num_blocks, num_slots = size_pools(layout, config.kv_cache_bytes, config.max_num_seqs, swa_blocks)
    raw_cache = CacheTensors(layout, num_blocks, num_slots, dtype, config.device, swa_blocks)
    cache = raw_cache if ranks is None else ranks.ready(raw_cache)
    blocks, slots = BlockPool(num_blocks), SlotPool(num_slots)
    kv = config.kv_cache_dtype    # part of the fingerprint: a bf16 object is never read as fp8
    # Block objects carry SWA K=V only under the `full` policy, so that is part of the layout.
    fingerprint = model_fingerprint(args.raw, weights_identity(model_dir),
                                    dtype_name if kv == "auto" else f"{dtype_name}/kv:{kv}", config.block_tokens,
                                    LAYOUT_VERSION * 2 + int(swa_blocks))
    prefix = prefix_cache(config, args, layout, cache, blocks, fingerprint)
    manager = KVCacheManager(cache, blocks, slots, prefix, config.handoff_loads_in_flight)
    runner = ModelRunner(model, raw_cache, config.device, ranks)
    max_model_len = min(config.max_model_len or args.max_position_embeddings, num_blocks * config.block_tokens)
    return EngineParts(args=args, model=model, tokenizer=load_tokenizer(model_dir), layout=layout, policy=policy,
                       cache=cache, blocks=blocks, slots=slots, fingerprint=fingerprint, prefix=prefix, kv=manager,
                       runner=runner, max_model_len=max_model_len)


def prefix_cache(config: EngineConfig, args: ModelArgs, layout: CacheLayout, cache: CacheTensors,
                 blocks: BlockPool, fingerprint: str) -> PrefixCache:
    """The prefix cache over this engine's pools, its host cache and (when they open) the
    shared store and index; without them it serves with in-memory reuse only."""
    key = StoreKey(config.store_key) if config.store_key else None   # a bad key is a config error: fatal
    try:
        store, index = open_tiers(config, fingerprint, key)
    except Exception as e:     # the store and index are an optimisation: serve without them
        if config.require_store:
            raise StoreUnavailable(f"store {config.store!r} / index {redact_url(config.index)!r}: {e}") from e
        log.warning("prefix store/index unusable at start-up (%s: %s): serving without prefix reuse "
                    "(require_store makes this fatal)", type(e).__name__, e)
        store = index = None
    span = recompute_span(args.num_hidden_layers, args.sliding_window, max([args.csa_ratio, args.hca_ratio]))
    worker = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
    tuner = AutoPeriod(layout, capacity_bytes=config.store_capacity_bytes) if config.policy.adaptive else None
    hasher = PrefixHasher(fingerprint, config.block_tokens)
    scrub = (ScrubSchedule(Scrubber(store), config.store_scrub_interval_s, config.store_scrub_pass_bytes)
             if store is not None and config.store_scrub_interval_s else None)
    events = kv_events(config, index, worker)
    if store is not None:
        store.attach_events(events)     # the blocks this rank puts in / removes from the store
    return PrefixCache(cache, blocks, hasher, config.policy, span, store, index, HostCache(config.host_cache_bytes),
                       worker, enabled=config.prefix_reuse, auto=tuner, scrub=scrub, events=events,
                       prefetch_bytes=config.restore_prefetch_bytes, reads_in_flight=config.store_reads_in_flight)


def kv_events(config: EngineConfig, index: PrefixIndex | None, worker: str) -> KvEventPublisher | None:
    """This rank's KV event publisher, beating on its own thread: over the index's Redis (the
    routers follow that stream); None with the embedded index or without prefix reuse. The
    prefix cache publishes the device and host tiers, the store its store tier."""
    if index is None or config.index == "local" or not config.prefix_reuse:
        return None
    from kvmesh.kvstore.index.kv_event_stream import RedisEventStream  # lazy: embedded users need no redis

    return KvEventPublisher(worker, RedisEventStream(config.index, index.namespace)).start()


def open_tiers(config: EngineConfig, fingerprint: str, key: StoreKey | None
               ) -> tuple[ObjectStore | None, PrefixIndex | None]:
    store = (ObjectStore(config.store, fingerprint, config.store_capacity_bytes, key=key,
                         read_timeout_s=config.store_read_timeout_s, staging_bytes=STORE_STAGING_BYTES,
                         reader=config.store_reader, reads_in_flight=config.store_reads_in_flight,
                         read_buffer_bytes=config.restore_prefetch_bytes)   # the prefetch's objects, reused
             if config.store else None)
    index = None
    if store is not None or config.index != "local":
        index = make_index(config.index, fingerprint, store,
                           namespace=store_namespace(fingerprint, key.key_id if key is not None else None))
        if store is not None:
            store.attach_index(index)
            if config.index != "local":   # the store is the truth: re-seed a shared index from it
                index.rebuild_from(store)
    return store, index
