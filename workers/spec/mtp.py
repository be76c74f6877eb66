"""The checkpoint's MTP layer as the speculative-decoding draft.

After every engine step the layer runs over the positions the step computed (the main
model's last streams there, and the token that followed each), keeping its own SWA ring per
state slot, then chains itself from each decoding sequence's last position: draft 1 comes
from the main streams and the sampled token, draft i + 1 from the layer's own streams and
draft i. Drafts only change speed, never output, so the layer's ring may be stale where it
never ran (before a restored prefix): those rows are masked like the main model's.
"""
from __future__ import annotations

import torch

from kvstore.cache_tensors import LayerCache
from kvstore.layout import SWASpec
from workers.model.step import StepInput
from workers.model.transformer import Transformer
from workers.request import Sequence, Status

from .speculative import Drafter


class MTPDrafter(Drafter):
    wants_streams = True

    def __init__(self, model: Transformer, num_slots: int):
        self.model, self.layer = model, model.mtp[0]
        a, w = model.args, model.embed.weight
        ring_only = SWASpec(block_tokens=0, head_dim=a.head_dim, window=a.sliding_window,
                            dtype=str(w.dtype).removeprefix("torch."))
        self.cache = LayerCache(ring_only, num_blocks=0, num_slots=num_slots, device=w.device)
        self.drafts: dict[int, list[int]] = {}   # id(seq) -> its drafts for the next step
        self.first: dict[int, int] = {}          # id(seq) -> first position the layer ran on

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.drafts.get(id(seq), [])[:k]

    @torch.inference_mode()
    def observe(self, batch: list[tuple[Sequence, int]], starts: list[int], step: StepInput,
                streams: torch.Tensor, k: int) -> None:
        rows, tokens, seqs, spans = [], [], [], []
        cu = step.cu.tolist()
        for b, (seq, _) in enumerate(batch):
            if seq.status == Status.FINISHED or seq.finish_reason or seq.slot is None:
                continue
            start, end = starts[b], seq.num_computed
            rows += range(cu[b], cu[b] + end - start)
            tokens += seq.token_slice(start + 1, end + 1)
            seqs.append(seq)
            spans.append((start, end - start))
        self.first = {id(s): self.first.get(id(s), start) for s, (start, _) in zip(seqs, spans)}
        self.drafts = {}
        if not seqs:
            return
        decoding = torch.tensor([s.num_computed == s.length - 1 for s in seqs])
        x, mstep = self._run(streams[torch.tensor(rows)], tokens, seqs, spans)
        at = mstep.logits_at[decoding]
        if at.numel() == 0:
            return
        drafting = [s for s, d in zip(seqs, decoding.tolist()) if d]
        out = [[] for _ in drafting]
        x, last = x[at], mstep.positions[at]
        for i in range(k):
            token = self.model.logits(x, self.layer).argmax(-1)
            for o, t in zip(out, token.tolist()):
                o.append(t)
            if i + 1 < k:
                x, _ = self._run(x, token.tolist(), drafting, [(int(p) + 1 + i, 1) for p in last])
        self.drafts = {id(s): o for s, o in zip(drafting, out)}

    def _run(self, streams: torch.Tensor, next_tokens: list[int], seqs: list[Sequence],
             spans: list[tuple[int, int]]) -> tuple[torch.Tensor, StepInput]:
        """The layer over each sequence's span (first position, count) of rows."""
        t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        starts, lengths = t([s for s, _ in spans]), t([n for _, n in spans])
        q_seq = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
        ends = torch.cumsum(lengths, 0)
        positions = starts[q_seq] + torch.arange(q_seq.shape[0]) - (ends - lengths)[q_seq]
        ring_from = t([max(s.ring_from, self.first.get(id(s), 0)) for s in seqs])
        dev = streams.device
        step = StepInput(tokens=t(next_tokens).to(dev), positions=positions.to(dev), q_seq=q_seq.to(dev),
                         starts=starts.to(dev), lengths=lengths.to(dev), slots=t([s.slot for s in seqs]).to(dev),
                         block_table=torch.zeros(len(seqs), 1, dtype=torch.int32, device=dev),
                         ring_from=ring_from.to(dev), keep_tokens=torch.zeros_like(starts).to(dev),
                         logits_at=(ends - 1).to(dev))
        m = self.model
        return self.layer.predict(streams, step.tokens, m.embed, step, self.cache, m.ropes, m.ops), step
