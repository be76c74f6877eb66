"""The checkpoint's MTP layer as the speculative-decoding draft.

After every engine step the layer runs over the positions the step computed (the main
model's last streams there, and the token that followed each), keeping its own SWA ring per
state slot, then chains itself from each decoding sequence's last position: draft 1 comes
from the main streams and the sampled token, draft i + 1 from the layer's own streams and
draft i. Drafts only change speed, never output, so the layer's ring may be stale where it
never ran (before a restored prefix): those rows are masked like the main model's.

The layer's first pass reuses the main step as it is (its index tensors, its decode path)
when no sequence has more than one row past what it kept (one rejected draft at most): that
row gets a placeholder next token and writes the layer's ring at the sequence's next
position, which the next step's pass rewrites before any query reads it. Otherwise (two or
more rejected rows would overwrite ring rows still in the window) the pass runs over the
kept rows only. Either way every row's K=V goes to the layer's ring, but the rest of the layer
(attention output, MoE, mHC mixing) runs only for the rows a draft comes from: one per drafting
sequence.
"""
from __future__ import annotations

import dataclasses

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
        seqs, spans, decoding, kept, index = [], [], [], [], []
        for b, (seq, _) in enumerate(batch):
            live = not (seq.status == Status.FINISHED or seq.finish_reason or seq.slot is None)
            kept.append(seq.num_computed - starts[b] if live else 0)
            if live:
                seqs.append(seq)
                spans.append((starts[b], kept[-1]))
                decoding.append(seq.num_computed == seq.length - 1)
                index.append(b)
        self.first = {id(s): self.first.get(id(s), start) for s, (start, _) in zip(seqs, spans)}
        self.drafts = {}
        if not seqs:
            return
        lengths = step.lengths.tolist()
        if all(n - m <= 1 for n, m in zip(lengths, kept)):
            drafting_rows = {b for b, d in zip(index, decoding) if d}
            x = self._whole_step(batch, starts, step, streams, kept, lengths, drafting_rows)
        else:
            x = self._kept_rows(step, streams, seqs, spans, index, decoding)
        if not any(decoding):
            return
        drafting = [s for s, d in zip(seqs, decoding) if d]
        last = step.positions.new_tensor([s.num_computed - 1 for s in drafting])
        out = [[] for _ in drafting]
        for i in range(k):
            token = self.model.logits(x, self.layer).argmax(-1).tolist()
            for o, t in zip(out, token):
                o.append(t)
            if i + 1 < k:
                x = self._run(x, token, drafting, [(int(p) + 1 + i, 1) for p in last])
        self.drafts = {id(s): o for s, o in zip(drafting, out)}

    def _whole_step(self, batch, starts: list[int], step: StepInput, streams: torch.Tensor, kept: list[int],
                    lengths: list[int], decoding: set[int]) -> torch.Tensor:
        """The layer over every row of the main step (of sequence b's `lengths[b]` rows, `kept[b]`
        hold their next token, the others a placeholder); returns its streams at the `decoding`
        sequences' last kept positions, in batch order (past the attention's K=V, only those rows
        run). Where the layer ran from the ring's first valid row on (no restored prefix), its
        window indices are the step's."""
        tokens, ring_from, at = [], [], []
        for b, ((seq, _), row, n) in enumerate(zip(batch, step.cu.tolist(), lengths)):
            nxt = seq.token_slice(starts[b] + 1, starts[b] + kept[b] + 1)
            tokens += nxt + [0] * (n - len(nxt))
            ring_from.append(max(seq.ring_from, self.first.get(id(seq), starts[b])))
            if b in decoding:
                at.append(row + kept[b] - 1)
        new = step.tokens.new_tensor
        same = ring_from == [seq.ring_from for seq, _ in batch]
        mstep = dataclasses.replace(step, tokens=new(tokens), ring_from=step.ring_from if same else new(ring_from),
                                    logits_at=new(at))
        if same:
            mstep.rings.update(step.rings)
        return self._predict(streams, mstep, mstep.logits_at)

    def _kept_rows(self, step: StepInput, streams: torch.Tensor, seqs: list[Sequence],
                   spans: list[tuple[int, int]], index: list[int], decoding: list[bool]) -> torch.Tensor:
        """The layer over the rows each sequence kept (its span: first position, count; its
        batch index); returns its streams at the last kept row of each `decoding` sequence."""
        rows, tokens, cu = [], [], step.cu.tolist()
        for seq, (start, n), b in zip(seqs, spans, index):
            rows += range(cu[b], cu[b] + n)
            tokens += seq.token_slice(start + 1, start + n + 1)
        mstep = self._step(tokens, seqs, spans, streams.device)
        return self._predict(streams[torch.tensor(rows, dtype=torch.long)], mstep,
                             mstep.logits_at[torch.tensor(decoding, dtype=torch.bool)])

    def _run(self, streams: torch.Tensor, next_tokens: list[int], seqs: list[Sequence],
             spans: list[tuple[int, int]]) -> torch.Tensor:
        """The layer over each sequence's span (first position, count) of rows."""
        return self._predict(streams, self._step(next_tokens, seqs, spans, streams.device), None)

    def _predict(self, streams: torch.Tensor, step: StepInput, rows: torch.Tensor | None) -> torch.Tensor:
        """The layer's streams at `rows` of `step` (None: every row). The ring is written at every
        row; past that only `rows` run, unless it is a decode step or no row is asked for."""
        m = self.model
        only = rows is not None and rows.numel() > 0 and not step.decode
        x = self.layer.predict(streams, step.tokens, m.embed, step, self.cache, m.ropes, m.ops, rows if only else None)
        return x if only or rows is None else x[rows]

    def _step(self, next_tokens: list[int], seqs: list[Sequence], spans: list[tuple[int, int]],
              dev: torch.device) -> StepInput:
        """The layer's own step over each sequence's span (first position, count) of rows."""
        t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        starts, lengths = t([s for s, _ in spans]), t([n for _, n in spans])
        q_seq = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
        ends = torch.cumsum(lengths, 0)
        positions = starts[q_seq] + torch.arange(q_seq.shape[0]) - (ends - lengths)[q_seq]
        ring_from = t([max(s.ring_from, self.first.get(id(s), 0)) for s in seqs])
        return StepInput(tokens=t(next_tokens).to(dev), positions=positions.to(dev), q_seq=q_seq.to(dev),
                         starts=starts.to(dev), lengths=lengths.to(dev), slots=t([s.slot for s in seqs]).to(dev),
                         block_table=torch.zeros(len(seqs), 1, dtype=torch.int32, device=dev),
                         ring_from=ring_from.to(dev), keep_tokens=torch.zeros_like(starts).to(dev),
                         logits_at=(ends - 1).to(dev))
