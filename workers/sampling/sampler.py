"""The batch sampler: one call per engine step for every sequence that gets a token.

    raw logits [B, V] ─▶ penalties, logit_bias, bans, grammar mask ─▶ greedy rows: argmax
                                                                   ─▶ others: /T, top-k, top-p, min-p,
                                                                      exponential race (per-row seed)
The grammar mask of every guided row is one packed bitmask [B, ceil(V/32)] int32, each row filled
by its sequence's matcher, applied in one in-place op (workers.sampling.grammar), as vLLM and
SGLang do; no bool [V] per row.
Reported logprobs (the sampled token's and the top-N alternatives) are under the
model's raw distribution, as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .grammar import Guide, apply_token_bitmask, token_bitmask
from .params import SamplingParams
from .penalties import apply_logit_bias, apply_penalties


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    banned: tuple[int, ...] = ()
    prompt: list[int] = field(default_factory=list)    # read only when a penalty is on
    output: list[int] = field(default_factory=list)
    guide: Guide | None = None                          # a grammar's matcher (fills the row's mask); None = all


class Sampled(NamedTuple):
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]     # per row: its top_logprobs (id, logprob), best first


def _column(rows: list[SampleRow], name: str, device) -> torch.Tensor:
    return torch.tensor([float(getattr(r.params, name)) for r in rows], dtype=torch.float32, device=device)


def _filter(work: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k, top-p and min-p (one sort for the batch)."""
    dev, vocab = work.device, work.shape[1]
    work = work / _column(rows, "temperature", dev)[:, None]
    if all(r.params.top_k == 0 and r.params.top_p >= 1.0 and r.params.min_p == 0.0 for r in rows):
        return torch.softmax(work, dim=1)         # nothing to truncate: no sort
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=dev)
    top_p = _column(rows, "top_p", dev)
    sorted_l, order = work.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    sorted_p = torch.softmax(sorted_l, dim=1)
    drop = (rank >= top_k[:, None]) | ((sorted_p.cumsum(1) - sorted_p) >= top_p[:, None])
    drop |= sorted_p < _column(rows, "min_p", dev)[:, None] * sorted_p[:, :1]
    drop[:, 0] = False
    sorted_l = sorted_l.masked_fill(drop, float("-inf"))
    return torch.softmax(torch.empty_like(work).scatter_(1, order, sorted_l), dim=1)


def _race(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): a draw from p; seeded rows take E from their own generator."""
    q = torch.empty_like(probs).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            q[i] = torch.empty(probs.shape[1]).exponential_(generator=r.generator).to(probs.device)
    return (probs / q).argmax(dim=1)


def _mask_grammar(work: torch.Tensor, rows: list[SampleRow]) -> None:
    """Refuse, in every guided row, the tokens its grammar does not accept next: one packed
    bitmask for the batch, each guided row filled by its matcher, applied in one op."""
    guided = [i for i, r in enumerate(rows) if r.guide is not None]
    if not guided:
        return
    vocab = rows[guided[0]].guide.vocab_size
    bitmask = token_bitmask(len(rows), vocab)
    for i in guided:
        rows[i].guide.fill(bitmask, i)
    apply_token_bitmask(work, bitmask, guided, vocab)


def processed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """fp32 logits [B, V] after penalties, logit_bias, bans and grammar masks, in that order (a copy)."""
    work = logits.float().clone()
    dev = work.device
    if any(r.params.penalized for r in rows):
        apply_penalties(work, [r.prompt for r in rows], [r.output for r in rows],
                        _column(rows, "presence_penalty", dev), _column(rows, "frequency_penalty", dev),
                        _column(rows, "repetition_penalty", dev))
    if any(r.params.logit_bias for r in rows):
        apply_logit_bias(work, [r.params.logit_bias for r in rows])
    bans = [(i, t) for i, r in enumerate(rows) for t in r.banned if t < work.shape[1]]
    if bans:
        work[tuple(torch.tensor(bans).T)] = float("-inf")
    _mask_grammar(work, rows)
    return work


def sample_batch(logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
    """Pick one token per row of fp32 logits [B, V]."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    work = processed(logits, rows)
    tokens = work.argmax(dim=1)
    hot = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
    if hot:
        sub = [rows[i] for i in hot]
        tokens[hot] = _race(_filter(work[hot], sub), sub)
    token_list = tokens.tolist()
    chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(r.params.top_logprobs for r in rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if k:
        vals, ids = raw.topk(min(k, raw.shape[1]), dim=1)
        vals, ids = vals.tolist(), ids.tolist()
        top = [list(zip(ids[i][:r.params.top_logprobs], vals[i][:r.params.top_logprobs]))
               for i, r in enumerate(rows)]
    return Sampled(token_list, chosen, top)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: tuple[int, ...] = ()) -> tuple[int, float]:
    """Pick one token from fp32 logits [V]; returns (token, logprob under the model's
    unmodified distribution). `banned` ids are excluded (EOS before min_tokens)."""
    out = sample_batch(logits[None], [SampleRow(params, generator, banned)])
    return out.tokens[0], out.logprobs[0]
