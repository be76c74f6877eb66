"""Triton lightning indexer: paged key scoring, then a stable top-k.

Same signature and semantics as `kvmesh.kernels.torch_ops.indexer_topk`. The kernel fills the
[T, Emax] score matrix, one program per (query token, BLOCK_E entries):

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) * scale     if e < limit[t]
                = -inf                                               otherwise
    limit[t]    = min((q_pos[t] + 1) // ratio, key_len[q_seq[t]])

with k[e] read in place from `key_cache[block_table[b, e // EPB], e % EPB]`; tiles past
the limit are not read at all. The selection is `torch.sort(stable=True)`, exactly the
reference's, so ties go to the lower entry index and picks past the limit become -1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import dot, ieee_dot, pow2_at_least

INDEXER_BLOCK_E = 64   # entries scored per program
INDEXER_MAX_BLOCK_H = 64


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, q_pos_ptr, q_seq_ptr, key_ptr, bt_ptr, key_len_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ks, stride_btb, stride_ot,
    Hi, E, ratio, scale,
    Di: tl.constexpr, EPB: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    b = tl.load(q_seq_ptr + t).to(tl.int64)
    qp = tl.load(q_pos_ptr + t).to(tl.int64)
    limit = tl.minimum((qp + 1) // ratio, tl.load(key_len_ptr + b).to(tl.int64))
    valid = e < limit
    score = tl.zeros([BLOCK_E], tl.float32)
    if tl.program_id(1) * BLOCK_E < limit:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < Di
        blk = tl.load(bt_ptr + b * stride_btb + e // EPB, mask=valid, other=0).to(tl.int64)
        row = blk * stride_kb + (e % EPB) * stride_ks
        k = tl.load(key_ptr + row[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                    other=0.0)
        for h0 in range(0, Hi, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < Hi
            q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                        mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            s = tl.maximum(dot(q, tl.trans(k), IEEE), 0.0) * scale      # [BLOCK_H, BLOCK_E]
            score += tl.sum(s * w[:, None], 0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * stride_ot + e, score, mask=e < E)


def indexer_scores_paged(q, weights, q_pos, q_seq, key_cache, block_table, key_len, ratio, scale,
                         n_entries: int) -> torch.Tensor:
    """[T, n_entries] fp32 scores, -inf where an entry is not visible to the query."""
    T, Hi, Di = q.shape
    scores = torch.empty(T, n_entries, dtype=torch.float32, device=q.device)
    if T == 0 or n_entries == 0:
        return scores
    q = q if q.stride(-1) == 1 else q.contiguous()
    key_cache = key_cache if key_cache.stride(-1) == 1 else key_cache.contiguous()
    weights, block_table = weights.contiguous(), block_table.contiguous()
    grid = (T, triton.cdiv(n_entries, INDEXER_BLOCK_E))
    _indexer_scores_kernel[grid](
        q, weights, q_pos.contiguous(), q_seq.contiguous(), key_cache, block_table,
        key_len.contiguous(), scores,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
        block_table.stride(0), scores.stride(0),
        Hi, n_entries, int(ratio), float(scale),
        Di=Di, EPB=key_cache.shape[1],
        IEEE=key_cache.dtype != q.dtype or ieee_dot(q.device, q.dtype),  # mixed dtypes: fp32 dots
        BLOCK_H=min(pow2_at_least(Hi), INDEXER_MAX_BLOCK_H), BLOCK_E=INDEXER_BLOCK_E,
        BLOCK_D=pow2_at_least(Di),
    )
    return scores


def indexer_topk(
    q: torch.Tensor,            # [T, Hi, Di]
    weights: torch.Tensor,      # [T, Hi]
    q_pos: torch.Tensor,        # [T]
    q_seq: torch.Tensor,        # [T]
    key_cache: torch.Tensor,    # [NB, EPB, Di] paged indexer keys
    block_table: torch.Tensor,  # [B, MB]
    key_len: torch.Tensor,      # [B]
    ratio: int,
    topk: int,
    scale: float,
    max_entries: int | None = None,   # host-known bound on key_len (skips reading it back)
    decode: bool = False,             # unused: keys are read in place for every query
) -> torch.Tensor:
    """Lightning-indexer top-k: [T, topk] int64 entry indices, -1 where fewer are visible.

    Ties are broken toward the lower entry index (a stable sort), so the picks do not
    depend on batch composition or on how a prompt was chunked.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    if max_entries is not None:     # host-known bound: no read-back (CUDA graphs)
        n_entries = min(max_entries, block_table.shape[1] * key_cache.shape[1]) if q.shape[0] else 0
    else:
        n_entries = int(key_len.max().item()) if q.shape[0] else 0
    if n_entries == 0:
        return out
    scores = indexer_scores_paged(q, weights, q_pos, q_seq, key_cache, block_table, key_len,
                                  ratio, scale, n_entries)
    k = min(topk, n_entries)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    limit = torch.minimum((q_pos + 1) // ratio, key_len[q_seq])
    out[:, :k] = torch.where(order < limit.unsqueeze(1), order, torch.full_like(order, -1))
    return out
