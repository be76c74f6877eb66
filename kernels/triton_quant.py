"""Triton twins of `kvmesh.kernels.quant_ops` (same signatures): GEMMs that read the weights as
shipped and dequantize inside the tile loop, so no dense weight is ever materialized.

    fp8_linear          x [M, K] @ W[r0:r1].T, W block-scaled e4m3 [N, K] (+ [ceil(N/bn), ceil(K/bk)] scales)
    fp4_grouped_linear  per expert e: x[rows of e] @ W_e.T, W_e e2m1-packed [N, K/2] (+ [N, K/32] scales)

The weight bytes are decoded with integer ops (e4m3: sign|4-bit exponent|3-bit mantissa,
bias 7; e2m1: sign|2-bit exponent|1-bit mantissa), which runs alike compiled for CUDA and
under TRITON_INTERPRET=1. Scales arrive as fp32 (ue8m0 is widened on the host: one value
per block or group, so that copy is small).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import ieee_dot

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _e4m3_to_f32(b):
    b = b.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = (b & 0x7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_to_f32(nib):
    e = (nib >> 1) & 0x3
    m = (nib & 0x1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((nib & 0x8) != 0, -mag, mag)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, row0, s_cols,
                       BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row0 + offs_n                                     # weight rows this tile produces
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        wmask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        wb = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=wmask, other=0)
        s = tl.load(s_ptr + (rows[:, None] // BN_SCALE) * s_cols + offs_k[None, :] // BK_SCALE,
                    mask=wmask, other=0.0)
        w = _e4m3_to_f32(wb) * s
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               rows: tuple[int, int] | None = None) -> torch.Tensor:
    r0, r1 = rows or (0, weight.shape[0])
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], r1 - r0
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fp8_linear_kernel[grid](x2, weight.contiguous().view(torch.uint8), scale.float().contiguous(), out,
                             m, n, k, r0, scale.shape[1], BN_SCALE=block[0], BK_SCALE=block[1],
                             IEEE=ieee_dot(x.device, x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.to(x.dtype).view(*lead, n)


@triton.jit
def _fp4_grouped_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offsets_ptr, N, K, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)
    if start + pid_m * BLOCK_M < end:
        offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_base = w_ptr + e.to(tl.int64) * N * (K // 2)
        s_base = s_ptr + e.to(tl.int64) * N * (K // 32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                        mask=(offs_m[:, None] < end) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            wmask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
            byte = tl.load(w_base + offs_n[:, None] * (K // 2) + offs_k[None, :] // 2, mask=wmask, other=0)
            nib = (byte.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF       # low nibble = even column
            s = tl.load(s_base + offs_n[:, None] * (K // 32) + offs_k[None, :] // 32, mask=wmask, other=0.0)
            w = _e2m1_to_f32(nib) * s
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < end) & (offs_n[None, :] < N))


def fp4_grouped_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       offsets: torch.Tensor) -> torch.Tensor:
    """x [T, K] sorted by expert, rows offsets[e]:offsets[e+1] for expert e; packed [E, N, K/2]
    int8, scale [E, N, K/32] -> [T, N]."""
    t, k = x.shape
    e, n = packed.shape[0], packed.shape[1]
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    counts = offsets[1:] - offsets[:-1]
    max_rows = int(counts.max()) if counts.numel() else 0
    if t == 0 or max_rows == 0:
        return out.to(x.dtype)
    grid = (e, triton.cdiv(max_rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fp4_grouped_kernel[grid](x.contiguous(), packed.contiguous().view(torch.uint8), scale.float().contiguous(),
                              out, offsets.to(torch.int32).contiguous(), n, k,
                              IEEE=ieee_dot(x.device, x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.to(x.dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's x [.., K] @ W.T (the grouped kernel with a single group)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    offsets = torch.tensor([0, x2.shape[0]], device=x.device)
    return fp4_grouped_linear(x2, packed[None], scale[None], offsets).view(*lead, packed.shape[0])
