"""Logit processors applied to a whole batch at once (no loop over the vocabulary).

    presence / frequency (OpenAI):  l -= presence * [count > 0] + frequency * count   (output tokens)
    repetition (CTRL, HF, vLLM):    l = l / r if l > 0 else l * r     for tokens of the prompt or output
    logit_bias (OpenAI):            l[token] += bias
"""
from __future__ import annotations

import torch


def token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[B, V] occurrence counts of each row's tokens (one scatter_add for the batch)."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    if width:
        ids = torch.full((len(rows), width), vocab, dtype=torch.long)   # column `vocab` absorbs padding
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long).clamp_(0, vocab)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """In place on logits [B, V]; presence/frequency/repetition are [B] (0, 0, 1 = off)."""
    vocab = logits.shape[1]
    out_counts = token_counts(outputs, vocab, logits.device)
    if bool((repetition != 1.0).any()):
        seen = (token_counts(prompts, vocab, logits.device) + out_counts) > 0
        r = repetition[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency[:, None] * out_counts + presence[:, None] * (out_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> None:
    """In place: one index_put over every (row, token, bias) of the batch; ids past the vocab are ignored."""
    rows, cols, vals = [], [], []
    for i, pairs in enumerate(biases):
        for tok, bias in pairs:
            if tok < logits.shape[1]:
                rows.append(i), cols.append(tok), vals.append(float(bias))
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=logits.dtype),
                          accumulate=True)
