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

Two halves, so that every rank of a parallel engine runs the same passes: `MTPDrafter` (the
engine's rank) turns the step's sequences into a `DraftPlan` of plain lists; `MTPPasses` runs
a plan on one rank's model shard and ring. Under tensor parallelism rank 0 sends the plan to
the other ranks first (`share`), which run it on their shard (the layer is split like the main
model; its logits are gathered, so every rank picks the same draft tokens). Under data-parallel
attention each rank plans for its own sequences, and every pass's MoE goes through the expert
exchange: a rank makes exactly k passes whenever any rank stepped (`MTPPasses.idle` stands in
for a pass it has nothing for), so the exchanges stay in lockstep.

Prefill / decode: a held request (prefilled, waiting for its handoff) is planned like a decoding
one, so its last prefill step writes the layer's ring with the sampled first token and drafts
the next tokens, exactly as a colocated run's would. That state (`MTPHandoff`: the slot's ring,
its first valid position, the drafts) goes with the handoff; the decode engine `adopt`s it: the
drafts are verified in its first step and the ring is written into the request's slot by the
first plan that runs (`DraftPlan.adopt`, so that every tensor-parallel rank writes it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from kvmesh.kvstore.device.cache_tensors import LayerCache
from kvmesh.kvstore.device.layout import SWASpec
from kvmesh.workers.model.step import StepInput
from kvmesh.workers.model.transformer import Transformer
from kvmesh.workers.request import MTPHandoff, Sequence, Status

from .speculative import Drafter


@dataclass(frozen=True)
class DraftPlan:
    """One step's MTP passes. The first runs over the main step with `tokens` as each row's next
    token (`own` None; `ring_from` where it differs from the step's) or over the kept rows `rows`
    of the main streams (`own`: the layer's step over them); drafts come from its rows `at`, one
    per drafting sequence (last kept position `last`, state slot `slots`, first valid ring row
    `chain_from`), then k - 1 chained one-row passes."""
    k: int
    at: list[int]
    last: list[int]
    slots: list[int]
    chain_from: list[int]
    tokens: list[int] | None = None
    ring_from: list[int] | None = None
    own: StepInput | None = None
    rows: list[int] | None = None
    adopt: tuple[tuple[int, torch.Tensor], ...] = ()    # (slot, ring) handed off: written before the passes


class MTPPasses:
    """The MTP layer on one rank: its window ring (one row set per state slot) and the passes
    of a DraftPlan."""

    def __init__(self, model: Transformer, num_slots: int):
        self.model, self.layer = model, model.mtp[0]
        a, w = model.args, model.embed.weight
        ring_only = SWASpec(block_tokens=0, head_dim=a.head_dim, window=a.sliding_window,
                            dtype=str(w.dtype).removeprefix("torch."))
        self.cache = LayerCache(ring_only, num_blocks=0, num_slots=num_slots, device=w.device)

    @torch.inference_mode()
    def run(self, plan: DraftPlan, step: StepInput, streams: torch.Tensor) -> list[list[int]]:
        """The drafts of each drafting sequence of `plan` (main `step` and its last streams)."""
        t = lambda v: torch.tensor(v, dtype=torch.long, device=streams.device)  # noqa: E731
        for slot, ring in plan.adopt:
            self.cache.ring[slot] = ring.to(self.cache.ring.device, self.cache.ring.dtype)
        if plan.own is None:
            same = plan.ring_from is None
            mstep = dataclasses.replace(step, tokens=t(plan.tokens), logits_at=t(plan.at),
                                        ring_from=step.ring_from if same else t(plan.ring_from))
            if same:
                mstep.rings.update(step.rings)
            x = self._predict(streams, mstep, mstep.logits_at)
        else:
            x = self._predict(streams[t(plan.rows)], plan.own.to(streams.device), t(plan.at))
        out = [[] for _ in plan.last]
        for i in range(plan.k):
            if not plan.last:
                self.idle(plan.k - i - 1)
                break
            token = self.model.logits(x, self.layer).argmax(-1).tolist()
            for o, tok in zip(out, token):
                o.append(tok)
            if i + 1 < plan.k:
                x = self._predict(x, own_step(token, [p + 1 + i for p in plan.last], [1] * len(token), plan.slots,
                                              plan.chain_from, x.device), None)
        return out

    @torch.inference_mode()
    def idle(self, passes: int) -> None:
        """Data-parallel attention: `passes` MTP passes this rank has nothing for still join the
        layer's expert exchange (nothing to do otherwise)."""
        ffn, w = self.layer.ffn, self.model.embed.weight
        if ffn.shard.dp_size > 1:
            for _ in range(passes):
                ffn.idle(w.dtype, w.device)

    def _predict(self, streams: torch.Tensor, step: StepInput, rows: torch.Tensor | None) -> torch.Tensor:
        """The layer's streams at `rows` of `step` (None: every row). The ring is written at every
        row; past that only `rows` run, unless it is a decode step or no row is asked for."""
        m = self.model
        only = rows is not None and rows.numel() > 0 and not step.decode
        x = self.layer.predict(streams, step.tokens, m.embed, step, self.cache, m.ropes, m.ops, rows if only else None)
        return x if only or rows is None else x[rows]


def own_step(next_tokens: list[int], starts: list[int], lengths: list[int], slots: list[int], ring_from: list[int],
             dev: torch.device | str = "cpu") -> StepInput:
    """The layer's own step over each sequence's rows [start, start + length) (state slot, first
    valid ring row), the last row of each returning logits."""
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    starts, lengths = t(starts), t(lengths)
    q_seq = torch.repeat_interleave(torch.arange(len(slots)), lengths)
    ends = torch.cumsum(lengths, 0)
    positions = starts[q_seq] + torch.arange(q_seq.shape[0]) - (ends - lengths)[q_seq]
    return StepInput(tokens=t(next_tokens).to(dev), positions=positions.to(dev), q_seq=q_seq.to(dev),
                     starts=starts.to(dev), lengths=lengths.to(dev), slots=t(slots).to(dev),
                     block_table=torch.zeros(len(slots), 1, dtype=torch.int32, device=dev),
                     ring_from=t(ring_from).to(dev), keep_tokens=torch.zeros_like(starts).to(dev),
                     logits_at=(ends - 1).to(dev))


class MTPDrafter(Drafter):
    """Plans each step's passes from the sequences and keeps their drafts for the next step.
    `share(plan)`: tensor parallelism, sends the plan to the other ranks before this one runs it;
    `share_idle(k)`: a TP group inside a DP rank, sends k passes with nothing to draft (its ranks
    join the expert exchanges with this one)."""
    wants_streams = True

    def __init__(self, model: Transformer, num_slots: int, share: Callable[[DraftPlan], None] | None = None,
                 share_idle: Callable[[int], None] | None = None):
        self.passes, self.share, self.share_idle = MTPPasses(model, num_slots), share, share_idle
        self.drafts: dict[int, list[int]] = {}   # id(seq) -> its drafts for the next step
        self.first: dict[int, int] = {}          # id(seq) -> first position the layer ran on
        self.adopted: list[tuple[int, torch.Tensor]] = []   # handed-off (slot, ring)s for the next plan

    @property
    def cache(self) -> LayerCache:
        return self.passes.cache

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.drafts.get(id(seq), [])[:k]

    def adopt(self, seq: Sequence, state: MTPHandoff) -> None:
        """Decode role: `seq` (just admitted, in this step's batch) continues from the prefill
        engine's MTP state: its drafts for this step, its ring from the next pass on."""
        self.drafts[id(seq)] = list(state.drafts)
        self.first[id(seq)] = state.ring_from
        self.adopted.append((seq.slot, state.ring))

    def observe(self, batch: list[tuple[Sequence, int]], starts: list[int], step: StepInput,
                streams: torch.Tensor, k: int) -> None:
        self.drafts = {}
        adopted, self.adopted = tuple(self.adopted), []
        if k == 0:                   # no drafts for the next step: no pass, and the ring is stale from here
            self.first = {}
            return
        plan, drafting = self.plan(batch, starts, step, k)
        if plan is None:
            self.idle(k)
            return
        plan = dataclasses.replace(plan, adopt=adopted)
        if self.share is not None:
            self.share(plan)
        self.drafts = {id(s): o for s, o in zip(drafting, self.passes.run(plan, step, streams))}
        for s in drafting:
            if s.status == Status.HELD:      # prefill role: what decode's first step drafts from
                s.mtp_handoff = MTPHandoff(self.cache.ring[s.slot].to("cpu", copy=True), self._ring_from(s, 0),
                                           tuple(self.drafts[id(s)]))

    def idle(self, k: int) -> None:
        """This rank stepped nothing while another did (data-parallel attention)."""
        if self.share_idle is not None:
            self.share_idle(k)
        self.passes.idle(k)

    def plan(self, batch: list[tuple[Sequence, int]], starts: list[int], step: StepInput, k: int
             ) -> tuple[DraftPlan | None, list[Sequence]]:
        """The step's passes (None: no sequence is left to run them for) and the drafting sequences."""
        seqs, spans, decoding, kept, index = [], [], [], [], []
        for b, (seq, _) in enumerate(batch):
            live = seq.slot is not None and (seq.status == Status.HELD or not (seq.status == Status.FINISHED
                                                                                or seq.finish_reason))
            kept.append(seq.num_computed - starts[b] if live else 0)
            if live:
                seqs.append(seq)
                spans.append((starts[b], kept[-1]))
                decoding.append(seq.num_computed == seq.length - 1)
                index.append(b)
        self.first = {id(s): self.first.get(id(s), start) for s, (start, _) in zip(seqs, spans)}
        if not seqs:
            return None, []
        drafting = [s for s, d in zip(seqs, decoding) if d]
        chain = dict(k=k, last=[s.num_computed - 1 for s in drafting], slots=[s.slot for s in drafting],
                     chain_from=[self._ring_from(s, 0) for s in drafting])
        lengths = step.lengths.tolist()
        if all(n - m <= 1 for n, m in zip(lengths, kept)):
            drafting_rows = {b for b, d in zip(index, decoding) if d}
            return DraftPlan(**chain, **self._whole_step(batch, starts, step, kept, lengths, drafting_rows)), drafting
        return DraftPlan(**chain, **self._kept_rows(step, seqs, spans, index, decoding)), drafting

    def _ring_from(self, seq: Sequence, default: int) -> int:
        return max(seq.ring_from, self.first.get(id(seq), default))

    def _whole_step(self, batch, starts: list[int], step: StepInput, kept: list[int], lengths: list[int],
                    decoding: set[int]) -> dict:
        """The layer over every row of the main step (of sequence b's `lengths[b]` rows, `kept[b]`
        hold their next token, the others a placeholder), drafting from the `decoding` sequences'
        last kept positions, in batch order (past the attention's K=V, only those rows run).
        Where the layer ran from the ring's first valid row on (no restored prefix), its window
        indices are the step's."""
        tokens, ring_from, at = [], [], []
        for b, ((seq, _), row, n) in enumerate(zip(batch, step.cu.tolist(), lengths)):
            nxt = seq.token_slice(starts[b] + 1, starts[b] + kept[b] + 1)
            tokens += nxt + [0] * (n - len(nxt))
            ring_from.append(self._ring_from(seq, starts[b]))
            if b in decoding:
                at.append(row + kept[b] - 1)
        same = ring_from == [seq.ring_from for seq, _ in batch]
        return dict(tokens=tokens, at=at, ring_from=None if same else ring_from)

    def _kept_rows(self, step: StepInput, seqs: list[Sequence], spans: list[tuple[int, int]], index: list[int],
                   decoding: list[bool]) -> dict:
        """The layer over the rows each sequence kept (its span: first position, count; its
        batch index), drafting from the last kept row of each `decoding` sequence."""
        rows, tokens, cu = [], [], step.cu.tolist()
        for seq, (start, n), b in zip(seqs, spans, index):
            rows += range(cu[b], cu[b] + n)
            tokens += seq.token_slice(start + 1, start + n + 1)
        own = own_step(tokens, [s for s, _ in spans], [n for _, n in spans], [s.slot for s in seqs],
                       [self._ring_from(s, 0) for s in seqs])
        at = own.logits_at[torch.tensor(decoding, dtype=torch.bool)].tolist()
        return dict(own=own, rows=rows, at=at)
