"""DeepSeek-V4 in torch, over a ragged batch with kvmesh's heterogeneous cache.

Module and parameter names follow the upstream checkpoint (`layers.N.attn.wq_a`,
`...attn.compressor.wkv`, `...attn.indexer.wq_b`, `...ffn.experts` (stacked), `hc_head_fn`,
`head`), so loading is a rename-free copy. The attention, compressor-pooling and indexer
math goes through `kernels` (torch or Triton, same API).

Shapes: T = tokens in the step (all sequences concatenated), B = sequences, D = head_dim,
H = attention heads, N = hc_mult streams, C = hidden_size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps, get_ops
from kernels.hc_mix import hc_mix
from kernels.rope import apply_rope
from kvstore.cache_tensors import CacheTensors, CompressorCache, LayerCache

from .collectives import SingleRank
from .config import CSA, HCA, SWA, ModelArgs, RopeArgs
from .quant import grouped_linear, local_experts
from .step import StepInput


PositionRope = dict[str, tuple[torch.Tensor, torch.Tensor]]   # rope type -> (cos, sin) at step.positions


@dataclass
class Shard:
    """This rank's part of a tensor-parallel model, as DeepSeek's reference splits it: query
    heads, output groups, sinks (wq_b column-, wo_a group-, wo_b row-parallel), the vocabulary
    (embedding and head), and the routed experts (whole experts with `expert_parallel`, else
    each expert's intermediate dim) are split in `size` parts; the shared expert is split like
    the experts' intermediate dim when `split_shared`, else replicated and counted on rank 0
    only; everything else (wq_a, wkv, compressor, indexer, router, mHC, norms) is replicated.
    Each sublayer's partial output is summed by one all-reduce (`comm`)."""
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    split_shared: bool = True
    comm: SingleRank = field(default_factory=SingleRank, compare=False, repr=False)

    def part(self, n: int) -> int:
        return n // self.size


SINGLE = Shard()


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
            if plan.padded:   # every row to its own window's entry, invisible until that window closes
                w, b = plan.index, plan.seq
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
        """Per sequence: | ring rows for [start-W+1, start) | this step's rows | -> [B, W-1+n_max, D].
        A decode step reads all W rows from the ring, its token already written there."""
        w, starts, slots = self.window, step.starts, step.slots
        if step.decode:
            pos = starts.unsqueeze(1) - (w - 1) + torch.arange(w, device=starts.device)   # [B, W], token last
            return rows_of(ring, slots.unsqueeze(1) * w + pos % w), torch.where(pos >= step.ring_from.unsqueeze(1), pos, -1)
        back = torch.arange(w - 1, device=starts.device)
        old_pos = starts.unsqueeze(1) - (w - 1) + back                       # [B, W-1]
        old = rows_of(ring, slots.unsqueeze(1) * w + old_pos % w)
        old_pos = torch.where(old_pos >= step.ring_from.unsqueeze(1), old_pos, -1)
        n_max = step.longest
        j = torch.arange(n_max, device=starts.device)
        rows = (step.cu[:-1].unsqueeze(1) + j).clamp(max=kv.shape[0] - 1)
        new_pos = torch.where(j < step.lengths.unsqueeze(1), starts.unsqueeze(1) + j, -1)
        return torch.cat([old, kv[rows]], 1), torch.cat([old_pos, new_pos], 1)

    def forward(self, x: torch.Tensor, step: StepInput, cache: LayerCache, ropes: dict[str, Rope],
                pos_rope: PositionRope, ops: KernelOps) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = pos_rope["main" if self.layer_type == SWA else "compress"]
        q_res = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(q_res).view(t, self.n_heads, self.head_dim), None, self.args.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)
        if step.decode:     # the token goes to the ring first: the window is then read from there alone
            cache.append_kv(step, kv)
            win_kv, win_pos = self.window_kv(kv, step, cache.ring)
        else:
            win_kv, win_pos = self.window_kv(kv, step, cache.ring)
            cache.append_kv(step, kv)
        topk = comp_len = None
        if self.compressor is not None:
            self.compressor.update(x, step, cache.compressor, ropes["compress"], ops)
            comp_len = (step.starts + step.lengths) // self.ratio
        if self.indexer is not None:
            topk = self.indexer(x, q_res, step, cache, ropes["compress"], pos_rope["compress"], ops)
        comp, table = cache.compressor.paged(step.block_table, x.dtype) if self.compressor else (None, step.block_table)
        out = ops.sparse_attention(q, step.positions, step.q_seq, win_kv, win_pos, comp,
                                   table, comp_len, topk, self.attn_sink,
                                   self.head_dim ** -0.5, self.window, max(self.ratio, 1),
                                   max_entries=step.entry_bound(self.ratio) if self.compressor else None,
                                   decode=step.decode)
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(t, self.n_groups, -1)                           # [T, G, H*D/G]
        partial = self.wo_b(grouped_linear(self.wo_a, grouped))               # wo_a: [G*R, H*D/G]
        return self.shard.comm.all_reduce(partial)                            # the sublayer's one collective


class Experts(nn.Module):
    """Routed experts stacked: w1/w3 [E, I, C] (gate/up), w2 [E, C, I] (down). Under tensor
    parallelism E is this rank's experts [first, first + E) (expert parallelism) or I its
    part of every expert's intermediate dim; forward returns the rank's partial sum."""

    def __init__(self, n: int, dim: int, inter: int, limit: float, first: int | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(n, inter, dim))
        self.w2 = nn.Parameter(torch.zeros(n, dim, inter))
        self.w3 = nn.Parameter(torch.zeros(n, inter, dim))
        self.limit, self.first = limit, first

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, C], idx/weights [T, K] -> [T, C]. The (token, pick) rows are sorted by expert
        and run as one grouped matmul per projection (a fixed op count whatever T is)."""
        idx = local_experts(idx, self.first, self.w1.shape[0])
        if not grouped_mm_runs(x):
            return self.forward_looped(x, idx, weights)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        if self.first is not None:                       # picks other ranks own sort first: drop them
            order, flat = order[int((flat < 0).sum()):], flat[flat >= 0]
        tok = order // idx.shape[1]
        counts = flat.new_zeros(self.w1.shape[0]).scatter_add_(0, flat, torch.ones_like(flat))   # no host sync
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x.index_select(0, tok)
        h = swiglu(F.grouped_mm(xs, self.w1.transpose(1, 2), offs=offs),
                   F.grouped_mm(xs, self.w3.transpose(1, 2), offs=offs), self.limit)
        y = F.grouped_mm(h, self.w2.transpose(1, 2), offs=offs) * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def forward_looped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            if e < 0:
                continue
            tok, k = torch.where(idx == e)
            h = swiglu(F.linear(x[tok], self.w1[e]), F.linear(x[tok], self.w3[e]), self.limit)
            out.index_add_(0, tok, (F.linear(h, self.w2[e]) * weights[tok, k, None]).to(out.dtype))
        return out


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """F.grouped_mm takes any float dtype on CPU; on CUDA only bf16 on sm90+ (untested here)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3, self.limit = linear(dim, inter), linear(inter, dim), linear(dim, inter), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__()
        self.hashed, self.topk, self.args = hashed, args.num_experts_per_tok, args
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        fn = self.args.scoring_func
        scores = (F.softplus(logits).sqrt() if fn == "sqrtsoftplus"
                  else logits.softmax(-1) if fn == "softmax" else logits.sigmoid())
        if self.hashed:
            idx = self.tid2eid[tokens].long()
        else:
            idx = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.args.routed_scaling_factor, idx


class MoE(nn.Module):
    """The router is replicated; routed and shared experts give this rank's partial output,
    summed by one all-reduce for both (see `Shard`)."""

    def __init__(self, args: ModelArgs, hashed: bool, shard: Shard = SINGLE):
        super().__init__()
        self.shard = shard
        e, inter = args.n_routed_experts, args.moe_intermediate_size
        self.gate = Gate(args, hashed)
        if shard.expert_parallel:
            first = shard.rank * shard.part(e)
            self.experts = Experts(shard.part(e), args.hidden_size, inter, args.swiglu_limit, first)
        else:
            self.experts = Experts(e, args.hidden_size, shard.part(inter), args.swiglu_limit)
        shared = shard.part(inter) if shard.split_shared else inter
        self.shared_experts = SharedExpert(args.hidden_size, shared, args.swiglu_limit)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x, tokens)
        y = self.experts(x, idx, w)
        if self.shard.split_shared or self.shard.rank == 0:      # a replicated shared expert counts once
            y = y + self.shared_experts(x)
        return self.shard.comm.all_reduce(y)


def hc_weights(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC: (pre [T,N], post [T,N], comb [T,N,N] doubly stochastic) from the N streams [T,N,C]."""
    flat = rms_norm(x.flatten(1).float(), None, args.rms_norm_eps)
    mix = F.linear(flat, fn.float())
    return hc_mix(mix, base.float(), scale.float(), args.hc_mult, args.hc_eps, args.hc_sinkhorn_iters)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, mlp_type: str, shard: Shard = SINGLE):
        super().__init__()
        self.args = args
        n, c = args.hc_mult, args.hidden_size
        self.attn = Attention(args, layer_type, shard)
        self.ffn = MoE(args, mlp_type == "hash_moe", shard)
        self.attn_norm, self.ffn_norm = RMSNorm(c, args.rms_norm_eps), RMSNorm(c, args.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * c)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def mix(self, x: torch.Tensor, site: str, sublayer) -> torch.Tensor:
        pre, post, comb = hc_weights(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                                     getattr(self, f"hc_{site}_scale"), self.args)
        collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
        y = sublayer(collapsed)
        return post.to(x.dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(x.dtype).transpose(1, 2), x)

    def forward(self, x: torch.Tensor, step: StepInput, cache: LayerCache, ropes, pos_rope: PositionRope,
                ops) -> torch.Tensor:
        x = self.mix(x, "attn", lambda h: self.attn(self.attn_norm(h), step, cache, ropes, pos_rope, ops))
        return self.mix(x, "ffn", lambda h: self.ffn(self.ffn_norm(h), step.tokens))


class MTPLayer(Block):
    """Multi-token-prediction layer `mtp.N.*` as the release ships it: a sliding-window MoE
    block whose input is e_proj(enorm(embed(next token))) + h_proj(hnorm(main model streams)),
    with its own final norm and mHC head (the vocabulary head is the main model's). Loaded and
    kept with the model so a speculative-decoding draft can run it; the main forward does not."""

    def __init__(self, args: ModelArgs, shard: Shard = SINGLE):
        super().__init__(args, SWA, "moe", shard)
        n, c = args.hc_mult, args.hidden_size
        self.e_proj, self.h_proj = linear(c, c), linear(c, c)
        self.enorm, self.hnorm = RMSNorm(c, args.rms_norm_eps), RMSNorm(c, args.rms_norm_eps)
        self.norm = RMSNorm(c, args.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * c))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def predict(self, streams: torch.Tensor, next_tokens: torch.Tensor, embed: nn.Embedding, step: StepInput,
                cache: LayerCache, ropes, ops) -> torch.Tensor:
        """Main-model streams [T, N, C] at step.positions and each position's next token [T]
        -> this layer's streams [T, N, C] (which predict the token after the next one)."""
        e = self.e_proj(self.enorm(embed(next_tokens)))
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(streams))
        pos_rope = {name: rope(step.positions, x.dtype) for name, rope in ropes.items()}
        return super().forward(x, step, cache, ropes, pos_rope, ops)


def make_ropes(args: ModelArgs, device: str | torch.device = "cpu") -> nn.ModuleDict:
    """Plain RoPE for SWA layers, the compress RoPE (YaRN when configured) for CSA/HCA."""
    with torch.device(device):
        return nn.ModuleDict({"main": Rope(args.main_rope, args.rope_head_dim),
                              "compress": Rope(args.compress_rope, args.rope_head_dim)})


class ParallelEmbedding(nn.Embedding):
    """Vocabulary-parallel embedding: this rank holds rows [first, first + V/N); tokens outside
    them embed to zero here and the all-reduce sums the one rank that has each."""

    def __init__(self, vocab: int, dim: int, shard: Shard = SINGLE):
        super().__init__(shard.part(vocab), dim)
        self.shard, self.first = shard, shard.rank * shard.part(vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return super().forward(tokens)
        local = tokens - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.shard.comm.all_reduce(x)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, kernel_backend: str = "auto", mtp_layers: int = 0, shard: Shard = SINGLE):
        super().__init__()
        self.args, self.shard = args, shard
        n, c = args.hc_mult, args.hidden_size
        self.embed = ParallelEmbedding(args.vocab_size, c, shard)
        self.layers = nn.ModuleList(Block(args, t, m, shard) for t, m in zip(args.layer_types, args.mlp_layer_types))
        self.mtp = nn.ModuleList(MTPLayer(args, shard) for _ in range(mtp_layers))
        self.norm = RMSNorm(c, args.rms_norm_eps)
        self.head = linear(c, shard.part(args.vocab_size))           # vocabulary-parallel rows
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * c))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.ropes = make_ropes(args)
        self.kernel_backend = kernel_backend

    @property
    def ops(self) -> KernelOps:
        return get_ops(self.kernel_backend, self.head.weight.device.type)

    @torch.inference_mode()
    def forward(self, step: StepInput, cache: CacheTensors, keep_streams: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Runs one step, updating `cache` in place; returns fp32 logits [R, vocab] for
        step.logits_at (and, with keep_streams, the last layer's streams [T, N, C] of every row)."""
        ops = self.ops
        x = self.embed(step.tokens)
        x = x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        pos_rope = {name: rope(step.positions, x.dtype) for name, rope in self.ropes.items()}   # once per step
        for layer, lc in zip(self.layers, cache.layers):
            x = layer(x, step, lc, self.ropes, pos_rope, ops)
        logits = self.logits(x[step.logits_at], self)
        return (logits, x) if keep_streams else logits

    def logits(self, x: torch.Tensor, head_of: nn.Module) -> torch.Tensor:
        """Streams [R, N, C] -> fp32 logits [R, vocab] through `head_of`'s mHC head and final
        norm (the main model's or an MTP layer's) and the vocabulary head."""
        flat = rms_norm(x.flatten(1).float(), None, self.args.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, head_of.hc_head_fn.float()) * head_of.hc_head_scale.float()
                            + head_of.hc_head_base.float()) + self.args.hc_eps
        h = head_of.norm((pre.unsqueeze(-1) * x).sum(1).to(x.dtype))
        return self.shard.comm.all_gather_last(self.head(h).float())
