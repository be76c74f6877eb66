"""Which slice of each checkpoint tensor a tensor-parallel rank loads (see `model.Shard`).

Every split is an even cut of one dim in `size` parts, rank r taking part r:

| tensor (layers.N. / mtp.N.)          | dim | unit                                      |
| ------------------------------------ | --- | ----------------------------------------- |
| attn.wq_b, attn.attn_sink            | 0   | query heads                               |
| attn.wo_a                            | 0   | output groups (G*R rows, group g = g*R..) |
| attn.wo_b                            | 1   | the same groups, as wo_b's input          |
| ffn.experts.w1/w3 (stacked [E, I, C]) | 0 / 1 | experts (expert parallel) / intermediate |
| ffn.experts.w2 ([E, C, I])           | 0 / 2 | experts / intermediate                   |
| ffn.shared_experts.w1/w3, .w2        | 0, 1 | intermediate (when `split_shared`)        |
| embed, head                          | 0   | vocabulary                                |

A quantized weight's scale is cut along the same dim, which needs every part to hold whole
scale blocks (FP8: 128x128 blocks, FP4: 32 inputs); where it would not, loading fails with a
ConfigError naming the tensor, except for the shared expert, which is then replicated.
"""
from __future__ import annotations

import re

import torch

from kvmesh.kernels.quant_ops import FP4_GROUP
from kvmesh.workers.model.args import ConfigError, ModelArgs
from kvmesh.workers.model.quant import QuantFormat

LAYER = r"^(?:layers|mtp)\.\d+\."
SPLITS = [   # (pattern, dim without / with expert parallelism)
    (re.compile(LAYER + r"attn\.(wq_b|wo_a)\.(weight|scale)$"), 0, 0),
    (re.compile(LAYER + r"attn\.attn_sink$"), 0, 0),
    (re.compile(LAYER + r"attn\.wo_b\.(weight|scale)$"), 1, 1),
    (re.compile(LAYER + r"ffn\.experts\.(w1|w3)(_scale)?$"), 1, 0),
    (re.compile(LAYER + r"ffn\.experts\.w2(_scale)?$"), 2, 0),
    (re.compile(r"^(embed|head)\.(weight|scale)$"), 0, 0),
]
STACKED_EXPERTS = re.compile(LAYER + r"ffn\.experts\.w[123](_scale)?$")
SHARED = [(re.compile(LAYER + r"ffn\.shared_experts\.(w1|w3)\.(weight|scale)$"), 0),
          (re.compile(LAYER + r"ffn\.shared_experts\.w2\.(weight|scale)$"), 1)]


def check_sizes(args: ModelArgs, size: int, expert_parallel: bool) -> None:
    """ConfigError naming the numbers unless `size` ranks can split this model."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    dims = {"num_attention_heads": args.num_attention_heads, "o_groups": args.o_groups,
            "vocab_size": args.vocab_size}
    if expert_parallel:
        dims["n_routed_experts"] = args.n_routed_experts
    else:
        dims["moe_intermediate_size"] = args.moe_intermediate_size
    bad = {k: v for k, v in dims.items() if v % size}
    if bad:
        split = "experts" if expert_parallel else "each expert's intermediate dim (no --enable-expert-parallel)"
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())} "
            f"(the model splits its heads, output groups, vocabulary and {split} across ranks); "
            f"use a size that divides {', '.join(f'{k}={v}' for k, v in dims.items())}")


def split_shared(state: dict[str, torch.Tensor], size: int, fmt: QuantFormat | None) -> bool:
    """Whether the shared experts can be split in `size` parts (their scale blocks allow it)."""
    return all(_cut_error(name, state, dim, size, fmt) is None
               for name in state for pattern, dim in SHARED if pattern.search(name) and name.endswith(".weight"))


def shard_state(state: dict[str, torch.Tensor], rank: int, size: int, expert_parallel: bool,
                shared: bool, fmt: QuantFormat | None = None, whole: int | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every split tensor (copies); replicated tensors as they are. With
    expert parallelism, stacked experts with fewer than `whole` (n_routed_experts) rows were
    already read as this rank's own (loader.owned_experts) and stay as they are."""
    if size == 1:
        return state
    out = {}
    for name, t in state.items():
        dim = _split_dim(name, expert_parallel, shared)
        if dim == 0 and t.dim() == 3 and whole is not None and t.shape[0] < whole:
            dim = None                         # experts already this rank's own
        if dim is None:
            out[name] = t
            continue
        error = _cut_error(_weight_name(name), state, dim, size, fmt)
        if error:
            raise ConfigError(error)
        out[name] = t.narrow(dim, rank * (t.shape[dim] // size), t.shape[dim] // size).clone()   # frees the rest
    return out


def own_experts(state: dict[str, torch.Tensor], first: int, count: int, whole: int,
                slots: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Data-parallel attention: stacked routed experts read whole (`whole` rows) cut to this
    rank's [first, first + count); everything else, and experts already read as this rank's
    own (loader.owned_experts), as they are. EPLB: `slots` (indices into the rank's block) lays
    the rank's experts out as its physical experts, a redundant one a copy of its logical one."""
    out = {}
    for name, t in state.items():
        if t.dim() == 3 and STACKED_EXPERTS.search(name):
            if t.shape[0] == whole:
                t = t.narrow(0, first, count) if slots is not None else t.narrow(0, first, count).clone()
            if slots is not None and t.shape[0] == count:
                t = t.index_select(0, slots)
        out[name] = t
    return out


def _split_dim(name: str, expert_parallel: bool, shared: bool) -> int | None:
    for pattern, dense, ep in SPLITS:
        if pattern.search(name):
            return ep if expert_parallel else dense
    if shared:
        return next((dim for pattern, dim in SHARED if pattern.search(name)), None)
    return None


def _weight_name(name: str) -> str:
    return name[:-len(".scale")] + ".weight" if name.endswith(".scale") else name.removesuffix("_scale")


def _scale_name(weight: str) -> str:
    return weight[:-len(".weight")] + ".scale" if weight.endswith(".weight") else weight + "_scale"


def _block(weight: str, w: torch.Tensor, dim: int, fmt: QuantFormat | None) -> int:
    """Weight entries (along `dim`, as stored) that one scale covers."""
    if fmt is None:
        return 1
    if w.dim() == 3:                          # stacked experts [E, N, K]: one expert per scale row
        if dim == 0:
            return 1
        if fmt.expert_dtype == "fp4":         # int8 [E, N, K/2] packed, one scale per 32 inputs
            return 1 if dim == 1 else FP4_GROUP // 2
        return fmt.block[dim - 1]
    return fmt.block[dim]


def _cut_error(weight: str, state: dict[str, torch.Tensor], dim: int, size: int,
               fmt: QuantFormat | None) -> str | None:
    """Why `weight` cannot be cut in `size` parts along `dim` (None: it can)."""
    w = state[weight]
    n = w.shape[dim]
    if n % size:
        return f"tensor_parallel_size={size}: {weight} has {n} rows along dim {dim}, not divisible"
    if _scale_name(weight) not in state:
        return None
    block = _block(weight, w, dim, fmt)
    if (n // size) % block:
        blocks = n // block if n % block == 0 else 0
        fix = (f"use a tensor_parallel_size that divides {blocks}" if blocks > 1
               else "it holds less than two whole blocks, so it cannot be split")
        return (f"tensor_parallel_size={size}: {weight} is quantized in blocks of {block} along dim {dim} "
                f"({n} values); {size} ranks would cut a scale block ({n}/{size} = {n // size} is not a "
                f"multiple of {block}): {fix}" + (", or use --enable-expert-parallel" if w.dim() == 3 else ""))
    return None
