"""SWA caching policies and the restore planner (DESIGN §2).

`plan_restore` is a pure function of what the prompt needs and what the tiers hold:

    prompt   | block 0 | block 1 | ... | block k-1 | partial tail + last token |
    hit H    |<------------- restored ----------->|
    full     | load blocks [0,H) with their SWA K=V; state at H rebuilt from them
    periodic | load blocks [0,C) + checkpoint C (largest C <= H); compute from C
    zero     | load blocks [0,H); recompute [S,H) with those entries kept; compute from H
    auto     | as periodic; a request whose hit ends past its checkpoint also checkpoints
             | the hit's end as it passes it (a branch point), so the next request that
             | branches there restores fully (`branch_point`)

The last prompt token is always computed (its logits give the first output token),
so a hit never covers it.
"""
from __future__ import annotations

from typing import NamedTuple


class PolicyError(ValueError):
    """An SWA policy string that cannot be used; the message says why."""


class SwaPolicy(NamedTuple):
    kind: str              # "full" | "periodic" | "zero" | "auto"
    period: int = 0        # tokens between checkpoints (periodic; auto: 0 = prompt ends and branch points only)
    adaptive: bool = False  # auto: the period is re-chosen from the cost model as the engine runs

    @classmethod
    def parse(cls, spec: str, block_tokens: int) -> "SwaPolicy":
        if spec in ("full", "zero"):
            return cls(spec)
        if spec == "auto":
            return cls("auto", 0, True)
        kind, _, arg = spec.partition(":")
        if kind in ("periodic", "auto") and arg:
            try:
                period = int(arg)
            except ValueError:
                raise PolicyError(f"swa policy {spec!r}: period must be an integer") from None
            if period < (kind == "periodic") or period % block_tokens:
                raise PolicyError(f"swa policy {spec!r}: period must be a positive multiple of "
                                  f"block_tokens ({block_tokens})" + (" or 0" if kind == "auto" else ""))
            return cls(kind, period)
        raise PolicyError(f"unknown swa policy {spec!r}: use full, periodic:P, zero, auto or auto:P")

    @property
    def checkpoints(self) -> bool:
        """Whether restores start from stored checkpoints (periodic, auto)."""
        return self.kind in ("periodic", "auto")

    def __str__(self) -> str:
        if self.kind == "auto":
            return "auto" if self.adaptive else f"auto:{self.period}"
        return f"periodic:{self.period}" if self.kind == "periodic" else self.kind


class Availability(NamedTuple):
    """What the tiers hold for a prompt's block chain (indices are block numbers)."""
    blocks: int                     # leading blocks whose objects (memory or store) are present
    checkpoints: frozenset[int]     # i such that the state at (i + 1) * block_tokens is present


class RestorePlan(NamedTuple):
    load_blocks: int                # restore blocks [0, load_blocks)
    checkpoint: int | None          # block index whose end-state to load (periodic)
    recompute_from: int             # first token to run (== hit unless zero policy)
    keep_tokens: int                # compressed entries of windows ending <= this stay as loaded
    hit_tokens: int                 # prompt tokens restored rather than computed

    @property
    def is_miss(self) -> bool:
        return self.load_blocks == 0

    @property
    def recompute_tokens(self) -> int:
        return self.keep_tokens - self.recompute_from if self.keep_tokens > self.recompute_from else 0


MISS = RestorePlan(0, None, 0, 0, 0)


def recompute_span(num_layers: int, window: int, max_ratio: int) -> int:
    """Tokens the zero policy reruns before a hit so every layer's ring and overlap state
    is exact: layer l's input at token t is exact once t >= start + (l-1)(window-1)."""
    return max(num_layers * (window - 1), max_ratio + (num_layers - 1) * (window - 1))


def plan_restore(prompt_tokens: int, block_tokens: int, avail: Availability, policy: SwaPolicy,
                 span: int) -> RestorePlan:
    """Decide what to load and what to recompute for a prompt of `prompt_tokens` tokens."""
    usable = min(avail.blocks, (prompt_tokens - 1) // block_tokens)
    if usable <= 0:
        return MISS
    if policy.kind == "full":
        hit = usable * block_tokens
        return RestorePlan(usable, None, hit, hit, hit)
    if policy.checkpoints:
        ckpts = [i for i in avail.checkpoints if i < usable]
        if not ckpts:
            return MISS
        c = max(ckpts)
        hit = (c + 1) * block_tokens
        return RestorePlan(c + 1, c, hit, hit, hit)
    hit = usable * block_tokens
    start = max(0, hit - span) // block_tokens * block_tokens
    if start == 0:
        return MISS
    return RestorePlan(usable, None, start, hit, start)


def checkpoint_due(pos: int, prompt_tokens: int, block_tokens: int, period: int) -> bool:
    """Whether a request that has computed up to `pos` checkpoints there: every `period`
    tokens and at the prompt's last block boundary (so the next turn restores it)."""
    if pos <= 0 or pos % block_tokens or pos > prompt_tokens:
        return False
    return bool(period and pos % period == 0) or pos == prompt_tokens // block_tokens * block_tokens


def branch_point(plan: RestorePlan, avail: Availability, block_tokens: int, policy: SwaPolicy) -> int | None:
    """auto: the end of the stored prefix when the restore starts before it (the hit ends
    between checkpoints). The request passes it anyway; checkpointing it there costs no
    compute and lets the next request that branches at the same point restore fully."""
    if policy.kind != "auto" or avail.blocks <= plan.load_blocks:
        return None
    return avail.blocks * block_tokens
