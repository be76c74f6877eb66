"""The small pieces every block uses: row gathers, RMSNorm, RoPE (plain and YaRN), linear."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs, RopeArgs

PositionRope = dict[str, tuple[torch.Tensor, torch.Tensor]]   # rope type -> (cos, sin) at step.positions


def rows_of(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x viewed as rows [x.shape[0] * x.shape[1], ...] (contiguous), gathered at flat indices
    idx [...] -> [..., *x.shape[2:]]; index_select copies rows at a time (2-3x faster on the CPU
    than advanced indexing by (i, j) pairs)."""
    flat = x.view(-1, *x.shape[2:])
    return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[2:])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight in fp32 (torch's fused op: the same bits as the
    formula spelled out, in one dispatch instead of six)."""
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def rope_inv_freq(rope: RopeArgs, dim: int) -> torch.Tensor:
    """Inverse frequencies (one per pair); YaRN as transformers computes it, without mscale."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs

    def corr_dim(rot: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rope(nn.Module):
    def __init__(self, rope: RopeArgs, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


def make_ropes(args: ModelArgs, device: str | torch.device = "cpu") -> nn.ModuleDict:
    """Plain RoPE for SWA layers, the compress RoPE (YaRN when configured) for CSA/HCA."""
    with torch.device(device):
        return nn.ModuleDict({"main": Rope(args.main_rope, args.rope_head_dim),
                              "compress": Rope(args.compress_rope, args.rope_head_dim)})
