"""Speculative decoding: a draft proposes k tokens, one target step verifies them.

A decoding sequence's step runs | its real token(s) | d1 .. dk | and returns the logits of
the last real row and of every draft row. Row i's token is sampled as usual; while it
equals d(i+1) the draft is accepted and sampling continues on the next row, so greedy
output is exactly the non-speculative output, and under temperature > 0 this is the
rejection-sampling rule for a deterministic draft (accept d with probability p(d), else
a token from p without d); each emitted token is one draw, in the same order as without
drafts, so a seeded request gives the same tokens with or without speculation.

Rollback is exact and cheap because drafts are placed where rejecting them only leaves
rows that are never read, or state saved before the step: a step's drafts stay inside the
compressor window (of every ratio) of their first position, never end or cross a block, and
real + draft tokens fit one SWA window. A rejected draft then changes, of what is read later:
its window-ring row, unless it is the first rejected one (a draft at position p overwrites
the row of p - W; the next step's first real token is at the first rejected position, and no
later window reaches back before it), restored from a copy taken before the step, so k = 1
copies no ring row; and, when it closes a window, the overlap state of CSA compressors (the Ca
half a window hands to the next; restored from a copy taken when some draft of the step closes
a window). The entry a rejected draft wrote for the window it closed is invisible until a real
token closes that window and rewrites it; compressor tail rows past the accepted position are
overwritten before they are read (the step's last window always goes to the tail, closed or
not); paged SWA rows of the `full` policy are rewritten before their block is hashed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.workers.request import Sequence
from kvmesh.workers.spec.draft_rule import DraftRule


class Drafter(ABC):
    """Proposes up to k next tokens for a sequence (its tokens so far: prompt + output).
    A drafter that `wants_streams` is shown every step after its tokens are settled:
    `observe(batch, starts, step, streams, k)` with each sequence's num_computed before the
    step and the main model's last-layer streams of every row."""
    wants_streams = False

    @abstractmethod
    def propose(self, seq: Sequence, k: int) -> list[int]:
        ...

    def observe(self, batch, starts: list[int], step, streams: torch.Tensor, k: int) -> None:
        """Called after each step when wants_streams (a model-based draft runs here)."""

    def idle(self, k: int) -> None:
        """Data-parallel attention: called instead of `observe` when this rank stepped nothing while
        another did (a model-based draft joins the other ranks' collectives here)."""

    def adopt(self, seq: Sequence, state) -> None:
        """Decode role: `seq` was just admitted from a handoff that carries the prefill engine's
        draft state (workers.request.MTPHandoff); a drafter without such state ignores it."""


class OracleDrafter(Drafter):
    """Proposes the continuation it was given for a prompt (e.g. a previous greedy run):
    what an ideal draft would say. Used to measure the speed-up when drafts are accepted
    (the tiny models' MTP layers are random) and, with wrong tokens mixed in, to test rollback."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, seq: Sequence, k: int) -> list[int]:
        cont = self.continuations.get(tuple(seq.prompt), [])
        return cont[len(seq.output):len(seq.output) + k]


@dataclass(frozen=True)
class DraftLimits:
    """Where drafts may go: every draft lies in the window of each `ratio` that holds the first
    one (the last may close it), no draft ends or crosses a block, and the step's tokens fit
    the SWA `window`."""
    ratios: tuple[int, ...]
    block_tokens: int
    window: int

    def max_drafts(self, computed: int, n_real: int, k: int) -> int:
        """Drafts allowed after `computed + n_real` tokens (real ones of this step included)."""
        c = computed + n_real
        if c % self.block_tokens == 0:        # the real token ends a block: let the step end there
            return 0
        room = min([m - c % m for m in self.ratios] + [self.block_tokens - c % self.block_tokens - 1])
        return max(0, min(k, room, self.window - n_real))


class DraftState:
    """What one step's drafts overwrite that a later step may read, saved before the step: the
    window-ring rows of the drafts after each sequence's first (`rows`: (batch index, draft
    index, slot, position)) and, for the sequences whose drafts close a window of an overlapping
    compressor (`closing`: batch index -> (slot, index of that draft)), the slots' overlap state."""

    def __init__(self, cache: CacheTensors, rows: list[tuple[int, int, int, int]],
                 closing: dict[int, tuple[int, int]]):
        self.cache, self.closing, self.owners = cache, closing, [(b, i) for b, i, _, _ in rows]
        if rows:
            window = cache.layout.params.window
            self.slots = torch.tensor([slot for _, _, slot, _ in rows], dtype=torch.long)
            self.rows = torch.tensor([p % window for _, _, _, p in rows], dtype=torch.long)
            self.ring = cache.ring_rows(self.slots, self.rows)
        self.overlap_slots = torch.tensor([slot for slot, _ in closing.values()], dtype=torch.long) if closing else None
        self.overlap = cache.overlap_rows(self.overlap_slots) if closing else []

    def restore(self, accepted: dict[int, int]) -> None:
        """Put back the saved ring rows of the drafts after each sequence's first rejected one,
        and the overlap state of each sequence whose closing draft was rejected (`accepted`: batch
        index -> accepted drafts). Nothing is written when every draft was accepted."""
        later = [i > accepted.get(b, 0) for b, i in self.owners]
        if any(later):
            rejected = torch.tensor(later, dtype=torch.bool)
            self.cache.write_ring_rows(self.slots[rejected], self.rows[rejected],
                                       [saved[rejected] for saved in self.ring])
        undo = [accepted.get(b, 0) <= i for b, (_, i) in self.closing.items()]
        if any(undo):
            undo = torch.tensor(undo, dtype=torch.bool)
            self.cache.write_overlap_rows(self.overlap_slots[undo], [saved[undo] for saved in self.overlap])


class Speculator:
    """Chooses each decoding sequence's drafts (at most `rule.k`; a model draft makes as many as
    the rule gives the batch it ran after), and after the step keeps the accepted ones' state and
    rolls the rejected ones back. The engine samples (`accept` tells it how)."""

    def __init__(self, drafter: Drafter, rule: DraftRule, limits: DraftLimits, cache: CacheTensors):
        self.drafter, self.rule, self.k, self.limits, self.cache = drafter, rule, rule.k, limits, cache
        self.overlap_ratios = cache.overlap_ratios()

    def propose(self, batch: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """batch index -> draft tokens, for sequences whose step ends at their last token."""
        out = {}
        for b, (seq, n) in enumerate(batch):
            if not seq.output or seq.hold_kv or seq.num_computed + n != seq.length:
                continue
            k = self.limits.max_drafts(seq.num_computed, n, min(self.k, seq.params.max_tokens - len(seq.output) - 1))
            draft = self.drafter.propose(seq, k)[:k] if k > 0 else []
            if draft:
                out[b] = list(draft)
        return out

    def save(self, batch: list[tuple[Sequence, int]], drafts: dict[int, list[int]]) -> DraftState:
        rows, closing = [], {}
        for b, draft in drafts.items():
            seq, n = batch[b]
            first = seq.num_computed + n
            rows += [(b, i, seq.slot, first + i) for i in range(1, len(draft))]
            closes = [m - 1 - first % m for m in self.overlap_ratios if m - 1 - first % m < len(draft)]
            if closes:
                closing[b] = (seq.slot, min(closes))
        return DraftState(self.cache, rows, closing)

    def settle(self, batch: list[tuple[Sequence, int]], drafts: dict[int, list[int]], accepted: dict[int, int],
               saved: DraftState) -> None:
        """Count the accepted drafts as computed (num_computed already includes the real
        tokens) and restore what the rejected ones overwrote."""
        for b in drafts:
            batch[b][0].num_computed += accepted.get(b, 0)
        saved.restore(accepted)

    @staticmethod
    def accept(rows: torch.Tensor, draft: list[int], sample_next) -> int:
        """Sample row i (`sample_next(logits) -> token or None when the sequence finished`)
        while the token equals draft[i]; returns how many drafts were accepted."""
        for i in range(len(draft) + 1):
            token = sample_next(rows[i])
            if token is None or i == len(draft) or token != draft[i]:
                return i
        return len(draft)
