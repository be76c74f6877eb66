"""Rank 0's cache under tensor parallelism: every mutating `CacheTensors` call is applied here
and recorded, so the other ranks (which hold identical copies) can replay it before the next
forward (workers.parallel.replica sends the list with each step).

The plain `CacheTensors` has the same `real` / `resync` surface as no-ops, so the engine's
KV-cache manager writes through either without asking which one it holds.
"""
from __future__ import annotations

import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors


class MirroredCache:
    """Rank 0's cache as the engine sees it: every mutating `CacheTensors` call is applied and
    recorded (`take()` hands the list over); reads and the tensors pass through. The model's
    forward writes the real cache directly: every rank runs that one itself."""
    MUTATORS = ("reset_slot", "copy_block", "copy_slot", "load_blocks", "load_packed",
                "rebuild_slot", "load_slot", "scatter", "write_ring_rows", "write_overlap_rows")

    def __init__(self, cache: CacheTensors):
        self.real, self.ops = cache, []

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if name not in self.MUTATORS:
            return attr

        def recorded(*args):
            attr(*args)
            self.ops.append((name, snapshot(args)))
        return recorded

    def resync(self, block_ids: list[int], slot: int) -> None:
        """Blocks and a slot written behind the cache's back (a NIXL READ into its memory):
        send their bytes as they are now."""
        self.ops.append(("scatter", (list(block_ids), slot, self.real.gather(block_ids, slot))))

    def take(self) -> list[tuple[str, tuple]]:
        ops, self.ops = self.ops, []
        return ops


def snapshot(x):
    """A copy of a call's arguments as they are now: the caller may reuse its buffers (a
    store read's rows, a block list that grows) before the next step sends them."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, (list, tuple)):
        return type(x)(snapshot(v) for v in x)
    if isinstance(x, dict):
        return {k: snapshot(v) for k, v in x.items()}
    return x
