"""Real KV-cache parts without a model: a small three-layer cache (SWA, CSA, HCA), its
pools, a prefix cache over a host cache and (optionally) a store on disk, and the
KV-cache manager over them. `compute` stands in for the model: it writes seeded noise
where a forward pass would write the request's cache, then names and persists it."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from kvmesh.kvstore.device.block_pool import BlockPool
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.store.host_cache import HostCache
from kvmesh.kvstore.index.embedded import make_index
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.policy.planner import SwaPolicy, recompute_span
from kvmesh.kvstore.device.state_slots import SlotPool
from kvmesh.kvstore.store.object_store import ObjectStore
from kvmesh.workers.engine.kv_manager import NO_HIT, KVCacheManager
from kvmesh.workers.request import Sequence
from kvmesh.workers.reuse.prefix_cache import PrefixCache
from kvmesh.workers.sampling.params import SamplingParams

BT = 16
FINGERPRINT = "5eed" * 16
LAYOUT = LayoutParams((SWA, CSA, HCA), head_dim=32, index_head_dim=16, csa_ratio=4, hca_ratio=16, window=8,
                      dtype="float32")


class Parts(NamedTuple):
    cache: CacheTensors
    pool: BlockPool
    slots: SlotPool
    prefix: PrefixCache
    kv: KVCacheManager
    store: ObjectStore | None


def make_parts(store_dir: Path | None = None, policy: str = "full", num_blocks: int = 16, num_slots: int = 4,
               host_bytes: int = 64 << 20) -> Parts:
    layout = CacheLayout.build(LAYOUT, BT)
    cache = CacheTensors(layout, num_blocks, num_slots, torch.float32, swa_blocks=policy == "full")
    pool, slots = BlockPool(num_blocks), SlotPool(num_slots)
    store = index = None
    if store_dir is not None:
        store = ObjectStore(str(store_dir), FINGERPRINT, staging_bytes=1 << 20)
        index = make_index("local", FINGERPRINT, store)
        store.attach_index(index)
    span = recompute_span(len(LAYOUT.layer_types), LAYOUT.window, LAYOUT.hca_ratio)
    prefix = PrefixCache(cache, pool, PrefixHasher(FINGERPRINT, BT), SwaPolicy.parse(policy, BT), span, store,
                         index, HostCache(host_bytes), "test-worker")
    return Parts(cache, pool, slots, prefix, KVCacheManager(cache, pool, slots, prefix), store)


def request(prompt: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=4))


def prompt_of(blocks: int, extra: int = 3, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (blocks * BT + extra,), generator=g).tolist()


def compute(parts: Parts, seq: Sequence, seed: int = 1) -> None:
    """Admit seq cold, fill its blocks and slot as a forward pass over its whole prompt
    would (seeded noise), then name and persist them (after_step at the prompt's last block
    boundary, where checkpointing policies checkpoint, and at its end)."""
    assert parts.kv.allocate_slots(seq, len(seq.prompt), NO_HIT)
    g = torch.Generator().manual_seed(seed)
    for lc in parts.cache.layers:
        for t in lc.blocks.values():
            t[seq.blocks] = torch.randn(t[seq.blocks].shape, generator=g)
        for t in [lc.ring, *lc.tails.values()]:
            t[seq.slot] = torch.randn(t[seq.slot].shape, generator=g)
    end = len(seq.prompt) // BT * BT
    for upto in (end, len(seq.prompt)):
        seq.num_computed = upto
        parts.prefix.after_step(seq)
    parts.prefix.flush()


def block_data(cache: CacheTensors, block: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in cache.block_state(block).items()}
