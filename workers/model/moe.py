"""V4 mixture of experts: stacked routed experts (grouped matmul runs), the hash or top-k
gate, and the shared expert. Kept next to the quantized experts they share a layout with.

Shapes: T = tokens in the step, E = routed experts (this rank's), I = intermediate, C = hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .expert_map import ExpertMap
from .layers import linear
from .quant import local_experts
from .shard import SINGLE, Shard

EXCHANGE_COLLECTIVES = 3     # per MoE layer under data-parallel attention: counts, rows, partial sums


def split_rows(n: int, parts: int) -> list[int]:
    """`n` rows in `parts` contiguous shares, the first n % parts one row longer."""
    return [n // parts + (i < n % parts) for i in range(parts)]


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
    summed by one all-reduce for both (see `Shard`). Under data-parallel attention the routed
    experts run on every rank's tokens (`exchanged`) and the shared expert on this rank's."""

    def __init__(self, args: ModelArgs, hashed: bool, shard: Shard = SINGLE):
        super().__init__()
        self.shard = shard
        e, inter = args.n_routed_experts, args.moe_intermediate_size
        self.gate = Gate(args, hashed)
        owned = shard.physical_experts() or shard.owned_experts(e)
        self.placement = ExpertMap(shard.placement, e, shard.dp_size) if shard.placement is not None else None
        if owned is not None:
            first, count = owned
            self.experts = Experts(count, args.hidden_size, inter, args.swiglu_limit, first)
        else:
            self.experts = Experts(e, args.hidden_size, shard.part(inter), args.swiglu_limit)
        shared = shard.part(inter) if shard.split_shared else inter
        self.shared_experts = SharedExpert(args.hidden_size, shared, args.swiglu_limit)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.shard.grouped:
            return self.grouped(x, tokens)
        w, idx = self.gate(x, tokens)
        y = self.exchanged(x, idx, w) if self.shard.dp_size > 1 else self.experts(x, idx, w)
        if self.shard.split_shared or self.shard.rank == 0:      # a replicated shared expert counts once
            y = y + self.shared_experts(x)
        return self.shard.comm.all_reduce(y)

    def grouped(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism inside a data-parallel rank: every rank of the group holds the
        group's tokens x [T, C]; rank t routes and exchanges its contiguous share of them (T split
        as evenly as it goes: a rank gets none when T < the group's size, and still joins the
        exchange) and writes their routed output into its rows of a [T, C] partial; the shared
        expert, split by the group like the attention, adds its partial output for every row (a
        shared expert the loader had to replicate, since a cut would split an FP8 scale block,
        adds its whole output on the rank's own rows only); one all-reduce in the group sums them,
        as the plain TP layer's does."""
        comm = self.shard.comm
        counts = split_rows(x.shape[0], comm.size)
        start, n = sum(counts[:comm.rank]), counts[comm.rank]
        mine = x[start:start + n]
        w, idx = self.gate(mine, tokens[start:start + n])
        routed = self.exchanged(mine, idx, w)
        if self.shard.split_shared:
            y = self.shared_experts(x)
            y[start:start + n] += routed
        else:
            y = torch.zeros_like(x)
            y[start:start + n] = routed + self.shared_experts(mine)
        return comm.all_reduce(y)

    def exchanged(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention: the routed experts' output for this rank's tokens x [T, C].
        Every rank's tokens and picks are all-gathered (with their counts; one row of bytes per
        token: | x (C values) | expert ids (K, fp32) | weights (K, fp32) |), this rank's experts
        run on all of them, the partial outputs are summed over the ranks (all-reduce) and this
        rank keeps its own rows. A rank with no tokens takes part with T = 0 (`idle`). With EPLB
        each pick goes to one replica of its expert (`placement`: model/expert_map.py)."""
        ex = self.shard.exchange
        counts = ex.all_counts(x.shape[0])
        k, width = idx.shape[1], x.shape[1] * x.element_size()
        picks = torch.cat([idx.to(torch.float32), w.float()], 1)        # expert ids are exact in fp32
        rows = ex.all_gather_rows(torch.cat([x.contiguous().view(torch.uint8), picks.view(torch.uint8)], 1), counts)
        xs, ps = rows[:, :width].contiguous().view(x.dtype), rows[:, width:].contiguous().view(torch.float32)
        picks = ps[:, :k].long()
        if self.placement is not None:
            picks = self.placement.route(picks)
        y = ex.all_reduce(self.experts(xs, picks, ps[:, k:].to(w.dtype)))
        start = sum(counts[:ex.rank])
        return y[start:start + x.shape[0]]

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """This rank has no tokens this step: take part in the exchange with none."""
        k, c = self.gate.topk, self.gate.weight.shape[1]
        self.exchanged(torch.zeros(0, c, dtype=dtype, device=device), torch.zeros(0, k, dtype=torch.long, device=device),
                       torch.zeros(0, k, dtype=dtype, device=device))
