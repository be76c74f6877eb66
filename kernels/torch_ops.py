"""Plain-torch implementations of V4's three hot attention ops; the reference for kernels.

These are the CPU path and the ground truth the Triton kernels are tested against.
All three take a *ragged batch*: T query tokens from B sequences, each token tagged with
its sequence (`q_seq`) and absolute position (`q_pos`). The classical cache is *paged*:
`cache[block, slot, dim]`, and sequence b's entry e lives at
`cache[block_table[b, e // entries_per_block], e % entries_per_block]`.

Visibility rules (identical to transformers' DeepseekV4):
  * window key at position k is visible to query q iff  q - window < k <= q
  * compressed entry e (covering tokens [e*ratio, (e+1)*ratio)) is visible iff
    e < (q + 1) // ratio, and, when `topk_idx` is given, e is among the query's picks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


FEW_ROWS = 4     # up to this many queries per sequence, the indexer scores them in one batched call


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                 max_entries: int | None = None) -> torch.Tensor:
    """[NB, EPB, D] paged cache -> [B, Emax, D] dense (rows past lengths[b] are garbage).
    Emax = max(lengths), or the host-known bound `max_entries` (no read-back of lengths)."""
    epb = cache.shape[1]
    if max_entries is not None:
        emax = min(max_entries, block_table.shape[1] * epb)
    else:
        emax = int(lengths.max().item()) if lengths.numel() else 0
    nblk = (emax + epb - 1) // epb
    if nblk == 0:
        return cache.new_zeros(block_table.shape[0], 0, cache.shape[-1])
    blocks = block_table[:, :nblk].clamp(min=0).long()
    pages = cache.index_select(0, blocks.reshape(-1))         # whole pages (faster than cache[blocks])
    return pages.reshape(block_table.shape[0], nblk * epb, -1)[:, :emax]


def window_rows(q_pos: torch.Tensor, q_seq: torch.Tensor, win_pos: torch.Tensor, window: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query, the `window` rows of its sequence's win_kv that can hold positions
    (q - window, q], and whether each row really holds that position.

    win_kv rows of one sequence are consecutive positions (some marked -1 = empty), so the
    first row's position is recovered as max(win_pos[b, j] - j)."""
    j = torch.arange(win_pos.shape[1], device=win_pos.device)
    first = torch.where(win_pos >= 0, win_pos - j, torch.iinfo(win_pos.dtype).min).amax(dim=1)   # [B]
    want = q_pos.unsqueeze(1) - window + 1 + torch.arange(window, device=q_pos.device)   # [T, W]
    rows = (want - first[q_seq].unsqueeze(1)).clamp(0, win_pos.shape[1] - 1)
    valid = (win_pos[q_seq.unsqueeze(1), rows] == want) & (want >= 0)
    return rows, valid


def sparse_attention(
    q: torch.Tensor,            # [T, H, D]
    q_pos: torch.Tensor,        # [T] int64 absolute positions
    q_seq: torch.Tensor,        # [T] int64 sequence index in [0, B)
    win_kv: torch.Tensor,       # [B, W, D] window K=V per sequence (consecutive positions, padded)
    win_pos: torch.Tensor,      # [B, W] int64 positions of win_kv rows, -1 = empty
    comp_cache: torch.Tensor | None,   # [NB, EPB, D] paged compressed entries, or None (SWA layer)
    block_table: torch.Tensor | None,  # [B, MB] int32
    comp_len: torch.Tensor | None,     # [B] int64 entries per sequence
    topk_idx: torch.Tensor | None,     # [T, K] int64 picks (-1 = none); None = all visible
    sinks: torch.Tensor,        # [H] fp32 per-head sink logit
    scale: float,
    window: int,
    ratio: int,
    max_entries: int | None = None,    # host-known bound on comp_len (skips reading it back)
    decode: bool = False,       # one query per sequence (q_seq = arange(B)) at its last win_kv row
    win_rows: torch.Tensor | None = None,    # [T, W] window_rows(q_pos, q_seq, win_pos, window), when the
    win_valid: torch.Tensor | None = None,   # caller built them once for every layer ([T, W] bool)
) -> torch.Tensor:
    """Softmax attention over the SWA window plus the visible compressed entries, with a
    per-head sink in the denominator. Returns [T, H, D] in q's dtype.

    Each query gathers only what it may see: its `window` window rows, and either its
    top-k picks (CSA) or its sequence's entries (HCA). A decode query's window rows are
    its sequence's last `window` rows, in order: no gather."""
    if decode:
        keys, mask = win_kv[:, -window:], win_pos[:, -window:] >= 0
    else:
        rows, mask = (win_rows, win_valid) if win_rows is not None else window_rows(q_pos, q_seq, win_pos, window)
        keys = win_kv[q_seq.unsqueeze(1), rows]                             # [T, W, D]
    n_entries = None if comp_len is None else (
        max_entries if max_entries is not None else int(comp_len.max().item()))
    if comp_cache is not None and n_entries:
        visible = torch.minimum((q_pos + 1) // ratio, comp_len[q_seq]).unsqueeze(1)
        if topk_idx is not None:       # the picks straight from their pages
            idx = topk_idx.clamp(min=0)
            epb = comp_cache.shape[1]
            flat = block_table[q_seq.unsqueeze(1), idx // epb].clamp(min=0).long() * epb + idx % epb
            entries = comp_cache.reshape(-1, comp_cache.shape[-1]).index_select(0, flat.reshape(-1)) \
                .view(*flat.shape, -1)                                              # [T, K, D]
            cmask = (topk_idx >= 0) & (topk_idx < visible)
        else:
            comp = gather_paged(comp_cache, block_table, comp_len, n_entries)   # [B, E, D]
            entries = comp if decode else comp[q_seq]                       # [T, E, D]
            cmask = torch.arange(comp.shape[1], device=q.device) < visible
        keys = torch.cat([keys, entries], dim=1)
        mask = torch.cat([mask, cmask], dim=1)
    scores = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)


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
) -> torch.Tensor:
    """Softmax-gated pooling of each closed window -> RMSNorm -> RoPE. Returns [N, d].

    With `overlap` (CSA), entry w pools | Ca of window w-1 (m slots) | Cb of window w (m slots) |
    where Ca = channels [:d], Cb = channels [d:]; window 0 takes Ca from `prev_*`
    (or gets zero weight when there is none). With per-window `prev_*` [N, m, d] every window
    takes its Ca half from there (windows of several sequences in one call).
    """
    from .rope import apply_rope

    gate = gate + ape
    n, m, width = kv.shape
    if overlap:
        d = width // 2
        pool_kv = kv.new_zeros(n, 2 * m, d)
        pool_gate = gate.new_full((n, 2 * m, d), float("-inf"))
        pool_kv[:, m:], pool_gate[:, m:] = kv[..., d:], gate[..., d:]
        if prev_kv is not None and prev_kv.dim() == 3:
            pool_kv[:, :m], pool_gate[:, :m] = prev_kv.to(kv.dtype), prev_gate.to(gate.dtype)
        else:
            pool_kv[1:, :m], pool_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        if prev_kv is not None and prev_kv.dim() == 2:
            pool_kv[0, :m], pool_gate[0, :m] = prev_kv.to(kv.dtype), prev_gate.to(gate.dtype)
        kv, gate = pool_kv, pool_gate
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    x = pooled.float()
    normed = (norm_weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(kv.dtype)
    return apply_rope(normed, cos, sin)


def indexer_scores(
    q: torch.Tensor,            # [T, Hi, Di] rope'd indexer queries
    weights: torch.Tensor,      # [T, Hi] per-head weights (already scaled by Hi^-0.5)
    keys: torch.Tensor,         # [T, E, Di] keys visible to each query's sequence
    scale: float,
) -> torch.Tensor:
    """sum_h w[t,h] * relu(q[t,h] . k[e]) * scale -> [T, E] fp32."""
    s = F.relu(torch.einsum("thd,ted->the", q.float(), keys.float())) * scale
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


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
    decode: bool = False,             # one query per sequence (q_seq = arange(B)): no gathers
) -> torch.Tensor:
    """Lightning-indexer top-k: [T, topk] int64 entry indices, -1 where fewer are visible.

    Ties are broken toward the lower entry index (a stable sort), so the picks do not
    depend on batch composition or on how a prompt was chunked.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    n_entries = max_entries if max_entries is not None else (int(key_len.max().item()) if q.shape[0] else 0)
    if q.shape[0] == 0 or n_entries == 0:
        return out
    keys = gather_paged(key_cache, block_table, key_len, n_entries)        # [B, E, Di]
    if decode:                            # rows: (query rows, their keys, their key counts)
        groups = [(slice(None), keys, key_len)]
    elif q.shape[0] <= FEW_ROWS * keys.shape[0]:   # a few queries per sequence (a speculative verify
        groups = [(slice(None), keys[q_seq], key_len[q_seq])]   # step): one batched call, keys per query
    else:      # every one-query sequence in one batched call; each prefill chunk against its own keys
        segments = _segments(q_seq)
        singles = [rows for rows in segments if rows.numel() == 1]
        groups = [(rows, keys[q_seq[rows]], key_len[q_seq[rows]]) for rows in
                  ([torch.cat(singles)] if singles else [])]
        for rows in segments:
            if rows.numel() > 1:
                b = int(q_seq[rows[0]])
                groups.append((rows, keys[b, :int(key_len[b])].unsqueeze(0).expand(rows.numel(), -1, -1),
                               key_len[b]))
    for rows, kk, lim in groups:
        scores = indexer_scores(q[rows], weights[rows], kk, scale)          # [n, E]
        limit = torch.minimum((q_pos[rows] + 1) // ratio, lim)
        visible = torch.arange(scores.shape[1], device=q.device).unsqueeze(0) < limit.unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(topk, scores.shape[1])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        out[rows, :k] = torch.where(order < limit.unsqueeze(1), order, torch.full_like(order, -1))
    return out


def _segments(q_seq: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each run of equal sequence ids (queries are grouped by sequence)."""
    _, counts = torch.unique_consecutive(q_seq, return_counts=True)
    return list(torch.arange(q_seq.numel(), device=q_seq.device).split(counts.tolist()))
