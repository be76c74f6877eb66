"""Interleaved partial RoPE on the trailing `2 * cos.shape[-1]` channels of each head.

Layout of one head (V4 keeps the rope slice last):  | <   nope   > | < rope (pairs) > |
Pairs are adjacent channels (2i, 2i+1); `cos`/`sin` carry one entry per pair.
"""
from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing rope slice of `x` in fp32.

    x: [N, D] or [N, H, D]; cos/sin: [N, R/2] (broadcast over heads). Returns x's dtype.
    """
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = (rope.float() * cos + rotate_pairs(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
