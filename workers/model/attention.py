"""V4 attention: the compressor (CSA/HCA entries from windows of tokens), the lightning
indexer (CSA's top-k), and the attention itself over the SWA ring + compressed entries.
This is the only model code that touches cache views and the step's window plans.

Shapes: T = tokens in the step (all sequences concatenated), B = sequences, D = head_dim,
H = attention heads.
"""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels import KernelOps
from kvmesh.kernels.rope import apply_rope
from kvmesh.kvstore.device.cache_tensors import CompressorCache, LayerCache

from .args import CSA, HCA, SWA, ModelArgs
from .layers import PositionRope, RMSNorm, Rope, linear, rms_norm, rows_of
from .quant import grouped_linear
from .shard import SINGLE, Shard
from .step import StepInput


class Compressor(nn.Module):
    """Projects tokens into windows of `ratio` and pools each closed window to one entry."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.ratio, self.head_dim, self.overlap, self.eps = ratio, head_dim, overlap, eps
        self.wkv, self.wgate = linear(dim, width), linear(dim, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def update(self, x: torch.Tensor, step: StepInput, cache: CompressorCache, rope: Rope, ops: KernelOps) -> None:
        """Append this step's tokens to each sequence's tail, pool every window that closes,
        write the entries into the paged cache and update tails and overlap state: the whole
        batch at once, along the step's `WindowPlan`."""
        kv, gate = self.wkv(x), self.wgate(x)
        m, epb = self.ratio, cache.entries_per_block
        tail_kv, tail_gate = cache.tail_kv, cache.tail_gate
        plan = step.windows(m)
        if plan.count:
            win_kv, win_gate = plan.gather(kv, tail_kv), plan.gather(gate, tail_gate)   # [N, m, W]
            prev_kv = prev_gate = None
            if self.overlap:
                prev_kv, prev_gate = self.carry_overlap(win_kv, win_gate, plan, step, cache)
            cos, sin = rope(plan.index * m, x.dtype)
            entries = ops.compress_windows(win_kv, win_gate, self.ape, prev_kv, prev_gate,
                                           self.norm.weight, self.eps, cos, sin, self.overlap)
            if plan.padded or step.fresh:   # (padded: every row to its own window's entry, invisible until
                w, b = plan.index, plan.seq      # that window closes; fresh: no closed window was restored)
            else:
                w, b, entries = plan.index[plan.keep], plan.seq[plan.keep], entries[plan.keep]
            cache.write_entries(step.block_table[b, w // epb].long(), w % epb, entries)
        plan.write_tail(kv, tail_kv)
        plan.write_tail(gate, tail_gate)

    def carry_overlap(self, win_kv, win_gate, plan, step: StepInput, cache: CompressorCache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the Ca half before each window [N, m, d] (the slot's overlap state for a
        sequence's first window, the previous window's otherwise); the cache keeps the windows'
        Ca halves as the new state."""
        d = self.head_dim
        ovl_kv, ovl_gate = cache.ovl_kv, cache.ovl_gate
        slots = step.slots[plan.seq]
        ca_kv, ca_gate = win_kv[:, :, :d], win_gate[:, :, :d] + self.ape[:, :d].to(win_gate.dtype)
        first = plan.first.view(-1, 1, 1)
        prev = (torch.where(first, ovl_kv[slots], ca_kv.roll(1, 0)),
                torch.where(first, ovl_gate[slots], ca_gate.roll(1, 0)))
        cache.save_overlap(step, plan, ca_kv, ca_gate)
        return prev


class Indexer(nn.Module):
    """Lightning indexer: its own compressor at index_head_dim plus a scorer over its keys."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
        self.weights_proj = linear(args.hidden_size, args.index_n_heads)
        self.compressor = Compressor(args.hidden_size, args.index_head_dim, args.csa_ratio, True, args.rms_norm_eps)

    def forward(self, x, q_res, step: StepInput, cache: LayerCache, rope: Rope, cos_sin, ops: KernelOps
                ) -> torch.Tensor:
        self.compressor.update(x, step, cache.indexer, rope, ops)
        m = self.compressor.ratio
        cos, sin = cos_sin
        q = apply_rope(self.wq_b(q_res).view(x.shape[0], self.n_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        key_len = (step.starts + step.lengths) // m
        keys, table = cache.indexer.paged(step.block_table, x.dtype)
        return ops.indexer_topk(q, weights, step.positions, step.q_seq, keys, table,
                                key_len, m, self.topk, self.head_dim ** -0.5, max_entries=step.entry_bound(m),
                                decode=step.decode)


class Attention(nn.Module):
    """Under tensor parallelism this rank owns heads [r*H/N, (r+1)*H/N) (wq_b rows, sinks) and
    the output groups they feed (wo_a rows, wo_b columns); forward returns the rank's partial
    output, summed by the all-reduce at its end. wkv, the compressor and the indexer are
    replicated: the one K=V head and the cache are the same on every rank."""

    def __init__(self, args: ModelArgs, layer_type: str, shard: Shard = SINGLE):
        super().__init__()
        self.layer_type, self.args, self.shard = layer_type, args, shard
        h, d = shard.part(args.num_attention_heads), args.head_dim
        self.n_heads, self.head_dim, self.window = h, d, args.sliding_window
        self.n_groups = shard.part(args.o_groups)
        self.wq_a = linear(args.hidden_size, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = linear(args.q_lora_rank, h * d)
        self.wkv = linear(args.hidden_size, d)
        self.norm = RMSNorm(d, args.rms_norm_eps)
        self.wo_a = linear(h * d // self.n_groups, self.n_groups * args.o_lora_rank)
        self.wo_b = linear(self.n_groups * args.o_lora_rank, args.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.ratio = args.ratio(layer_type)
        self.compressor = self.indexer = None
        if layer_type in (CSA, HCA):
            self.compressor = Compressor(args.hidden_size, d, self.ratio, layer_type == CSA, args.rms_norm_eps)
        if layer_type == CSA:
            self.indexer = Indexer(args)

    def window_kv(self, kv: torch.Tensor, step: StepInput, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence: | ring rows for [start-W+1, start) | this step's rows | -> [B, W-1+n_max, D]
        and their positions (step.ring_window). A decode step reads all W rows from the ring, its
        token already written there."""
        rw = step.ring_window(self.window)
        old = rows_of(ring, rw.ring_rows)
        return (old if rw.step_rows is None else torch.cat([old, kv[rw.step_rows]], 1)), rw.positions

    def forward(self, x: torch.Tensor, step: StepInput, cache: LayerCache, ropes: dict[str, Rope],
                pos_rope: PositionRope, ops: KernelOps, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The output of every row of the step, or (`rows`, a sliding-window layer in a step that
        is not a decode step) of those rows only: the others' K=V still go to the cache."""
        cos, sin = pos_rope["main" if self.layer_type == SWA else "compress"]
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)
        q_pos, q_seq = step.positions, step.q_seq
        if rows is not None:
            if self.layer_type != SWA or step.decode:
                raise ValueError("output rows: only a sliding-window layer in a step that is not a decode step")
            x, cos, sin, q_pos, q_seq = x[rows], cos[rows], sin[rows], q_pos[rows], q_seq[rows]
        t = x.shape[0]
        q_res = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(q_res).view(t, self.n_heads, self.head_dim), None, self.args.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        if step.decode:     # the token goes to the ring first: the window is then read from there alone
            cache.append_kv(step, kv)
            win_kv, win_pos = self.window_kv(kv, step, cache.ring)
        else:
            win_kv, win_pos = self.window_kv(kv, step, cache.ring)
            cache.append_kv(step, kv)
        topk = comp_len = None
        rw = step.ring_window(self.window)
        if self.compressor is not None:
            self.compressor.update(x, step, cache.compressor, ropes["compress"], ops)
            comp_len = (step.starts + step.lengths) // self.ratio
        if self.indexer is not None:
            topk = self.indexer(x, q_res, step, cache, ropes["compress"], pos_rope["compress"], ops)
        comp, table = cache.compressor.paged(step.block_table, x.dtype) if self.compressor else (None, step.block_table)
        win_rows, win_valid = rw.query_rows, rw.query_valid
        if rows is not None:
            win_rows, win_valid = win_rows[rows], win_valid[rows]
        out = ops.sparse_attention(q, q_pos, q_seq, win_kv, win_pos, comp,
                                   table, comp_len, topk, self.attn_sink,
                                   self.head_dim ** -0.5, self.window, max(self.ratio, 1),
                                   max_entries=step.entry_bound(self.ratio) if self.compressor else None,
                                   decode=step.decode, win_rows=win_rows, win_valid=win_valid)
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(t, self.n_groups, -1)                           # [T, G, H*D/G]
        partial = self.wo_b(grouped_linear(self.wo_a, grouped))               # wo_a: [G*R, H*D/G]
        return self.shard.comm.all_reduce(partial)                            # the sublayer's one collective
