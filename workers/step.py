"""One forward step over a ragged batch, and the index tensors every layer shares.

The runner builds a `StepInput`; the model derives from it, once per step, the index
tensors its layers use (`cu`, and per compression ratio a `WindowPlan`), so no layer loops
over sequences: a layer's work is a fixed number of tensor ops whatever the batch size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    cu: torch.Tensor = field(init=False)        # [B + 1] row offsets of each sequence in T
    plans: dict[int, "WindowPlan"] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.cu = torch.nn.functional.pad(torch.cumsum(self.lengths, 0), (1, 0))

    def to(self, device: str | torch.device) -> "StepInput":
        """The same step with every input tensor on `device` (derived ones rebuilt there)."""
        return StepInput(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.init})

    def windows(self, ratio: int) -> "WindowPlan":
        """The compressor windows of this step at `ratio` (built on first use, shared by layers)."""
        if ratio not in self.plans:
            self.plans[ratio] = WindowPlan.build(self, ratio)
        return self.plans[ratio]


@dataclass
class WindowPlan:
    """Where each window that closes in this step takes its m rows, and what goes to the tails.

    Window i (of N, grouped by sequence in batch order) belongs to sequence `seq[i]`, has
    index `index[i]` (it covers positions [index*m, (index+1)*m)), and its row r is
    `step rows[src[i, r]]` when `from_step[i, r]`, else tail row `src[i, r]` of the flattened
    [S*m] tails (positions before the step's start). Rows `tail_rows` of the step (those after
    their sequence's last closed window) are written to tail rows `tail_dst`."""
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

    @property
    def count(self) -> int:
        return self.seq.shape[0]

    def gather(self, x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The closed windows' rows [N, m, W] from this step's rows x [T, W] and tail [S, m, W]."""
        flat = tail.view(-1, tail.shape[-1])
        return torch.where(self.from_step.unsqueeze(-1), x[self.step_src], flat[self.tail_src])

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
        stays = step.positions >= (ends // m * m)[step.q_seq]
        tail_rows = torch.nonzero(stays).squeeze(1)
        tail_dst = step.slots[step.q_seq[tail_rows]] * m + step.positions[tail_rows] % m
        return cls(seq, index, step_src, tail_src, from_step, first, last, keep, tail_rows, tail_dst)
