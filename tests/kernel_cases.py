"""Inputs for the kernel ops (`kvmesh.kernels.torch_ops` API), shared by the kernel tests and bench.

Every builder returns a dict of keyword arguments for one op, so `op(**case)` runs either
implementation. Batches are ragged: sequence b has `seq_lens[b]` tokens and queries at its
last `n_queries[b]` positions (1 = decode, more = a prefill chunk). Paged caches use a
shuffled block order, hold a few spare garbage blocks, and pad block tables with -1.
"""
from __future__ import annotations

import torch


def _values(shape, dtype, device, gen, integer: bool) -> torch.Tensor:
    if integer:  # small integers: every score is exact in fp32, so ties are exact too
        return torch.randint(-2, 3, shape, generator=gen).to(dtype).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def paged_cache(entries: list[int], epb: int, dim: int, dtype, device, gen, integer=False,
                spare_blocks: int = 2):
    """-> (cache [NB, epb, dim], block_table [B, MB] int32, lengths [B] int64)."""
    per_seq = [(e + epb - 1) // epb for e in entries]
    n_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(n_blocks, generator=gen)
    table = torch.full((len(entries), max(max(per_seq), 1) + 1), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = order[used:used + nb].int()
        used += nb
    cache = _values((n_blocks, epb, dim), dtype, device, gen, integer)
    return cache, table.to(device), torch.tensor(entries, dtype=torch.long, device=device)


def ragged_queries(seq_lens: list[int], n_queries: list[int], device):
    """-> (q_pos [T], q_seq [T]): the last n_queries[b] positions of each sequence."""
    pos = [torch.arange(s - n, s) for s, n in zip(seq_lens, n_queries)]
    seq = [torch.full((n,), b) for b, n in enumerate(n_queries)]
    return torch.cat(pos).to(device), torch.cat(seq).to(device)


def _window(seq_lens, n_queries, window, dim, dtype, device, gen):
    """Window rows as the engine lays them out: consecutive positions (the last ones before the
    chunk, then the chunk) starting at a random row, every other row empty (-1)."""
    rows = window + max(n_queries) - 1 + 3          # +3 rows that stay empty
    win_pos = torch.full((len(seq_lens), rows), -1, dtype=torch.long)
    for b, (s, n) in enumerate(zip(seq_lens, n_queries)):
        keep = torch.arange(max(0, s - n - window + 1), s)
        at = int(torch.randint(0, rows - len(keep) + 1, (1,), generator=gen))
        win_pos[b, at:at + len(keep)] = keep
    return _values((len(seq_lens), rows, dim), dtype, device, gen, False), win_pos.to(device)


def _picks(q_seq, entries, topk, gen) -> torch.Tensor:
    """Distinct random picks per query among all of its sequence's entries, -1 padded; picks
    past a query's causal limit are included on purpose (the op must drop them)."""
    out = torch.full((len(q_seq), topk), -1, dtype=torch.long)
    for t, b in enumerate(q_seq.tolist()):
        p = torch.randperm(entries[b], generator=gen)[:topk]
        out[t, torch.randperm(topk, generator=gen)[:len(p)]] = p
    return out


def attention_case(seq_lens, n_queries, heads, head_dim, *, mode, window=16, ratio=4, epb=4,
                   topk=8, dtype=torch.float32, device="cpu", seed=0) -> dict:
    """mode: 'swa' (no compressed cache), 'hca' (all visible entries) or 'csa' (top-k picks)."""
    gen = torch.Generator().manual_seed(seed)
    q_pos, q_seq = ragged_queries(seq_lens, n_queries, device)
    win_kv, win_pos = _window(seq_lens, n_queries, window, head_dim, dtype, device, gen)
    entries = [s // ratio for s in seq_lens]
    comp_cache = block_table = comp_len = topk_idx = None
    if mode != "swa":
        comp_cache, block_table, comp_len = paged_cache(entries, epb, head_dim, dtype, device, gen)
    if mode == "csa":
        topk_idx = _picks(q_seq.cpu(), entries, topk, gen).to(device)
    return dict(q=_values((len(q_pos), heads, head_dim), dtype, device, gen, False),
                q_pos=q_pos, q_seq=q_seq, win_kv=win_kv, win_pos=win_pos, comp_cache=comp_cache,
                block_table=block_table, comp_len=comp_len, topk_idx=topk_idx,
                sinks=torch.randn(heads, generator=gen).to(device), scale=head_dim ** -0.5,
                window=window, ratio=ratio)


def compressor_case(n_windows, m, d, *, overlap, with_prev, rope_dim=64, dtype=torch.float32,
                    device="cpu", seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = 2 * d if overlap else d
    prev = with_prev and overlap
    angles = torch.rand(n_windows, rope_dim // 2, generator=gen) * 6.0
    return dict(kv=_values((n_windows, m, width), dtype, device, gen, False),
                gate=_values((n_windows, m, width), dtype, device, gen, False),
                ape=_values((m, width), dtype, device, gen, False),
                prev_kv=_values((m, d), dtype, device, gen, False) if prev else None,
                prev_gate=_values((m, d), dtype, device, gen, False) if prev else None,
                norm_weight=(torch.rand(d, generator=gen) + 0.5).to(device), eps=1e-6,
                cos=angles.cos().to(device), sin=angles.sin().to(device), overlap=overlap)


def indexer_case(seq_lens, n_queries, heads, head_dim, *, ratio=4, epb=4, topk=8,
                 dtype=torch.float32, device="cpu", seed=0, integer=False) -> dict:
    """integer=True: small-integer q/keys, weights in multiples of 1/8, scale 1/4, so scores
    are exact and tie often; the picks must then equal the reference's exactly."""
    gen = torch.Generator().manual_seed(seed)
    q_pos, q_seq = ragged_queries(seq_lens, n_queries, device)
    key_cache, block_table, key_len = paged_cache([s // ratio for s in seq_lens], epb, head_dim,
                                                  dtype, device, gen, integer)
    t = len(q_pos)
    if integer:
        weights = torch.randint(-8, 9, (t, heads), generator=gen).float() / 8
    else:
        weights = torch.randn(t, heads, generator=gen) * heads ** -0.5
    return dict(q=_values((t, heads, head_dim), dtype, device, gen, integer),
                weights=weights.to(device), q_pos=q_pos, q_seq=q_seq, key_cache=key_cache,
                block_table=block_table, key_len=key_len, ratio=ratio, topk=topk,
                scale=0.25 if integer else head_dim ** -0.5)


# --- ahead-of-time compile check (no GPU needed) --------------------------------------------
_FLOAT_ARGS = ("scale", "eps")


def _signature(kernel, pointers: dict, constexprs: dict) -> dict:
    def kind(a):
        if a in constexprs:
            return "constexpr"
        if a.endswith("_ptr"):
            return pointers[a]          # every pointer's dtype must be spelled out
        return "fp32" if a in _FLOAT_ARGS else "i32"
    return {a: kind(a) for a in kernel.arg_names}


def compile_kernels_for_cuda(arch: int = 90) -> list[str]:
    """Compile every kernel variant to a cubin for sm_{arch} with Triton's bundled ptxas.

    Catches what the interpreter accepts but the compiler rejects (non-constexpr globals,
    dtype mismatches in dots, ...). Needs a process where TRITON_INTERPRET is unset.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvmesh.kernels import triton_attention as ta, triton_compressor as tc, triton_indexer as ti
    from kvmesh.kernels.triton_common import attention_config

    done = []

    def build(kernel, pointers, constexprs, num_warps):
        src = ASTSource(kernel, _signature(kernel, pointers, constexprs), constexprs)
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
        done.append(f"{kernel.fn.__name__}{constexprs}")

    for dt, tdt in (("bf16", tl.bfloat16), ("fp32", tl.float32)):
        attn_ptrs = dict(q_ptr=f"*{dt}", win_kv_ptr=f"*{dt}", comp_ptr=f"*{dt}", out_ptr=f"*{dt}",
                         q_pos_ptr="*i64", q_seq_ptr="*i64", win_pos_ptr="*i64", win_first_ptr="*i64",
                         comp_len_ptr="*i64",
                         topk_ptr="*i64", bt_ptr="*i32", sinks_ptr="*fp32")
        for dim, has_topk in ((64, True), (512, False)) if dt == "bf16" else ((128, True),):
            bh, bn, bd, warps = attention_config(128, dim)
            build(ta._sparse_attn_kernel, attn_ptrs,
                  dict(D=dim, EPB=32, HAS_COMP=True, HAS_TOPK=has_topk, OUT_DT=tdt,
                       IEEE=dt == "fp32", BLOCK_H=bh, BLOCK_N=bn, BLOCK_D=bd), warps)
        comp_ptrs = {p: f"*{dt}" for p in ("kv_ptr", "gate_ptr", "ape_ptr", "prev_kv_ptr",
                                            "prev_gate_ptr", "out_ptr")}
        comp_ptrs.update(norm_w_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32")
        build(tc._compress_kernel, comp_ptrs, dict(d=512, OVERLAP=True, HAS_PREV=True, K_DT=tdt,
                                                   G_DT=tdt, BLOCK_M=16, BLOCK_D=512), 8)
        idx_ptrs = dict(q_ptr=f"*{dt}", key_ptr=f"*{dt}", w_ptr="*fp32", out_ptr="*fp32",
                        q_pos_ptr="*i64", q_seq_ptr="*i64", key_len_ptr="*i64", bt_ptr="*i32")
        build(ti._indexer_scores_kernel, idx_ptrs, dict(Di=128, EPB=32, IEEE=dt == "fp32",
                                                        BLOCK_H=64, BLOCK_E=64, BLOCK_D=128), 4)
    return done
