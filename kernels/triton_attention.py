"""Triton sparse attention over the SWA window plus paged compressed entries (CSA / HCA / SWA).

Same signature and semantics as `kvmesh.kernels.torch_ops.sparse_attention`. One program per
(query token, block of heads); the single shared K=V head makes the heads the M dimension
of every dot, so one key tile serves BLOCK_H heads at once:

    scores[h, n] = q[t, h] . kv[n] * scale        kv[n] from  | window rows | compressed entries |
    out[t, h]    = sum_n softmax_n(scores, sink[h]) * kv[n]

Online softmax in fp32; the sink starts the running max/denominator (it adds exp(sink - max)
to the denominator and nothing to the numerator). Window rows of a sequence hold consecutive
positions (row j = first[b] + j, or -1 = empty), so a query scans only the <= `window` rows
that can hold (q - window, q], not the whole chunk-wide window tensor. Compressed entry e of sequence b is read
in place from `comp_cache[block_table[b, e // EPB], e % EPB]`: all e < min(comp_len[b],
(q+1) // ratio) for HCA (`topk_idx is None`), only the picked ones for CSA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import attention_config, dot, ieee_dot, round_to, tl_dtype

# finite stand-in for a -inf sink, so the online-softmax running max is never -inf
NEG_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(q, kv, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """Fold one tile of keys (BLOCK_N rows, `valid` masks them) into the running softmax."""
    s = dot(q, tl.trans(kv), IEEE) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p, kv, IEEE)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_kernel(
    q_ptr, q_pos_ptr, q_seq_ptr, win_kv_ptr, win_pos_ptr, win_first_ptr, comp_ptr, bt_ptr, comp_len_ptr,
    topk_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh, stride_wb, stride_wr, stride_pb, stride_cb, stride_cs, stride_btb,
    stride_kt, stride_ot, stride_oh,
    H, W, K, scale, window, ratio,
    D: tl.constexpr, EPB: tl.constexpr, HAS_COMP: tl.constexpr, HAS_TOPK: tl.constexpr,
    OUT_DT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    b = tl.load(q_seq_ptr + t).to(tl.int64)
    qp = tl.load(q_pos_ptr + t).to(tl.int64)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    m_i = tl.maximum(sink, NEG_FLOOR)
    l_i = tl.exp(sink - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # (a) the sequence's window rows: visible iff q - window < pos <= q (pos -1 = empty row)
    first = tl.load(win_first_ptr + b)
    row_end = tl.minimum(qp + 1 - first, W)
    for start in range(tl.maximum(qp - window + 1 - first, 0), row_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        pos = tl.load(win_pos_ptr + b * stride_pb + offs_n, mask=offs_n < row_end, other=-1)
        valid = (pos >= 0) & (pos <= qp) & (pos > qp - window)
        kv = tl.load(win_kv_ptr + b * stride_wb + offs_n[:, None] * stride_wr + offs_d[None, :],
                     mask=valid[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_tile(q, kv, valid, m_i, l_i, acc, scale, IEEE)

    # (b) compressed entries, read in place through the block table
    if HAS_COMP:
        limit = tl.minimum(tl.load(comp_len_ptr + b).to(tl.int64), (qp + 1) // ratio)
        if HAS_TOPK:
            n_keys = K
        else:
            n_keys = limit
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            if HAS_TOPK:
                e = tl.load(topk_ptr + t * stride_kt + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
            else:
                e = offs_n.to(tl.int64)
            valid = (e >= 0) & (e < limit)
            blk = tl.load(bt_ptr + b * stride_btb + e // EPB, mask=valid, other=0).to(tl.int64)
            row = blk * stride_cb + (e % EPB) * stride_cs
            kv = tl.load(comp_ptr + row[:, None] + offs_d[None, :],
                         mask=valid[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _attend_tile(q, kv, valid, m_i, l_i, acc, scale, IEEE)

    out = round_to(acc / l_i[:, None], OUT_DT)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def window_first_positions(win_pos: torch.Tensor) -> torch.Tensor:
    """[B] position held by row 0 of each sequence's window rows (0 when all rows are empty)."""
    j = torch.arange(win_pos.shape[1], device=win_pos.device)
    first = torch.where(win_pos >= 0, win_pos - j, torch.iinfo(torch.int64).min).amax(dim=1)
    return torch.where((win_pos >= 0).any(dim=1), first, 0)


def sparse_attention(
    q: torch.Tensor,            # [T, H, D]
    q_pos: torch.Tensor,        # [T] int64 absolute positions
    q_seq: torch.Tensor,        # [T] int64 sequence index in [0, B)
    win_kv: torch.Tensor,       # [B, W, D] window K=V per sequence (consecutive positions, padded)
    win_pos: torch.Tensor,      # [B, W] int64 positions of win_kv rows, -1 = empty
    comp_cache: torch.Tensor | None,   # [NB, EPB, D] paged compressed entries, or None (SWA layer)
    block_table: torch.Tensor | None,  # [B, MB] int32
    comp_len: torch.Tensor | None,     # [B] int64 entries per sequence
    topk_idx: torch.Tensor | None,     # [T, K] int64 picks (-1 = none, no repeats); None = all visible
    sinks: torch.Tensor,        # [H] fp32 per-head sink logit
    scale: float,
    window: int,
    ratio: int,
    max_entries: int | None = None,    # unused: entries are read in place up to comp_len (no read-back)
    decode: bool = False,              # unused: each query scans only its own window rows anyway
    win_rows: torch.Tensor | None = None,    # unused: each program finds its window rows itself
    win_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over the SWA window plus the visible compressed entries, with a
    per-head sink in the denominator. Returns [T, H, D] in q's dtype."""
    T, H, D = q.shape
    out = q.new_empty(T, H, D)
    if T == 0:
        return out
    has_comp = comp_cache is not None and comp_len is not None
    # mixed dtypes (e.g. a bf16 cache under an fp32 model) take the fp32 dot path, like the reference
    mixed = win_kv.dtype != q.dtype or (has_comp and comp_cache.dtype != q.dtype)
    q, win_kv, win_pos = _rows_contiguous(q), _rows_contiguous(win_kv), _rows_contiguous(win_pos)
    if has_comp:
        comp_cache, block_table = _rows_contiguous(comp_cache), _rows_contiguous(block_table)
        comp_args = (comp_cache, block_table, comp_len.contiguous())
        comp_strides = (comp_cache.stride(0), comp_cache.stride(1), block_table.stride(0))
        epb = comp_cache.shape[1]
    else:
        comp_args, comp_strides, epb = (q, q_pos, q_pos), (0, 0, 0), 1  # never read
    has_topk = has_comp and topk_idx is not None
    topk = _rows_contiguous(topk_idx) if has_topk else q_pos
    n_topk = topk_idx.shape[1] if has_topk else 0
    block_h, block_n, block_d, num_warps = attention_config(H, D)
    grid = (T, triton.cdiv(H, block_h))
    _sparse_attn_kernel[grid](
        q, q_pos.contiguous(), q_seq.contiguous(), win_kv, win_pos, window_first_positions(win_pos),
        *comp_args,
        topk, sinks.contiguous(), out,
        q.stride(0), q.stride(1), win_kv.stride(0), win_kv.stride(1), win_pos.stride(0),
        *comp_strides, topk.stride(0) if has_topk else 0, out.stride(0), out.stride(1),
        H, win_kv.shape[1], n_topk, float(scale), int(window), int(ratio),
        D=D, EPB=epb, HAS_COMP=has_comp, HAS_TOPK=has_topk,
        OUT_DT=tl_dtype(out.dtype), IEEE=mixed or ieee_dot(q.device, q.dtype),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out
