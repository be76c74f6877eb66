"""Sampling parameters (validated once) and the sampler."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1   # int64, as OpenAI-style APIs take seeds


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending field (HTTP 400)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) exceeds the model's context limit."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = True

    def validate(self) -> "SamplingParams":
        def bad(field: str, why: str):
            raise InvalidRequestError(f"{field}: {why}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of non-negative integer token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        return self


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0.0 or params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: tuple[int, ...] = ()) -> tuple[int, float]:
    """Pick one token from fp32 logits [V]; returns (token, logprob under the model's
    unmodified distribution). `banned` ids are excluded (EOS before min_tokens)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    work = logits.clone()
    if banned:
        work[list(banned)] = float("-inf")
    if params.temperature == 0.0:
        token = int(work.argmax())
        return token, float(logprobs[token])
    work = work / params.temperature
    if params.top_k:
        kth = torch.topk(work, min(params.top_k, work.numel())).values[-1]
        work = work.masked_fill(work < kth, float("-inf"))
    probs = torch.softmax(work, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order[keep], True)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
