"""Model runner: turns a scheduled batch into a StepInput, runs the model, returns logits."""
from __future__ import annotations

import torch

from kvstore.cache_tensors import CacheTensors

from .model import StepInput, Transformer
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, cache: CacheTensors, device: str = "cpu"):
        self.model, self.cache, self.device = model, cache, device

    def build(self, batch: list[tuple[Sequence, int]]) -> tuple[StepInput, list[int]]:
        """Returns the step and the indices (into batch) of sequences that get a new token."""
        tokens, positions, q_seq, logits_at, sampled = [], [], [], [], []
        starts, lengths, slots, ring_from, keep = [], [], [], [], []
        max_blocks = max(len(s.blocks) for s, _ in batch) or 1
        table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        offset = 0
        for b, (seq, n) in enumerate(batch):
            start = seq.num_computed
            tokens += seq.token_slice(start, start + n)
            positions += range(start, start + n)
            q_seq += [b] * n
            starts.append(start)
            lengths.append(n)
            slots.append(seq.slot)
            ring_from.append(seq.ring_from)
            keep.append(seq.keep_tokens)
            table[b, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            offset += n
            if start + n == seq.length:
                logits_at.append(offset - 1)
                sampled.append(b)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        step = StepInput(tokens=t(tokens), positions=t(positions), q_seq=t(q_seq), starts=t(starts),
                         lengths=t(lengths), slots=t(slots), block_table=table.to(self.device),
                         ring_from=t(ring_from), keep_tokens=t(keep), logits_at=t(logits_at))
        return step, sampled

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        step, sampled = self.build(batch)
        logits = self.model(step, self.cache)
        return logits.cpu(), sampled
