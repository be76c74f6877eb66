"""DraftRule: how many drafts a step gets by its batch size (`speculative_tokens`, `auto`).

Apart from the speculator (torch) so the serve config, which parses the rule, imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftRule:
    """Drafts per step by the number of sequences in the batch: `steps` ((batch, k), ...) with
    rising batch sizes, the first at 1; k is the last step's whose batch is <= the batch. A fixed
    k is one step. Drafting pays where a step is cheap beside its fixed cost (small batches) and
    loses where the step is already compute-bound (docs/benchmarks.md)."""
    steps: tuple[tuple[int, int], ...]

    @classmethod
    def fixed(cls, k: int) -> "DraftRule":
        return cls(((1, k),))

    @classmethod
    def parse(cls, text: str) -> "DraftRule":
        """"1:2,16:1,32:0" -> k = 2 up to batch 15, 1 up to 31, 0 from 32 (ValueError if malformed)."""
        try:
            steps = tuple((int(b), int(k)) for b, k in (part.split(":") for part in text.split(",")))
        except ValueError:
            raise ValueError(f"{text!r} is not a list of batch:k pairs such as 1:2,16:1,32:0") from None
        batches = [b for b, _ in steps]
        if batches[0] != 1 or batches != sorted(set(batches)) or any(k < 0 for _, k in steps):
            raise ValueError(f"{text!r}: batch sizes must rise from 1, and every k be >= 0")
        return cls(steps)

    @property
    def k(self) -> int:
        """The most drafts any batch gets."""
        return max(k for _, k in self.steps)

    def for_batch(self, n: int) -> int:
        return next(k for b, k in reversed(self.steps) if b <= max(n, 1))
