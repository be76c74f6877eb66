"""Sizing a replica before deploying it (`kvmesh plan`): weights per rank, KV bytes per
token, the tokens that fit, the largest context, and the TP / DP / EP sizes that divide the model.

A replica is `dp` data-parallel ranks of `tp` tensor-parallel ranks each (`dp` = 1: plain tensor
parallelism; `dp` > 1: data-parallel attention, DESIGN.md §9). How it holds the weights
(DeepSeek's reference sharding):

    split by TP      query heads (attn.wq_b, attn_sink), the grouped output projection
                     (attn.wo_a by group, attn.wo_b by its input), the shared expert (by its
                     intermediate size; the loader replicates it instead where a cut would split
                     an FP8 scale block, which V4's shapes never do up to 8 ranks; counted split
                     here), the embedding and the head (by vocabulary); with `dp` > 1 these
                     are split by the `tp` ranks inside one DP rank (its TP group) and replicated
                     across DP ranks
    routed experts   split over all tp x dp ranks: whole experts per rank with expert
                     parallelism, every expert's intermediate size split without it; 1/(tp x dp)
                     of the bytes either way (DP rows are planned with expert parallelism)
    replicated       wq_a, wkv, the norms, compressors and indexers, the router, mHC

The compressed KV is shared by all heads, so every TP rank holds the same cache: a TP replica's
token capacity is one rank's free memory over the KV bytes per token (not tp times it). Each DP
rank is its own attention engine with its own cache, so a DP replica holds dp times one rank's
tokens, while one request (its context) still lives on one DP rank.

    free per rank   = device memory x (1 - reserve) - weights per rank
    tokens per rank = free // block bytes x block_tokens - the state slots of the requests
    tokens          = dp x tokens per rank (a replica's KV tokens over all its ranks)
    largest context = the most tokens one request fits on one DP rank (blocks + one state
                      slot), capped at max_position_embeddings

A replica may span `nodes` nodes of `gpus` devices (DESIGN.md §11): a DP + EP replica that takes the
nodes whole, `gpus` ranks on each (`data_parallel_size_local` = dp / nodes ranks of `tp` devices; a
TP group stays inside a node), its routed experts split over all tp x dp ranks of all the nodes. Each
rank is sized as above; tokens per node = tokens / nodes. `nodes` = None (auto): one node's rows,
and where none of them fits, the rows of the smallest node count where one does.

Weights come from the safetensors headers (`--model`: bytes as stored, quantized dtypes at
their size, scales included) or from config.json alone (`--config`): the model built on
the meta device, each tensor at the size the release stores it (`StoredSize`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams
from kvmesh.kvstore.policy.planner import SwaPolicy
from kvmesh.workers.model.args import ModelArgs
from kvmesh.workers.model.quant import QuantFormat

from .loader import FP32_PARAM, canonical_name, weight_files

GiB = 1 << 30
DEFAULT_RESERVE = 0.10      # of device memory: activations, CUDA context, NCCL buffers, fragmentation
TP_SPLIT = re.compile(r"(\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)|\.attn\.attn_sink"
                      r"|\.shared_experts\.w[123]\.(weight|scale)|^(embed|head)\.weight)$")
ROUTED = re.compile(r"\.ffn\.experts\.")
# What the release keeps in BF16 although quantization_config is set (tests/quant_checkpoint.py
# writes the same split); every other 2-D linear weight is FP8 with 128x128 block scales.
BF16_LINEAR = re.compile(r"(compressor\.(wkv|wgate)|indexer\.weights_proj|ffn\.gate)\.weight$|^(head|embed)\.weight$")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SizingError(ValueError):
    """The device cannot hold the model at any size asked for, or the inputs make no sense."""


def parse_nodes(value: str | int | None) -> int | None:
    """`--nodes`: a whole number >= 1 (the largest node count a replica may span), or auto (None)."""
    if value is None or value == "auto":
        return None
    try:
        nodes = int(value)
    except (TypeError, ValueError):
        nodes = 0
    if nodes < 1 or str(nodes) != str(value).strip():
        raise SizingError(f"--nodes must be a whole number >= 1 or auto (got {value!r})")
    return nodes


@dataclass
class WeightSplit:
    """Weight bytes by how they shard across the ranks of a replica."""
    replicated: int = 0
    tensor: int = 0          # split by TP
    experts: int = 0         # routed experts: split by EP or by TP
    params: int = 0          # model parameters (FP4 counted unpacked), scales excluded
    mtp_params: int = 0      # of which in the MTP layers
    by_dtype: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, nbytes: int, params: int, dtype: str) -> None:
        if ROUTED.search(name):
            self.experts += nbytes
        elif TP_SPLIT.search(name):
            self.tensor += nbytes
        else:
            self.replicated += nbytes
        self.params += params
        self.mtp_params += params if name.startswith("mtp.") else 0
        self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes

    @property
    def total(self) -> int:
        return self.replicated + self.tensor + self.experts

    def per_rank(self, tp: int, dp: int = 1) -> int:
        """Bytes one rank holds in a replica of `dp` DP ranks of `tp` TP ranks each."""
        return self.replicated + math.ceil(self.tensor / tp) + math.ceil(self.experts / (tp * dp))


def split_from_checkpoint(model_dir: str | Path) -> WeightSplit:
    """From the safetensors headers: every tensor at its stored size (FP32 params, which the
    loader keeps in float32, at 4 B per element)."""
    from .inspect import read_header
    split = WeightSplit()
    for f in weight_files(Path(model_dir)):
        for raw, meta in read_header(f).items():
            if raw == "__metadata__":
                continue
            name, elements = canonical_name(raw), math.prod(meta["shape"])
            start, end = meta["data_offsets"]
            nbytes = 4 * elements if FP32_PARAM.search(name) else end - start
            dtype = meta["dtype"]       # I8: FP4 packed two per byte; other integers: hash-routing tables
            table = dtype.startswith(("I", "U")) and dtype != "I8"
            params = 0 if name.endswith(".scale") or table else 2 * elements if dtype == "I8" else elements
            split.add(name, nbytes, params, dtype)
    return split


@dataclass(frozen=True)
class StoredSize:
    """Bytes a tensor takes as the release stores it, from its name and shape alone."""
    quant: QuantFormat | None
    dtype_bytes: int

    def __call__(self, name: str, shape: tuple[int, ...], is_float: bool) -> tuple[int, str]:
        n = math.prod(shape)
        if not is_float:
            return 8 * n, "I64"                          # hash-routing tables, as loaded
        if FP32_PARAM.search(name):
            return 4 * n, "F32"
        if self.quant is None or len(shape) < 2 or BF16_LINEAR.search(name):
            return self.dtype_bytes * n, "BF16" if self.dtype_bytes == 2 else f"{8 * self.dtype_bytes}-bit"
        scale_b = 1 if self.quant.scale_fmt == "ue8m0" else 4
        *lead, out, inn = shape
        mats = math.prod(lead)
        if ROUTED.search(name) and self.quant.expert_dtype == "fp4":      # e2m1 x2 per byte + 1/32 scales
            return mats * (out * inn // 2 + out * math.ceil(inn / 32) * scale_b), "FP4"
        bo, bi = self.quant.block
        return mats * (out * inn + math.ceil(out / bo) * math.ceil(inn / bi) * scale_b), "FP8"


def split_from_config(args: ModelArgs, mtp_layers: int | None = None) -> WeightSplit:
    """From config.json alone: kvmesh's model on the meta device (no memory), with the MTP
    layers config.json declares (`num_nextn_predict_layers`; the loader keeps them), each
    tensor sized by `StoredSize`."""
    import torch

    from kvmesh.workers.model.transformer import Transformer
    quant = QuantFormat.from_config(args.raw)
    size = StoredSize(quant, DTYPE_BYTES.get(args.torch_dtype, 2))
    mtp = int(args.raw.get("num_nextn_predict_layers") or 0) if mtp_layers is None else mtp_layers
    with torch.device("meta"):
        model = Transformer(args, mtp_layers=mtp)
    split = WeightSplit()
    for name, t in model.state_dict().items():
        nbytes, dtype = size(name, tuple(t.shape), t.is_floating_point())
        split.add(name, nbytes, t.numel() if t.is_floating_point() else 0, dtype)
    return split


def attention_problems(args: ModelArgs, tp: int) -> list[str]:
    """Why `tp` ranks cannot split the attention (heads, output groups) and the vocabulary."""
    return [f"{key} {value} is not divisible by tensor_parallel_size {tp}" for key, value in
            (("num_attention_heads", args.num_attention_heads), ("o_groups", args.o_groups),
             ("vocab_size", args.vocab_size)) if value % tp]


def parallel_problems(args: ModelArgs, tp: int, expert_parallel: bool, dp: int = 1) -> list[str]:
    """Why a replica of `dp` data-parallel ranks of `tp` tensor-parallel ranks each cannot split
    this model (empty: it can). Attention splits by `tp`; the routed experts by all tp x dp ranks."""
    problems = attention_problems(args, tp)
    key, value = (("n_routed_experts", args.n_routed_experts) if expert_parallel
                  else ("moe_intermediate_size", args.moe_intermediate_size))
    if value % (tp * dp):
        ranks = (f"tensor_parallel_size {tp}" if dp == 1 else f"data_parallel_size {dp}" if tp == 1
                 else f"tensor_parallel_size x data_parallel_size {tp} x {dp} = {tp * dp}")
        problems.append(f"{key} {value} is not divisible by {ranks}")
    return problems


def kv_layout(args: ModelArgs, kv_cache_dtype: str = "auto", block_tokens: int = 128,
              dtype: str | None = None) -> CacheLayout:
    dtype = dtype or (args.torch_dtype if args.torch_dtype in DTYPE_BYTES else "bfloat16")
    return CacheLayout.build(LayoutParams(args.layer_types, args.head_dim, args.index_head_dim, args.csa_ratio,
                                          args.hca_ratio, args.sliding_window, dtype,
                                          kv_cache_dtype, args.rope_head_dim), block_tokens)


@dataclass(frozen=True)
class Fit:
    """One replica size on one device type: `dp` data-parallel ranks of `tp` tensor-parallel ranks,
    on one node (`replicas_per_node` of them side by side) or spanning `nodes` whole nodes."""
    tp: int
    dp: int
    expert_parallel: bool
    problems: tuple[str, ...]
    weights_per_rank: int
    free_per_rank: int               # for the KV cache, after weights and the reserve
    tokens: int                      # cached tokens a replica holds over all its DP ranks
    max_context: int                 # one request lives on one DP rank
    requests_at_context: int
    replicas_per_node: float         # a whole number on one node; 1 / nodes for a replica over nodes
    nodes: int = 1

    @property
    def fits(self) -> bool:
        return not self.problems and self.max_context > 0

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    @property
    def dp_local(self) -> int:
        """DP ranks on each node (vLLM's data_parallel_size_local)."""
        return self.dp // self.nodes

    @property
    def tokens_per_node(self) -> int:
        return self.tokens // self.nodes if self.nodes > 1 else self.tokens * int(self.replicas_per_node)


@dataclass(frozen=True)
class Plan:
    weights: WeightSplit
    layout: CacheLayout
    swa_blocks: bool                 # blocks carry SWA K=V (the `full` policy)
    device_bytes: int
    reserve: float
    context: int
    fits: tuple[Fit, ...]
    gpus: int = 1                    # devices per node
    nodes: int = 1                   # the most nodes a replica was allowed to span
    auto_nodes: bool = False         # `nodes` chosen as the smallest count where a row fits

    @property
    def block_bytes(self) -> int:
        return self.layout.resident_block_bytes(self.swa_blocks)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.block_bytes / self.layout.block_tokens


def plan(args: ModelArgs, weights: WeightSplit, device_gib: float, gpus: int, *, kv_cache_dtype: str = "auto",
         context: int | None = None, block_tokens: int = 128, swa_policy: str = "full",
         reserve: float = DEFAULT_RESERVE, nodes: int | None = 1) -> Plan:
    """The rows for replicas of up to `nodes` nodes of `gpus` devices each; `nodes` None (auto):
    one node, or where nothing fits there, up to the smallest node count where a row fits."""
    if device_gib <= 0 or gpus < 1 or not 0 <= reserve < 1:
        raise SizingError(f"need --gpu-memory > 0, --gpus >= 1 and 0 <= reserve < 1 "
                          f"(got {device_gib}, {gpus}, {reserve})")
    if nodes is not None and nodes < 1:
        raise SizingError(f"--nodes must be a whole number >= 1 or auto (got {nodes})")
    layout = kv_layout(args, kv_cache_dtype, block_tokens)
    swa_blocks = SwaPolicy.parse(swa_policy, block_tokens).kind == "full"
    block_b, slot_b = layout.resident_block_bytes(swa_blocks), layout.slot_bytes
    device = int(device_gib * GiB)
    context = context or args.max_position_embeddings
    per_request = -(-context // block_tokens) * block_b + slot_b

    def fit(tp: int, dp: int, ep: bool, n: int) -> Fit:
        return _fit(args, weights, int(device * (1 - reserve)), block_b, slot_b, block_tokens, per_request,
                    gpus, tp, dp, ep, n)

    fits = [fit(tp, dp, ep, 1) for tp, dp, ep in replica_sizes(args, gpus)]
    bound = nodes or 1
    for n in range(2, (nodes or max_nodes(args, gpus)) + 1):
        if nodes is None and any(f.fits for f in fits):
            break
        fits += [fit(tp, dp, True, n) for tp, dp in multi_node_sizes(args, gpus, n)]
        bound = n
    if nodes is None and not any(f.fits for f in fits):     # nowhere: show one node's rows only
        fits, bound = [f for f in fits if f.nodes == 1], max_nodes(args, gpus)
    return Plan(weights, layout, swa_blocks, device, reserve, context, tuple(fits), gpus, bound, nodes is None)


def replica_sizes(args: ModelArgs, gpus: int) -> list[tuple[int, int, bool]]:
    """(tp, dp, expert_parallel) worth a row on one node, by ranks: TP sizes that divide the heads or
    the experts (with and without EP), then DP sizes with EP whose tp x dp divides the experts (tp
    splitting the attention cleanly)."""
    tps = [d for d in range(1, gpus + 1) if not args.num_attention_heads % d or not args.n_routed_experts % d]
    rows = [(tp, 1, ep) for tp in tps for ep in ((False, True) if tp > 1 else (False,))]
    rows += [(tp, dp, True) for tp in tps if not attention_problems(args, tp)
             for dp in range(2, gpus // tp + 1) if not args.n_routed_experts % (tp * dp)]
    return sorted(rows, key=lambda r: (r[0] * r[1], r[1], r[2]))


def multi_node_sizes(args: ModelArgs, gpus: int, nodes: int) -> list[tuple[int, int]]:
    """(tp, dp) of a DP + EP replica over `nodes` whole nodes, by DP size: `gpus` ranks on each node,
    tp dividing `gpus` (a TP group inside a node) and splitting the attention cleanly, all
    nodes x gpus ranks dividing the experts (none when they do not)."""
    if args.n_routed_experts % (nodes * gpus):
        return []
    tps = [tp for tp in range(1, gpus + 1) if not gpus % tp and not attention_problems(args, tp)]
    return sorted(((tp, nodes * gpus // tp) for tp in tps), key=lambda r: r[1])


def max_nodes(args: ModelArgs, gpus: int) -> int:
    """The most whole nodes a replica can span: one routed expert per rank at least."""
    return max(1, args.n_routed_experts // gpus)


def _fit(args: ModelArgs, weights: WeightSplit, usable: int, block_b: int, slot_b: int, block_tokens: int,
         per_request: int, gpus: int, tp: int, dp: int, ep: bool, nodes: int = 1) -> Fit:
    w = weights.per_rank(tp, dp)
    free = max(0, usable - w)
    rank_tokens = max(0, (free - slot_b) // block_b) * block_tokens
    return Fit(tp=tp, dp=dp, expert_parallel=ep, problems=tuple(parallel_problems(args, tp, ep, dp)),
               weights_per_rank=w, free_per_rank=free, tokens=dp * rank_tokens,
               max_context=min(args.max_position_embeddings, rank_tokens),
               requests_at_context=dp * (free // per_request),
               replicas_per_node=gpus // (tp * dp) if nodes == 1 else 1 / nodes, nodes=nodes)


def _count(n: float) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def format_plan(p: Plan, label: str) -> str:
    w, lay = p.weights, p.layout
    kv = lay.params.entry_dtype
    unit, scale = ("GiB", GiB) if p.device_bytes >= GiB else ("MiB", 1 << 20)
    lines = [f"{label}: {_count(w.params)} parameters ({_count(w.mtp_params)} of them MTP; FP4 counted unpacked), "
             f"weights {w.total / scale:,.1f} {unit}: " + ", ".join(
                 f"{d} {b / scale:,.1f}" for d, b in sorted(w.by_dtype.items(), key=lambda kv: -kv[1])),
             f"  split by TP {w.tensor / scale:,.2f} {unit}, routed experts {w.experts / scale:,.2f} {unit}, "
             f"replicated on every rank {w.replicated / scale:,.2f} {unit}",
             f"KV cache ({kv}, block_tokens {lay.block_tokens}): {lay.bytes_per_token():,.1f} B/token compressed"
             + (f", {p.kv_bytes_per_token:,.1f} B/token resident with the `full` policy's SWA K=V"
                if p.swa_blocks else "") + f"; {lay.slot_bytes:,} B state slot per request; "
             "the TP ranks of a replica hold the same cache, each DP rank its own",
             f"device {p.device_bytes / scale:,.1f} {unit}, reserve {p.reserve:.0%} for activations / CUDA / NCCL; "
             f"requests at {p.context:,} tokens each", ""]
    rows = [("TP", "DP", "EP", "nodes", f"weights/rank {unit}", f"KV free/rank {unit}", "tokens/replica",
             "tokens/node", "max context", "requests", "replicas/node", "fits")]
    for f in p.fits:
        rows.append((str(f.tp), str(f.dp), "on" if f.expert_parallel else "off", str(f.nodes),
                     f"{f.weights_per_rank / scale:,.1f}", f"{f.free_per_rank / scale:,.1f}", f"{f.tokens:,}",
                     f"{f.tokens_per_node:,}", f"{f.max_context:,}", f"{f.requests_at_context:,}",
                     str(f.replicas_per_node) if f.nodes == 1 else f"1/{f.nodes}", _why(f)))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.rjust(width[i]) if 0 < i < len(r) - 1 else c.ljust(width[i])
                               for i, c in enumerate(r)).rstrip())
    return "\n".join(lines + _notes(p))


def _notes(p: Plan) -> list[str]:
    """Under the table: how far the node search went."""
    notes = [""]
    if any(f.nodes > 1 for f in p.fits):
        notes.append(f"nodes > 1: one DP + EP replica over whole nodes, {p.gpus} ranks on each "
                     "(data_parallel_size_local = DP / nodes), routed experts split over all its ranks")
    if p.auto_nodes and not any(f.fits for f in p.fits):
        notes.append(f"no size fits on one node, nor over up to {p.nodes} nodes of {p.gpus} "
                     "(one routed expert per rank at most)")
    elif p.auto_nodes and p.nodes > 1:
        notes.append(f"nothing fits on one node: rows up to {p.nodes} nodes, the fewest where one fits "
                     "(--nodes N to see more)")
    return notes if len(notes) > 1 else []


SIZE_LABELS = {"tensor_parallel_size": "TP", "data_parallel_size": "DP",
               "tensor_parallel_size x data_parallel_size": "TP x DP"}


def _why(f: Fit) -> str:
    """The `fits` cell: yes, or what does not divide what ("no: TP does not divide o_groups 16")."""
    if not f.problems:
        return "yes" if f.fits else "no: weights exceed the device"
    by: dict[str, list[str]] = {}
    for problem in f.problems:
        what, _, size = problem.partition(" is not divisible by ")
        by.setdefault(SIZE_LABELS[re.sub(r" [\d x=]+$", "", size)], []).append(what)
    return "no: " + "; ".join(f"{label} does not divide {', '.join(whats)}" for label, whats in by.items())
