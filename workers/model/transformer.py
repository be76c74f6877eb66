"""DeepSeek-V4 in torch, over a ragged batch with kvmesh's heterogeneous cache.

Module and parameter names follow the upstream checkpoint (`layers.N.attn.wq_a`,
`...attn.compressor.wkv`, `...attn.indexer.wq_b`, `...ffn.experts` (stacked), `hc_head_fn`,
`head`), so loading is a rename-free copy. The attention, compressor-pooling and indexer
math goes through `kernels` (torch or Triton, same API).

Shapes: T = tokens in the step (all sequences concatenated), B = sequences, D = head_dim,
H = attention heads, N = hc_mult streams, C = hidden_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels import KernelOps, get_ops
from kvmesh.kernels.hc_mix import hc_mix
from kvmesh.kvstore.device.cache_tensors import CacheTensors, LayerCache

from .args import SWA, ModelArgs
from .attention import Attention
from .layers import PositionRope, RMSNorm, linear, make_ropes, rms_norm
from .moe import MoE
from .shard import SINGLE, Shard
from .step import StepInput


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

    def mix(self, x: torch.Tensor, site: str, sublayer, rows: torch.Tensor | None = None) -> torch.Tensor:
        """mHC around `sublayer`: its input collapsed from every row's streams; it returns the rows
        `rows` (default all), whose new streams come back."""
        pre, post, comb = hc_weights(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                                     getattr(self, f"hc_{site}_scale"), self.args)
        collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
        y = sublayer(collapsed)
        if rows is not None:
            x, post, comb = x[rows], post[rows], comb[rows]
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
                cache: LayerCache, ropes, ops, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Main-model streams [T, N, C] at step.positions and each position's next token [T]
        -> this layer's streams [T, N, C] (which predict the token after the next one), or with
        `rows` (a step that is not a decode step) [len(rows), N, C] of those rows: every row's
        K=V still goes to the layer's window ring, but the attention output, the MoE and the
        mHC mixing after the attention run for `rows` only (a draft needs one row per sequence)."""
        e = self.e_proj(self.enorm(embed(next_tokens)))
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(streams))
        pos_rope = {"main": ropes["main"](step.positions, x.dtype)}     # a sliding-window block: main RoPE only
        if rows is None:
            return super().forward(x, step, cache, ropes, pos_rope, ops)
        x = self.mix(x, "attn", lambda h: self.attn(self.attn_norm(h), step, cache, ropes, pos_rope, ops, rows), rows)
        return self.mix(x, "ffn", lambda h: self.ffn(self.ffn_norm(h), next_tokens[rows]))


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

    @torch.inference_mode()
    def idle(self) -> None:
        """Data-parallel attention: a rank with nothing to run this step still takes part in
        every MoE layer's exchange (an empty batch), so the other ranks never wait for it."""
        w = self.embed.weight
        for layer in self.layers:
            layer.ffn.idle(w.dtype, w.device)

    def logits(self, x: torch.Tensor, head_of: nn.Module) -> torch.Tensor:
        """Streams [R, N, C] -> fp32 logits [R, vocab] through `head_of`'s mHC head and final
        norm (the main model's or an MTP layer's) and the vocabulary head."""
        flat = rms_norm(x.flatten(1).float(), None, self.args.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, head_of.hc_head_fn.float()) * head_of.hc_head_scale.float()
                            + head_of.hc_head_base.float()) + self.args.hc_eps
        h = head_of.norm((pre.unsqueeze(-1) * x).sum(1).to(x.dtype))
        return self.shard.comm.all_gather_last(self.head(h).float())
