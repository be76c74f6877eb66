"""Triton compressor: softmax-gated pooling of closed windows -> RMSNorm -> interleaved RoPE.

Same signature and semantics as `kvmesh.kernels.torch_ops.compress_windows`, plus an optional
`out=` (an [N, d] view, e.g. slots of a cache block) that receives the entries in place.
One program per window n. The softmax runs per channel over the window's slots:

    overlap (CSA):  | Ca of window n-1 (m slots, channels [:d]) | Cb of window n (m slots, [d:]) |
                    window 0 takes its Ca half from prev_kv/prev_gate, or drops it when None;
                    per-window prev_kv/prev_gate [N, m, d]: every window takes its Ca from there
    no overlap:     | window n (m slots, all d channels) |

Pass 1 streams the gates in BLOCK_M-slot chunks for the per-channel max and denominator;
pass 2 streams gates and kv again to pool. The low-precision roundings of the torch
reference (gate + ape, the softmax weights, each weighted row, the pooled row, the normed
row) are mirrored with `round_to`, so bf16 results agree to the last bit or two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import pow2_at_least, round_to, tl_dtype

POOL_BLOCK_M = 16  # slots per streamed chunk


@triton.jit
def _gate_chunk(gate_ptr, ape_ptr, stride_gm, stride_am, offs_m, offs_d, mask,
                ADD_APE: tl.constexpr, G_DT: tl.constexpr):
    g = tl.load(gate_ptr + offs_m[:, None] * stride_gm + offs_d[None, :], mask=mask, other=0.0)
    g = g.to(tl.float32)
    if ADD_APE:
        a = tl.load(ape_ptr + offs_m[:, None] * stride_am + offs_d[None, :], mask=mask, other=0.0)
        g = g + a.to(tl.float32)
    return tl.where(mask, round_to(g, G_DT), float("-inf"))


@triton.jit
def _series_stats(gate_ptr, ape_ptr, stride_gm, stride_am, m, offs_d, d_ok, mx, den,
                  ADD_APE: tl.constexpr, G_DT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Online per-channel max / sum of exp over one m-slot series."""
    for start in range(0, m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < m)[:, None] & d_ok[None, :]
        g = _gate_chunk(gate_ptr, ape_ptr, stride_gm, stride_am, offs_m, offs_d, mask, ADD_APE, G_DT)
        new = tl.maximum(mx, tl.max(g, 0))
        safe = tl.where(new == float("-inf"), 0.0, new)
        den = den * tl.exp(mx - safe) + tl.sum(tl.exp(g - safe[None, :]), 0)
        mx = new
    return mx, den


@triton.jit
def _series_pool(kv_ptr, gate_ptr, ape_ptr, stride_km, stride_gm, stride_am, m, offs_d, d_ok,
                 mx, den, acc, ADD_APE: tl.constexpr, G_DT: tl.constexpr, K_DT: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """acc += sum over the series of round(kv * round(softmax weight))."""
    for start in range(0, m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < m)[:, None] & d_ok[None, :]
        g = _gate_chunk(gate_ptr, ape_ptr, stride_gm, stride_am, offs_m, offs_d, mask, ADD_APE, G_DT)
        w = tl.where(mask, round_to(tl.exp(g - mx[None, :]) / den[None, :], K_DT), 0.0)
        kv = tl.load(kv_ptr + offs_m[:, None] * stride_km + offs_d[None, :], mask=mask, other=0.0)
        kv = round_to(kv.to(tl.float32), K_DT)
        acc += tl.sum(round_to(kv * w, K_DT), 0)
    return acc


@triton.jit
def _compress_kernel(
    kv_ptr, gate_ptr, ape_ptr, prev_kv_ptr, prev_gate_ptr, norm_w_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_kn, stride_km, stride_gn, stride_gm, stride_am, stride_pkn, stride_pkm, stride_pgn, stride_pgm,
    stride_cn, stride_sn, stride_on,
    m, eps, n_pairs,
    d: tl.constexpr, OVERLAP: tl.constexpr, HAS_PREV: tl.constexpr, PREV_PER_WINDOW: tl.constexpr,
    K_DT: tl.constexpr, G_DT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    if OVERLAP:
        cb = d  # the current window contributes its Cb channels, the previous one its Ca
    else:
        cb = 0
    kv_b, gate_b, ape_b = kv_ptr + n * stride_kn + cb, gate_ptr + n * stride_gn + cb, ape_ptr + cb

    mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_D], tl.float32)
    mx, den = _series_stats(gate_b, ape_b, stride_gm, stride_am, m, offs_d, d_ok, mx, den,
                            True, G_DT, BLOCK_M)
    if OVERLAP:
        if PREV_PER_WINDOW:
            mx, den = _series_stats(prev_gate_ptr + n * stride_pgn, ape_ptr, stride_pgm, 0, m, offs_d, d_ok,
                                    mx, den, False, G_DT, BLOCK_M)
        elif n > 0:
            mx, den = _series_stats(gate_ptr + (n - 1) * stride_gn, ape_ptr, stride_gm, stride_am,
                                    m, offs_d, d_ok, mx, den, True, G_DT, BLOCK_M)
        elif HAS_PREV:
            mx, den = _series_stats(prev_gate_ptr, ape_ptr, stride_pgm, 0, m, offs_d, d_ok,
                                    mx, den, False, G_DT, BLOCK_M)

    acc = tl.zeros([BLOCK_D], tl.float32)
    acc = _series_pool(kv_b, gate_b, ape_b, stride_km, stride_gm, stride_am, m, offs_d, d_ok,
                       mx, den, acc, True, G_DT, K_DT, BLOCK_M)
    if OVERLAP:
        if PREV_PER_WINDOW:
            acc = _series_pool(prev_kv_ptr + n * stride_pkn, prev_gate_ptr + n * stride_pgn, ape_ptr,
                               stride_pkm, stride_pgm, 0, m, offs_d, d_ok, mx, den, acc, False, G_DT, K_DT,
                               BLOCK_M)
        elif n > 0:
            acc = _series_pool(kv_ptr + (n - 1) * stride_kn, gate_ptr + (n - 1) * stride_gn, ape_ptr,
                               stride_km, stride_gm, stride_am, m, offs_d, d_ok, mx, den, acc,
                               True, G_DT, K_DT, BLOCK_M)
        elif HAS_PREV:
            acc = _series_pool(prev_kv_ptr, prev_gate_ptr, ape_ptr, stride_pkm, stride_pgm, 0, m,
                               offs_d, d_ok, mx, den, acc, False, G_DT, K_DT, BLOCK_M)

    # RMSNorm over the d channels (padding channels are 0), rounded like the reference
    x = round_to(acc, K_DT)
    rms = tl.rsqrt(tl.sum(x * x, 0) / d + eps)
    x = round_to(tl.load(norm_w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32) * (x * rms), K_DT)

    # interleaved RoPE on the trailing n_pairs channel pairs (2i, 2i+1); other pairs pass through
    x0, x1 = tl.split(tl.reshape(x, [BLOCK_D // 2, 2]))
    pair = tl.arange(0, BLOCK_D // 2)
    j = pair - (d // 2 - n_pairs)
    is_rope = (j >= 0) & (pair < d // 2)
    c = tl.load(cos_ptr + n * stride_cn + j, mask=is_rope, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + n * stride_sn + j, mask=is_rope, other=0.0).to(tl.float32)
    y0 = tl.where(is_rope, x0 * c - x1 * s, x0)
    y1 = tl.where(is_rope, x1 * c + x0 * s, x1)
    y = round_to(tl.reshape(tl.join(y0, y1), [BLOCK_D]), K_DT)
    tl.store(out_ptr + n * stride_on + offs_d, y, mask=d_ok)


def compress_windows(
    kv: torch.Tensor,           # [N, m, W]  projected tokens of N closed windows (W = 2d if overlap else d)
    gate: torch.Tensor,         # [N, m, W]  gate projections (position bias not yet added)
    ape: torch.Tensor,          # [m, W]     learned position bias
    prev_kv: torch.Tensor | None,    # [m, d] Ca half of the window before the first one, or None;
                                     # or [N, m, d]: the Ca half before each window
    prev_gate: torch.Tensor | None,  # [m, d] / [N, m, d] its gate (bias included)
    norm_weight: torch.Tensor,  # [d] RMSNorm weight (fp32)
    eps: float,
    cos: torch.Tensor,          # [N, R/2] rope at each window's start position
    sin: torch.Tensor,
    overlap: bool,
    *,
    out: torch.Tensor | None = None,  # [N, d] in kv's dtype, last dim contiguous; written in place
) -> torch.Tensor:
    """Softmax-gated pooling of each closed window -> RMSNorm -> RoPE. Returns [N, d]
    (`out` when given)."""
    n, m, width = kv.shape
    d = width // 2 if overlap else width
    if out is None:
        out = kv.new_empty(n, d)
    elif out.shape != (n, d) or out.dtype != kv.dtype or out.stride(-1) != 1:
        raise ValueError(f"compress_windows: out must be [{n}, {d}] {kv.dtype} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if n == 0:
        return out
    kv, gate, ape = (x if x.stride(-1) == 1 else x.contiguous() for x in (kv, gate, ape))
    cos, sin, norm_weight = cos.contiguous(), sin.contiguous(), norm_weight.contiguous()
    has_prev = overlap and prev_kv is not None
    per_window = has_prev and prev_kv.dim() == 3
    if has_prev:
        prev_kv, prev_gate = prev_kv.contiguous(), prev_gate.contiguous()
    else:
        prev_kv = prev_gate = kv  # never read
    pkn, pgn = (prev_kv.stride(0), prev_gate.stride(0)) if per_window else (0, 0)
    pkm, pgm = prev_kv.stride(-2), prev_gate.stride(-2)
    _compress_kernel[(n,)](
        kv, gate, ape, prev_kv, prev_gate, norm_weight, cos, sin, out,
        kv.stride(0), kv.stride(1), gate.stride(0), gate.stride(1), ape.stride(0),
        pkn, pkm, pgn, pgm, cos.stride(0), sin.stride(0), out.stride(0),
        m, float(eps), cos.shape[-1],
        d=d, OVERLAP=bool(overlap), HAS_PREV=has_prev, PREV_PER_WINDOW=per_window,
        K_DT=tl_dtype(kv.dtype), G_DT=tl_dtype(torch.promote_types(gate.dtype, ape.dtype)),
        BLOCK_M=min(POOL_BLOCK_M, pow2_at_least(m, 1)), BLOCK_D=pow2_at_least(d),
        num_warps=4 if d <= 256 else 8,
    )
    return out
