"""Decode steps replayed from CUDA graphs, one per batch-size bucket (as vLLM and SGLang do).

A decode step's shapes follow from its batch size alone when the forward reads nothing back
from the device (host-known maxima in `StepInput`) and its window plans have one row per
sequence (`StepInput.fixed_shapes`). A batch of B decoding sequences is padded to the next
bucket:

    rows  | b < B: sequence b's token, position, slot, block row | B <= b < bucket: padding |

Padding rows decode token 0 at position 0 into a state slot and a block reserved for them
(no request's cache is touched) and their logits are dropped. Each step copies the host-built
inputs into the bucket's static buffers (two copies) and replays its graph; a graph is
captured the first time its bucket is needed.

With `capture=False` the same fixed-shape path runs eagerly, without graphs: what the CPU
tests check (tokens equal the ordinary path's, nothing read back inside the forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.workers.model.moe import grouped_mm_runs
from kvmesh.workers.model.step import StepInput
from kvmesh.workers.model.transformer import Transformer
from kvmesh.workers.request import Sequence

# inputs per row, in the static int64 buffer [len(FIELDS), bucket]
FIELDS = ("tokens", "positions", "slots", "ring_from", "keep_tokens")


class GraphCaptureError(RuntimeError):
    """A bucket's decode step could not be captured as a CUDA graph (the runner then decodes
    eagerly and says why once)."""


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_batch (vLLM's capture sizes, cut at the batch limit)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return tuple(sorted({min(b, max_batch) for b in sizes}))


def graph_blockers(model: Transformer, cache: CacheTensors) -> list[str]:
    """Why the fixed-shape decode cannot run on this model and cache ([] = it can)."""
    out = []
    dtype = model.head.weight.dtype
    for i, lc in enumerate(cache.layers):
        if any(c.spec.entries.record for c in lc.compressors):
            out.append(f"layer {i}: FP8 KV records are decoded per used block (a data-dependent set)")
            break
        if any(c.entries.dtype != dtype for c in lc.compressors):
            out.append(f"layer {i}: entries stored as another dtype than the model's are converted per used block")
            break
    if model.args.n_routed_experts and not grouped_mm_runs(model.head.weight):
        out.append(f"routed experts on {dtype} {model.head.weight.device.type}: no grouped matmul "
                   "(the looped fallback reads the picked experts back)")
    return out


@dataclass
class _Bucket:
    size: int
    ints: torch.Tensor          # [len(FIELDS), size] int64 on the device
    table: torch.Tensor         # [size, MB] int32 on the device
    step: StepInput
    logits: torch.Tensor | None = None        # the captured output (graphs only)
    graph: "torch.cuda.CUDAGraph | None" = None


class DecodeGraphs:
    """Fixed-shape decode steps, padded to a bucket; captured as CUDA graphs when `capture`."""

    def __init__(self, model: Transformer, cache: CacheTensors, block_tokens: int, max_blocks: int,
                 scratch_slot: int, scratch_block: int, max_batch: int, device: str | torch.device,
                 capture: bool = True):
        blockers = graph_blockers(model, cache)
        if blockers:
            raise ValueError("fixed-shape decode cannot run here: " + "; ".join(blockers))
        self.model, self.cache, self.device, self.capture = model, cache, torch.device(device), capture
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.sizes = buckets_up_to(max_batch)
        self.buckets: dict[int, _Bucket] = {}
        self.replays = 0

    def accepts(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A pure decode batch that fits a bucket: one token per sequence, past what was restored."""
        return (len(batch) <= self.sizes[-1]
                and all(n == 1 and s.num_computed >= s.keep_tokens for s, n in batch))

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """fp32 logits (on the CPU) of the sequences that get a token, and their batch indices."""
        bucket = self.prepare(batch)
        logits = self.forward(bucket)
        sampled = [b for b, (s, _) in enumerate(batch) if s.num_computed + 1 == s.length]
        return logits[sampled].cpu(), sampled

    def prepare(self, batch: list[tuple[Sequence, int]]) -> _Bucket:
        """Copy the batch, padded to its bucket, into that bucket's static inputs."""
        size = next(b for b in self.sizes if b >= len(batch))
        bucket = self.buckets.get(size) or self._new_bucket(size)
        pad = size - len(batch)
        ints = torch.tensor([[s.token_slice(s.num_computed, s.num_computed + 1)[0] for s, _ in batch] + [0] * pad,
                             [s.num_computed for s, _ in batch] + [0] * pad,
                             [s.slot for s, _ in batch] + [self.scratch_slot] * pad,
                             [s.ring_from for s, _ in batch] + [0] * pad,
                             [s.keep_tokens for s, _ in batch] + [0] * pad], dtype=torch.long)
        table = torch.zeros(size, self.max_blocks, dtype=torch.int32)
        table[len(batch):, 0] = self.scratch_block
        counts = torch.tensor([len(s.blocks) for s, _ in batch], dtype=torch.long)
        rows = torch.arange(len(batch)).repeat_interleave(counts)
        cols = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        table[rows, cols] = torch.tensor([b for s, _ in batch for b in s.blocks], dtype=torch.int32)
        bucket.ints.copy_(ints)
        bucket.table.copy_(table)
        return bucket

    def forward(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's logits [size, vocab] (device memory that the next step overwrites)."""
        self.replays += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.logits
        bucket.step.clear_derived()      # plans are built inside the forward (they are step data)
        return self.model(bucket.step, self.cache)

    def _new_bucket(self, size: int) -> _Bucket:
        ints = torch.zeros(len(FIELDS), size, dtype=torch.long, device=self.device)
        ints[FIELDS.index("slots")] = self.scratch_slot
        table = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=self.device)
        table[:, 0] = self.scratch_block
        tokens, positions, slots, ring_from, keep = ints.unbind(0)
        rows = torch.arange(size, device=self.device)
        step = StepInput(tokens=tokens, positions=positions, q_seq=rows, starts=positions,
                         lengths=torch.ones(size, dtype=torch.long, device=self.device), slots=slots,
                         block_table=table, ring_from=ring_from, keep_tokens=keep, logits_at=rows,
                         max_len=1, max_end=self.max_blocks * self.block_tokens, decode=True, fixed_shapes=True)
        bucket = _Bucket(size, ints, table, step)
        if self.capture:      # every row is padding now: warm-up and capture touch only the scratch slot/block
            try:
                self._capture(bucket)
            except Exception as e:
                raise GraphCaptureError(f"decode step of batch size {size}: {type(e).__name__}: {e}") from e
        self.buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):         # warm-up off the capture: Triton compiles, allocator settles
            for _ in range(2):
                bucket.step.clear_derived()
                self.model(bucket.step, self.cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        bucket.step.clear_derived()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bucket.logits = self.model(bucket.step, self.cache)
        bucket.graph = graph
