"""One forward step over a ragged batch, and the index tensors every layer shares.

The runner builds a `StepInput`; the model derives from it, once per step, the index
tensors its layers use (`cu`, per compression ratio a `WindowPlan`, per SWA window a
`RingWindow`), so no layer loops over sequences and no layer rebuilds what another built: a
layer's work is a fixed number of tensor ops whatever the batch size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass
class StepInput:
    """One forward step over a ragged batch (built by the model runner)."""
    tokens: torch.Tensor        # [T] int64
    positions: torch.Tensor     # [T] int64 absolute positions
    q_seq: torch.Tensor         # [T] int64 sequence index of each token
    starts: torch.Tensor        # [B] int64 first position of each sequence's chunk
    lengths: torch.Tensor       # [B] int64 tokens of each sequence in this step
    slots: torch.Tensor         # [B] int64 state slot of each sequence
    block_table: torch.Tensor   # [B, MB] int32 classical-cache blocks (entry e -> e // EPB)
    ring_from: torch.Tensor     # [B] int64 window rows before this position are invalid (recompute)
    keep_tokens: torch.Tensor   # [B] int64 compressed entries of windows ending <= this are restored: keep
    logits_at: torch.Tensor     # [R] int64 rows of T whose logits are returned
    # Host-known facts the runner passes so the forward never reads a tensor back (no
    # .item() / data-dependent shapes: what a CUDA graph needs). None = derive them on device.
    max_len: int | None = None  # >= max(lengths)
    max_end: int | None = None  # >= max(starts + lengths): bounds every sequence's entry count
    decode: bool = False        # every sequence has one token, past what was restored (keep_tokens):
                                # unmasked ring writes
    fresh: bool = False         # every row lies past what was restored (keep_tokens; a decode step's do):
                                # block writes and compressor entries need no mask
    fixed_shapes: bool = False  # (decode only) every op's shape follows from B alone, whatever the
                                # data: window plans of one row per sequence (WindowPlan.build_decode)
    cu: torch.Tensor = field(init=False)        # [B + 1] row offsets of each sequence in T
    plans: dict[int, "WindowPlan"] = field(init=False, default_factory=dict)
    rings: dict[int, "RingWindow"] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.fixed_shapes and not self.decode:
            raise ValueError("fixed_shapes needs a decode step (one token per sequence)")
        self.fresh = self.fresh or self.decode
        self.cu = torch.nn.functional.pad(torch.cumsum(self.lengths, 0), (1, 0))

    def to(self, device: str | torch.device) -> "StepInput":
        """The same step with every input tensor on `device` (derived ones rebuilt there)."""
        def moved(v):
            return v.to(device) if isinstance(v, torch.Tensor) else v
        return StepInput(**{f.name: moved(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init})

    def clear_derived(self) -> None:
        """Forget the plans and ring windows (a replayed step's tensors are rewritten in place)."""
        self.plans.clear()
        self.rings.clear()

    def ring_window(self, window: int) -> "RingWindow":
        """Where each sequence's SWA window rows come from (built on first use, shared by layers)."""
        if window not in self.rings:
            self.rings[window] = RingWindow.build(self, window)
        return self.rings[window]

    def windows(self, ratio: int) -> "WindowPlan":
        """The compressor windows of this step at `ratio` (built on first use, shared by layers)."""
        if ratio not in self.plans:
            self.plans[ratio] = (WindowPlan.build_decode if self.fixed_shapes else WindowPlan.build)(self, ratio)
        return self.plans[ratio]

    @property
    def longest(self) -> int:
        """max(lengths), from the host when the runner gave it."""
        return self.max_len if self.max_len is not None else int(self.lengths.max())

    def entry_bound(self, ratio: int) -> int | None:
        """A host-known bound on any sequence's number of entries at `ratio` (None: not given)."""
        return None if self.max_end is None else self.max_end // ratio


class RingWindow(NamedTuple):
    """Each sequence's SWA window as `| ring rows for [start-W+1, start) | this step's rows |`:
    `ring_rows` [B, W-1] flattened ring rows (slot * W + position % W) and `step_rows` [B, n_max]
    rows of the step (clamped), with `positions` [B, W-1+n_max] (-1: empty or masked); query t
    sees rows `query_rows[t]` [T, W] of its sequence's window, those with `query_valid[t]` (what
    the kernels' window_rows derives, built here once for every layer). A decode step writes its
    token to the ring first and reads all W rows from there: `ring_rows` [B, W], `step_rows` and
    the query rows None (each query sees its sequence's whole window)."""
    ring_rows: torch.Tensor
    step_rows: torch.Tensor | None
    positions: torch.Tensor
    query_rows: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None

    @classmethod
    def build(cls, step: StepInput, w: int) -> "RingWindow":
        starts, slots, ring_from = step.starts.unsqueeze(1), step.slots.unsqueeze(1), step.ring_from.unsqueeze(1)
        span = w if step.decode else w - 1
        pos = starts - (w - 1) + torch.arange(span, device=starts.device)
        ring_rows, pos = slots * w + pos % w, torch.where(pos >= ring_from, pos, -1)
        if step.decode:
            return cls(ring_rows, None, pos)
        j = torch.arange(step.longest, device=starts.device)
        step_rows = (step.cu[:-1].unsqueeze(1) + j).clamp(max=step.tokens.shape[0] - 1)
        new_pos = torch.where(j < step.lengths.unsqueeze(1), starts + j, -1)
        positions = torch.cat([pos, new_pos], 1)
        # the row of position q - W + 1 + i is (q - start) + i: the window's rows are consecutive
        query_rows = (step.positions - step.starts[step.q_seq]).unsqueeze(1) + torch.arange(w, device=pos.device)
        valid = positions[step.q_seq.unsqueeze(1), query_rows] >= 0
        return cls(ring_rows, step_rows, positions, query_rows, valid)


@dataclass
class WindowPlan:
    """Where each window that closes in this step takes its m rows, and what goes to the tails.

    Window i (of N, grouped by sequence in batch order) belongs to sequence `seq[i]`, has
    index `index[i]` (it covers positions [index*m, (index+1)*m)), and its row r is
    `step rows[src[i, r]]` when `from_step[i, r]`, else tail row `src[i, r]` of the flattened
    [S*m] tails (positions before the step's start). Rows `tail_rows` of the step (those in
    their sequence's last window, closed or not) are written to tail rows `tail_dst`: a closed
    window's tail is never read again, unless a rejected speculative draft closed it, and then
    the real rows before the draft must be there."""
    seq: torch.Tensor           # [N] sequence (batch index) of each closed window
    index: torch.Tensor         # [N] window index within its sequence
    step_src: torch.Tensor      # [N, m] step row of each window row (0 where not from the step)
    tail_src: torch.Tensor      # [N, m] flattened tail row (slot * m + r) of each window row
    from_step: torch.Tensor     # [N, m] bool: the row comes from the step, else from the tail
    first: torch.Tensor         # [N] bool: first closed window of its sequence in this step
    last: torch.Tensor          # [N] bool: last closed window of its sequence in this step
    keep: torch.Tensor          # [N] bool: not restored from a stored block (write its entry)
    tail_rows: torch.Tensor     # [U] step rows that stay in the tail
    tail_dst: torch.Tensor      # [U] their flattened tail rows (slot * m + position % m)
    closes: torch.Tensor | None = None   # decode plans only: [N] bool, the window really closes

    @property
    def padded(self) -> bool:
        """A decode plan: one row per sequence whether or not its window closes (fixed shapes)."""
        return self.closes is not None

    @property
    def count(self) -> int:
        return self.seq.shape[0]

    def gather(self, x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The closed windows' rows [N, m, W] from this step's rows x [T, W] and tail [S, m, W]."""
        flat, w = tail.view(-1, tail.shape[-1]), tail.shape[-1]
        steps = x.index_select(0, self.step_src.reshape(-1)).view(*self.step_src.shape, w)
        tails = flat.index_select(0, self.tail_src.reshape(-1)).view(*self.tail_src.shape, w)
        return torch.where(self.from_step.unsqueeze(-1), steps, tails)

    def write_tail(self, x: torch.Tensor, tail: torch.Tensor) -> None:
        """Keep the step rows after each sequence's last closed window in its tail."""
        tail.view(-1, tail.shape[-1])[self.tail_dst] = x[self.tail_rows]

    @classmethod
    def build(cls, step: StepInput, m: int) -> "WindowPlan":
        starts, ends = step.starts, step.starts + step.lengths
        first_w, closed = starts // m, ends // m - starts // m
        seq = torch.repeat_interleave(torch.arange(starts.shape[0], device=starts.device), closed)
        offset = torch.arange(seq.shape[0], device=seq.device) - (torch.cumsum(closed, 0) - closed)[seq]
        index = first_w[seq] + offset
        pos = index.unsqueeze(1) * m + torch.arange(m, device=seq.device)          # [N, m]
        from_step = pos >= starts[seq].unsqueeze(1)
        step_src = torch.where(from_step, step.cu[seq].unsqueeze(1) + pos - starts[seq].unsqueeze(1), 0)
        tail_src = step.slots[seq].unsqueeze(1) * m + pos % m
        first, last = offset == 0, offset == closed[seq] - 1
        keep = (index + 1) * m > step.keep_tokens[seq]
        stays = step.positions >= ((ends - 1) // m * m)[step.q_seq]      # the last window, closed or not
        tail_rows = torch.nonzero(stays).squeeze(1)
        tail_dst = step.slots[step.q_seq[tail_rows]] * m + step.positions[tail_rows] % m
        return cls(seq, index, step_src, tail_src, from_step, first, last, keep, tail_rows, tail_dst)

    @classmethod
    def build_decode(cls, step: StepInput, m: int) -> "WindowPlan":
        """A decode step (one token per sequence, T = B) as fixed-shape tensors: row b is
        sequence b's current window `position // m`, which closes iff the token is its last
        row (`closes`). Every row is pooled; only closing rows' results are kept (the caller
        writes a row's entry to its own not-yet-visible slot, or keeps the old overlap state,
        where it does not close). Every token also goes to its tail row: a closed window's
        tail is never read again. Restored entries lie before the token (keep_tokens <=
        position), so every closing window is written."""
        pos, b = step.positions, step.q_seq
        index = pos // m
        rows = index.unsqueeze(1) * m + torch.arange(m, device=pos.device)            # [B, m]
        from_step = rows == pos.unsqueeze(1)
        closes = (pos + 1) % m == 0
        step_src = torch.where(from_step, b.unsqueeze(1), 0)
        tail_src = step.slots.unsqueeze(1) * m + rows % m
        tail_dst = step.slots * m + pos % m
        first = torch.ones_like(closes)          # every row is its sequence's only window here
        return cls(b, index, step_src, tail_src, from_step, first, closes, closes, b, tail_dst, closes)
