"""Quantized weights as the DeepSeek-V4 release ships them, kept quantized in memory.

* `QuantFormat`: `quantization_config` (+ V4's top-level `expert_dtype`), validated once.
* `FP8Linear`: a drop-in for the model's `nn.Linear` holding e4m3 weight + block scales.
* `QuantExperts`: the routed experts stacked, FP4-packed (or FP8), same forward as the
  dense `Experts`.
The matmuls themselves are `kvmesh.kernels.quant_ops` (torch: dequantize a band of rows just in
time) on CPU and `kvmesh.kernels.triton_quant` (fused-dequant GEMMs) on CUDA; `quant_kernels` picks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kvmesh.kernels import quant_ops

EXPERT_DTYPES = ("fp8", "fp4")
SCALE_FMTS = ("float", "ue8m0")
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)


class QuantFormatError(ValueError):
    """A quantization_config or quantized tensor kvmesh does not know; the message names it."""


@dataclass(frozen=True)
class QuantFormat:
    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"

    @classmethod
    def from_config(cls, raw: dict, source: str = "config") -> "QuantFormat | None":
        q = raw.get("quantization_config")
        if not q:
            return None
        if not isinstance(q, dict):
            raise QuantFormatError(f"{source}: quantization_config must be an object")
        method = q.get("quant_method", "fp8")
        if method != "fp8":
            raise QuantFormatError(f"{source}: quant_method {method!r} is not supported (kvmesh loads 'fp8' "
                                   "block-scaled checkpoints with FP8/FP4 experts)")
        if q.get("fmt", "e4m3") != "e4m3":
            raise QuantFormatError(f"{source}: quantization_config.fmt {q.get('fmt')!r}; expected 'e4m3'")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise QuantFormatError(f"{source}: activation_scheme {q.get('activation_scheme')!r}; expected 'dynamic'")
        block = q.get("weight_block_size") or [128, 128]
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantFormatError(f"{source}: weight_block_size must be two positive integers, got {block!r}")
        scale_fmt = q.get("scale_fmt") or "float"
        if scale_fmt not in SCALE_FMTS:
            raise QuantFormatError(f"{source}: scale_fmt {scale_fmt!r} not in {SCALE_FMTS}")
        expert_dtype = q.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
        if expert_dtype not in EXPERT_DTYPES:
            raise QuantFormatError(f"{source}: expert_dtype {expert_dtype!r} not in {EXPERT_DTYPES}")
        return cls(tuple(block), scale_fmt, expert_dtype)


def check_fp8(name: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int],
              shape: tuple[int, int]) -> None:
    """Raise QuantFormatError naming `name` unless weight/scale are the FP8 layout for `shape`."""
    if scale is None:
        raise QuantFormatError(f"{name}: FP8 weight without its scale ({name}.scale or .weight_scale_inv)")
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantFormatError(f"{name}.weight: dtype {weight.dtype}, expected float8_e4m3fn with a scale")
    if tuple(weight.shape[-2:]) != shape:
        raise QuantFormatError(f"{name}.weight: shape {tuple(weight.shape)}, expected {shape}")
    want = (*weight.shape[:-2], math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    _check_scale(name, scale, want, f"one per {block[0]}x{block[1]} block")


def check_fp4(name: str, weight: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """`shape` is the dense [.., N, K]; FP4 stores int8 [.., N, K/2] + scales [.., N, K/32]."""
    if scale is None:
        raise QuantFormatError(f"{name}: FP4 weight without its scale")
    if weight.dtype != torch.int8:
        raise QuantFormatError(f"{name}.weight: dtype {weight.dtype}, expected int8 (two FP4 e2m1 per byte) "
                               "for expert_dtype 'fp4'")
    *lead, n, k = shape
    if k % quant_ops.FP4_GROUP:
        raise QuantFormatError(f"{name}: input dim {k} is not a multiple of {quant_ops.FP4_GROUP} (FP4 groups)")
    if tuple(weight.shape) != (*lead, n, k // 2):
        raise QuantFormatError(f"{name}.weight: shape {tuple(weight.shape)}, expected {(*lead, n, k // 2)} "
                               "(FP4 packed)")
    _check_scale(name, scale, (*lead, n, k // quant_ops.FP4_GROUP), f"one per {quant_ops.FP4_GROUP} inputs")


def _check_scale(name: str, scale: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    if scale.dtype not in SCALE_DTYPES:
        raise QuantFormatError(f"{name}.scale: dtype {scale.dtype}, expected float32 or float8_e8m0fnu")
    if tuple(scale.shape) != tuple(want):
        raise QuantFormatError(f"{name}.scale: shape {tuple(scale.shape)}, expected {tuple(want)} ({what})")


def quant_kernels(x: torch.Tensor):
    """Triton on CUDA, the torch reference elsewhere (same signatures)."""
    if x.is_cuda:
        from kvmesh.kernels import triton_quant
        return triton_quant
    return quant_ops


class FP8Linear(nn.Module):
    """y = x @ W.T with W block-scaled e4m3 [out, in]; `rows(a, b)` gives W[a:b] @ x."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.block = block
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return quant_kernels(x).fp8_linear(x, self.weight, self.scale, self.block, rows)


def grouped_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """V4's grouped output projection: x [T, G, D] and W [G*R, D] (group g owns rows g*R..)
    -> [T, G*R], each group through its own rows. Dense or `FP8Linear`."""
    t, g, _ = x.shape
    if isinstance(module, FP8Linear):
        r = module.out_features // g
        return torch.cat([module(x[:, i], (i * r, (i + 1) * r)) for i in range(g)], -1)
    w = module.weight.view(g, module.weight.shape[0] // g, -1)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)


def local_experts(idx: torch.Tensor, first: int | None, n: int) -> torch.Tensor:
    """Expert parallelism: global expert ids [T, K] -> this rank's local ids (experts
    [first, first + n)), -1 where another rank owns the pick; first None = all are local."""
    if first is None:
        return idx
    local = idx - first
    return torch.where((local >= 0) & (local < n), local, -1)



class QuantExperts(nn.Module):
    """Routed experts, quantized: w1/w3 [E, I, C] (gate/up), w2 [E, C, I] dense shapes, stored
    FP4-packed (`fp4`) or block-scaled FP8 (`fp8`); forward as the dense `Experts`."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], fmt: QuantFormat, limit: float,
                 act: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], first: int | None = None):
        super().__init__()
        for w in ("w1", "w2", "w3"):
            q, s = weights[w]
            self.register_parameter(w, nn.Parameter(q, requires_grad=False))
            self.register_parameter(f"{w}_scale", nn.Parameter(s, requires_grad=False))
        self.fmt, self.limit, self.act = fmt, limit, act       # act: the model's clamped SwiGLU
        self.first = first                                     # expert parallelism: see local_experts

    def _proj(self, w: str, e: int, x: torch.Tensor) -> torch.Tensor:
        q, s = getattr(self, w)[e], getattr(self, f"{w}_scale")[e]
        if self.fmt.expert_dtype == "fp4":
            return quant_kernels(x).fp4_linear(x, q, s)
        return quant_kernels(x).fp8_linear(x, q, s, self.fmt.block)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        idx = local_experts(idx, self.first, self.w1.shape[0])
        if x.is_cuda and self.fmt.expert_dtype == "fp4":
            return self._grouped(x, idx, weights)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            if e < 0:
                continue
            tok, k = torch.where(idx == e)
            h = self.act(self._proj("w1", e, x[tok]), self._proj("w3", e, x[tok]), self.limit)
            out.index_add_(0, tok, (self._proj("w2", e, h) * weights[tok, k, None]).to(out.dtype))
        return out

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """CUDA: every (token, expert) pair sorted by expert through one grouped GEMM per projection."""
        from kvmesh.kernels.triton_quant import fp4_grouped_linear
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        if self.first is not None:                       # picks other ranks own sort first: drop them
            order, flat = order[int((flat < 0).sum()):], flat[flat >= 0]
        tok = order // idx.shape[1]
        counts = torch.bincount(flat, minlength=self.w1.shape[0])
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        xs = x[tok]
        h = self.act(fp4_grouped_linear(xs, self.w1, self.w1_scale, offsets),
                   fp4_grouped_linear(xs, self.w3, self.w3_scale, offsets), self.limit)
        down = fp4_grouped_linear(h, self.w2, self.w2_scale, offsets) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tok, down.to(x.dtype))
