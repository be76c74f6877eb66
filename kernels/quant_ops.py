"""Matmuls over weights kept as the release ships them; the torch reference (CPU path).

Byte layouts (DeepSeek-V4 release; transformers' `finegrained_fp8` reads the same):

    FP8 linear   weight  [N, K]            float8_e4m3fn
                 scale   [ceil(N/bn), ceil(K/bk)]  float32 or float8_e8m0fnu (a power of two)
                 W[n, k] = weight[n, k] * scale[n // bn, k // bk]
    FP4 expert   weight  [N, K/2]          int8, two e2m1 codes per byte, the LOW nibble is
                                           column 2j, the high nibble column 2j+1
                 scale   [N, K/32]         float32 or float8_e8m0fnu
                 W[n, k] = E2M1[code(n, k)] * scale[n, k // 32]

Weights are dequantized a row band at a time inside the matmul, so the transient memory
is one band (`BAND_BYTES`), never a whole dense weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP4_GROUP = 32                      # inputs per FP4 scale
BAND_BYTES = 8 << 20                # dequantized rows materialized at once (per matmul)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_PAIRS: dict[torch.device, torch.Tensor] = {}


def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two e2m1 values (low nibble first) of every byte."""
    if device not in _E2M1_PAIRS:
        v = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        b = torch.arange(256, device=device)
        _E2M1_PAIRS[device] = torch.stack([v[b & 0xF], v[b >> 4]], -1)
    return _E2M1_PAIRS[device]


def _band_rows(k: int, multiple: int, dtype: torch.dtype) -> int:
    rows = max(1, BAND_BYTES // max(1, k * torch.finfo(dtype).bits // 8))
    return max(multiple, rows // multiple * multiple)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows [r0, r1) (default all) of a block-scaled e4m3 [N, K] weight, dense in `dtype`."""
    r0, r1 = rows or (0, weight.shape[0])
    n, k = r1 - r0, weight.shape[1]
    bn, bk = block
    row_scale = scale.float()[torch.arange(r0, r1, device=weight.device) // bn]          # [n, ceil(K/bk)]
    w = weight[r0:r1].float()
    full, rem = divmod(k, bk)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    out[:, :full * bk] = (w[:, :full * bk].view(n, full, bk) * row_scale[:, :full, None]).view(n, -1)
    if rem:
        out[:, full * bk:] = w[:, full * bk:] * row_scale[:, full:]
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               rows: tuple[int, int] | None = None) -> torch.Tensor:
    """x [.., K] @ W[r0:r1].T with W block-scaled FP8 (rows default: all), dequantized a band at a time."""
    r0, r1 = rows or (0, weight.shape[0])
    band = _band_rows(weight.shape[1], block[0], x.dtype)
    outs = [F.linear(x, dequant_fp8(weight, scale, block, x.dtype, (a, min(a + band, r1))))
            for a in range(r0, r1, band)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K/2] int8 -> [N, K] e2m1 values (low nibble first)."""
    pairs = _e2m1_pairs(packed.device)[packed.view(torch.uint8).long()]      # [N, K/2, 2]
    return pairs.flatten(-2).to(dtype)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K/2] int8 + [N, K/32] scales -> [N, K] dense."""
    values = unpack_fp4(packed, torch.float32)
    grouped = values.view(*values.shape[:-1], -1, FP4_GROUP) * scale.float().unsqueeze(-1)
    return grouped.flatten(-2).to(dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [.., K] @ W.T with W FP4-packed, dequantized a band of rows at a time."""
    band = _band_rows(packed.shape[1] * 2, 1, x.dtype)
    outs = [F.linear(x, dequant_fp4(packed[a:a + band], scale[a:a + band], x.dtype))
            for a in range(0, packed.shape[0], band)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
