"""Model runner: turns a scheduled batch into a StepInput, runs the model, returns logits."""
from __future__ import annotations

import logging

import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.workers.model.step import StepInput
from kvmesh.workers.model.transformer import Transformer
from kvmesh.workers.request import Sequence

from .cuda_graphs import DecodeGraphs, GraphCaptureError

log = logging.getLogger(__name__)


class ModelRunner:
    """`leader` (tensor parallelism, workers/parallel/replica.py): each step goes to the other ranks
    before rank 0 runs it. `graphs` (CUDA, one rank only): fixed-shape decode steps replayed
    from CUDA graphs."""

    def __init__(self, model: Transformer, cache: CacheTensors, device: str = "cpu", leader=None):
        self.model, self.cache, self.device, self.leader = model, cache, device, leader
        self.graphs: DecodeGraphs | None = None

    def build(self, batch: list[tuple[Sequence, int]], drafts: dict[int, list[int]] | None = None
              ) -> tuple[StepInput, list[int], list[tuple[int, int]]]:
        """Returns the step, the indices (into batch) of sequences that get a new token (their
        logits come first: per sampled sequence its last real row, then its draft rows), and
        (batch index, position) of each further logits row: prompt positions of sequences that
        asked for prompt logprobs (echo). `drafts` (batch index -> draft tokens) run after that
        sequence's real tokens. The step's tensors are on the CPU. One pass over the batch reads
        each sequence's scalars and tokens; every per-token and per-block tensor is then built by
        a few vectorized ops."""
        drafts = drafts or {}
        tokens, blocks, extra_at, extra = [], [], [], []
        per_seq = torch.tensor([(s.num_computed, n + len(drafts.get(b, ())), s.slot, s.ring_from, s.keep_tokens,
                                 len(s.blocks), s.num_computed + n == s.length, len(drafts.get(b, ())))
                                for b, (s, n) in enumerate(batch)], dtype=torch.long)
        offset = 0
        for b, (seq, n) in enumerate(batch):
            start = seq.num_computed
            tokens += seq.token_slice(start, start + n) + drafts.get(b, [])
            blocks += seq.blocks
            if seq.params.prompt_logprobs is not None:   # every prompt position but the sampled last
                last = min(start + n, len(seq.prompt) - 1)
                extra_at += range(offset, offset + max(0, last - start))
                extra += [(b, p) for p in range(start, last)]
            offset += n + len(drafts.get(b, ()))
        starts, lengths, slots, ring_from, keep, nblocks, samples, ndrafts = per_seq.unbind(1)
        q_seq = torch.repeat_interleave(torch.arange(len(batch)), lengths)
        ends = torch.cumsum(lengths, 0)
        positions = starts[q_seq] + torch.arange(q_seq.shape[0]) - (ends - lengths)[q_seq]
        table = torch.zeros(len(batch), max(int(nblocks.max()), 1), dtype=torch.int32)
        table[torch.arange(len(batch)).repeat_interleave(nblocks), _ranks(nblocks)] = \
            torch.tensor(blocks, dtype=torch.int32)
        sampled = torch.nonzero(samples).squeeze(1)
        rows = ndrafts[sampled] + 1
        logits_at = torch.cat([(ends[sampled] - rows).repeat_interleave(rows) + _ranks(rows),
                               torch.tensor(extra_at, dtype=torch.long)])
        lens = [n + len(drafts.get(b, ())) for b, (_, n) in enumerate(batch)]
        fresh = all(s.num_computed >= s.keep_tokens for s, _ in batch)
        step = StepInput(tokens=torch.tensor(tokens, dtype=torch.long), positions=positions,
                         q_seq=q_seq, starts=starts, lengths=lengths, slots=slots,
                         block_table=table, ring_from=ring_from, keep_tokens=keep,
                         logits_at=logits_at, max_len=max(lens),
                         max_end=max(s.num_computed + n for s, n in zip((s for s, _ in batch), lens)),
                         decode=max(lens) == 1 and fresh, fresh=fresh)
        return step, sampled.tolist(), extra

    def run(self, batch: list[tuple[Sequence, int]], drafts: dict[int, list[int]] | None = None,
            keep_streams: bool = False) -> tuple[torch.Tensor, list[int], list[tuple[int, int]]]:
        """fp32 logits: 1 + drafts rows per sampled sequence, then one per `extra` (batch index,
        position). With keep_streams the step and the last layer's streams stay in `self.last`.
        A pure decode batch goes through `self.graphs` when set."""
        if self.graphs is not None and self.leader is None and not drafts and not keep_streams and self.graphs.accepts(batch):
            try:
                logits, sampled = self.graphs.run(batch)
                return logits, sampled, []
            except GraphCaptureError as e:     # nothing of the batch ran: decode it eagerly from now on
                log.warning("CUDA graphs off, decoding eagerly: %s", e)
                self.graphs = None
        step, sampled, extra = self.build(batch, drafts)
        if self.leader is not None:
            self.leader.forward(step, keep_streams)
        step = step.to(self.device)
        if keep_streams:
            logits, streams = self.model(step, self.cache, keep_streams=True)
            self.last = (step, streams)
        else:
            logits = self.model(step, self.cache)
        return logits.cpu(), sampled, extra


    def idle(self) -> None:
        """Data-parallel attention: no batch here while another rank runs one (see Transformer.idle);
        a TP group inside the DP rank runs it on every rank."""
        if self.leader is not None:
            self.leader.idle()
        self.model.idle()


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """[0..c0), [0..c1), ... concatenated: each item's rank within its group."""
    total = torch.arange(int(counts.sum()))
    return total - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
