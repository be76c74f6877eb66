"""Model runner: turns a scheduled batch into a StepInput, runs the model, returns logits."""
from __future__ import annotations

import torch

from kvstore.cache_tensors import CacheTensors

from .model import StepInput, Transformer
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, cache: CacheTensors, device: str = "cpu"):
        self.model, self.cache, self.device = model, cache, device

    def build(self, batch: list[tuple[Sequence, int]]) -> tuple[StepInput, list[int], list[tuple[int, int]]]:
        """Returns the step, the indices (into batch) of sequences that get a new token (their
        logits come first), and (batch index, position) of each further logits row: prompt
        positions of sequences that asked for prompt logprobs (echo)."""
        tokens, positions, q_seq, logits_at, sampled = [], [], [], [], []
        extra_at, extra = [], []
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
            if seq.params.prompt_logprobs is not None:   # every prompt position but the sampled last
                last = min(start + n, len(seq.prompt) - 1)
                extra_at += range(offset, offset + max(0, last - start))
                extra += [(b, p) for p in range(start, last)]
            offset += n
            if start + n == seq.length:
                logits_at.append(offset - 1)
                sampled.append(b)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        step = StepInput(tokens=t(tokens), positions=t(positions), q_seq=t(q_seq), starts=t(starts),
                         lengths=t(lengths), slots=t(slots), block_table=table.to(self.device),
                         ring_from=t(ring_from), keep_tokens=t(keep), logits_at=t(logits_at + extra_at))
        return step, sampled, extra

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int], list[tuple[int, int]]]:
        """fp32 logits: one row per sampled sequence, then one per `extra` (batch index, position)."""
        step, sampled, extra = self.build(batch)
        logits = self.model(step, self.cache)
        return logits.cpu(), sampled, extra
