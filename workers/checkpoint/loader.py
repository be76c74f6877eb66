"""Load a DeepSeek-V4 checkpoint directory (HF layout, upstream tensor names).

Accepts `model.safetensors` or shards listed in `model.safetensors.index.json`, names with
or without the `model.` prefix that `save_pretrained` adds, per-expert tensors
(`ffn.experts.E.w1.weight`) which are stacked here, and the MTP layers (`mtp.N.*`, kept as
`Transformer.mtp`). Released checkpoints load as shipped: FP8 linears (`.scale` or
`.weight_scale_inv`) become `FP8Linear`, FP4/FP8 routed experts `QuantExperts` (workers/model/quant.py);
nothing is dequantized at load.
"""
from __future__ import annotations

import collections
import contextlib
import json
import re
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import safe_open

from kvmesh.workers.model.args import ConfigError, ModelArgs
from kvmesh.workers.model.layers import Rope
from kvmesh.workers.model.moe import Experts, swiglu
from kvmesh.workers.model.quant import FP8Linear, QuantExperts, QuantFormat, QuantFormatError, check_fp4, check_fp8
from kvmesh.workers.model.shard import SINGLE, Shard
from kvmesh.workers.model.transformer import Transformer

from .sharding import own_experts, shard_state, split_shared

FP32_PARAM = re.compile(r"(norm\.weight|attn_sink|\.ape|hc_.*|gate\.bias)$")
EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
MTP_LAYER = re.compile(r"^mtp\.(\d+)\.")
TENSOR_NAME = re.compile(r"(?:layers|mtp)\.\d+(?:\.\w+)+|\b(?:embed|head|norm)\.weight\b|\bhc_head_\w+")
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
    (re.compile(r"\.attn\.kv_norm\."), ".attn.norm."),
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(RuntimeError):
    """The checkpoint directory is missing, malformed, quantized, or does not fit the config."""


def canonical_name(name: str) -> str:
    for pattern, repl in RENAMES:
        name = pattern.sub(repl, name)
    return name


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e})") from None
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise CheckpointError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def read_tensors(files: list[Path], rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the files by name; `rename` may rename one or skip it (None: never read)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    name = rename(k) if rename else k
                    if name is not None:
                        out[name] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises several untyped errors on a bad header
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    return out


class ModelState(NamedTuple):
    tensors: dict[str, torch.Tensor]    # canonical names, per-expert tensors stacked
    stored: dict[str, str]              # canonical / stacked name -> the name as stored in the checkpoint

    def named(self, text: str) -> str:
        """`text` (an error message) with every canonical or stacked tensor name replaced by the
        name the checkpoint stores it under (`layers.1.ffn.experts.*.w2.weight_scale_inv`)."""
        def stored(m: re.Match) -> str:
            name = m[0]
            if name in self.stored:
                return self.stored[name]
            weight = self.stored.get(f"{name}.weight")    # a module path: its weight's stored prefix
            return weight.removesuffix(".weight") if weight else name
        return TENSOR_NAME.sub(stored, text)


def to_model_state(raw: dict[str, torch.Tensor], expert_offset: int = 0) -> ModelState:
    """Canonical names; per-expert tensors stacked to `...experts.w1` (+ `...experts.w1_scale`).
    Errors name tensors as the checkpoint stores them (`expert_offset`: the first expert read)."""
    state, experts, stored = {}, {}, {}
    for raw_name, t in raw.items():
        name = canonical_name(raw_name)
        m = EXPERT.match(name)
        if m:
            key = f"{m[1]}.{m[3]}" + ("_scale" if m[4] == "scale" else "")
            experts.setdefault(key, {})[int(m[2])] = (raw_name, t)
            every = _expert_name(raw_name, m, "*")
            stored[key] = stored[f"{m[1]}.{m[3]}.{m[4]}"] = every
        else:
            state[name] = t
            stored[name] = raw_name
    for name, per_expert in experts.items():
        n = max(per_expert) + 1
        missing = sorted(set(range(n)) - set(per_expert))
        if missing:
            some_raw, _ = next(iter(per_expert.values()))
            m = EXPERT.match(canonical_name(some_raw))
            raise CheckpointError("missing from the checkpoint: " + ", ".join(
                _expert_name(some_raw, m, str(e + expert_offset)) for e in missing))
        shapes = collections.Counter(tuple(t.shape) for _, t in per_expert.values())
        if len(shapes) != 1:
            common = shapes.most_common(1)[0][0]
            odd = [f"{raw_name} has shape {tuple(t.shape)}" for raw_name, t in per_expert.values()
                   if tuple(t.shape) != common]
            raise CheckpointError(f"{'; '.join(odd)}: the layer's other experts have {common}")
        state[name] = torch.stack([per_expert[i][1] for i in range(n)])
    return ModelState(state, stored)


def _expert_name(raw_name: str, m: re.Match, index: str) -> str:
    """The stored name `raw_name` (expert m[2]) with its expert index replaced by `index`."""
    return re.sub(rf"\.experts\.{m[2]}\.", f".experts.{index}.", raw_name, count=1)


def owned_experts(first: int, count: int) -> Callable[[str], str | None]:
    """Expert parallelism at read time: per-expert tensors of experts [first, first + count)
    renamed to local indices, the others never read (the routed experts are most of the bytes)."""
    def rename(name: str) -> str | None:
        m = EXPERT.match(canonical_name(name))
        if m is None:
            return name
        e = int(m[2]) - first
        return f"{m[1]}.{e}.{m[3]}.{m[4]}" if 0 <= e < count else None
    return rename


def mtp_layer_count(state: dict[str, torch.Tensor]) -> int:
    ids = {int(m[1]) for m in map(MTP_LAYER.match, state) if m}
    if ids and ids != set(range(len(ids))):
        raise CheckpointError(f"MTP layers {sorted(ids)} are not numbered 0..{len(ids) - 1}")
    return len(ids)


def _is_quantized(state: dict[str, torch.Tensor], name: str) -> bool:
    return f"{name}.scale" in state or f"{name}_scale" in state or (
        name in state and state[name].dtype in QUANT_DTYPES) or (
        f"{name}.weight" in state and state[f"{name}.weight"].dtype in QUANT_DTYPES)


def install_quantized(model: Transformer, state: dict[str, torch.Tensor], fmt: QuantFormat | None) -> set[str]:
    """Swap every linear / routed-expert module whose checkpoint tensors are quantized for its
    quantized twin (built from those tensors, which leave `state`); returns the names installed."""
    installed: set[str] = set()
    for path, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and _is_quantized(state, path):
            new = _fp8_linear(path, module, state, fmt)
        elif isinstance(module, Experts) and _is_quantized(state, f"{path}.w1"):
            new = _quant_experts(path, module, state, fmt)
        else:
            continue
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        installed |= {f"{path}.{k}" for k, _ in new.named_parameters()}
    return installed


def _require_format(name: str, fmt: QuantFormat | None) -> QuantFormat:
    if fmt is None:
        raise CheckpointError(f"{name} is quantized but config.json has no quantization_config")
    return fmt


def _fp8_linear(path: str, module: torch.nn.Linear, state: dict, fmt: QuantFormat | None) -> FP8Linear:
    fmt = _require_format(path, fmt)
    w, s = state.pop(f"{path}.weight", None), state.pop(f"{path}.scale", None)
    if w is None:
        raise CheckpointError(f"{path}.scale without {path}.weight")
    check_fp8(path, w, s, fmt.block, (module.out_features, module.in_features))
    return FP8Linear(w, s, fmt.block)


def _quant_experts(path: str, module: Experts, state: dict, fmt: QuantFormat | None) -> QuantExperts:
    fmt = _require_format(f"{path}.w1", fmt)
    weights = {}
    for w in ("w1", "w2", "w3"):
        q, s = state.pop(f"{path}.{w}", None), state.pop(f"{path}.{w}_scale", None)
        if q is None:
            raise CheckpointError(f"{path}.{w}: missing")
        shape = tuple(getattr(module, w).shape)
        if fmt.expert_dtype == "fp4":
            check_fp4(f"{path}.{w}", q, s, shape)
        else:
            check_fp8(f"{path}.{w}", q, s, fmt.block, shape[-2:])
        weights[w] = (q, s)
    return QuantExperts(weights, fmt, module.limit, swiglu, module.first)


def load_model(model_dir: str | Path, dtype: str | None = None, device: str = "cpu",
               kernel_backend: str = "auto", shard: Shard = SINGLE) -> tuple[ModelArgs, Transformer]:
    """The checkpoint as a Transformer; under tensor parallelism (`shard.size` > 1) only this
    rank's part of each split tensor (workers/checkpoint/sharding.py) is kept."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    try:
        args = ModelArgs.from_file(model_dir / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    try:
        fmt = QuantFormat.from_config(args.raw, str(model_dir / "config.json"))
    except QuantFormatError as e:
        raise CheckpointError(str(e)) from None
    dtype_name = dtype or args.torch_dtype
    if dtype_name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype_name!r}; use one of {sorted(DTYPES)}")
    owned = shard.owned_experts(args.n_routed_experts)
    rename = owned_experts(*owned) if owned is not None else None
    first = owned[0] if owned is not None else 0
    loaded = to_model_state(read_tensors(weight_files(model_dir), rename), first)
    try:
        return args, _build(args, loaded.tensors, fmt, shard, kernel_backend, dtype_name, device)
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir}: {loaded.named(str(e))}") from None


@contextlib.contextmanager
def _no_init():
    """Skip torch.nn.init while the model is built on the meta device: every parameter is then
    replaced by the checkpoint's, and a random init on meta imports torch._dynamo (~0.9 s of CPU
    in every process that opens an engine: replicas, ranks, CLIs)."""
    skipped = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_",
               "constant_")
    saved = {name: getattr(torch.nn.init, name) for name in skipped}
    for name in skipped:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _build(args: ModelArgs, state: dict[str, torch.Tensor], fmt: QuantFormat | None, shard: Shard,
           kernel_backend: str, dtype_name: str, device: str) -> Transformer:
    """The model from canonical tensors; CheckpointErrors name canonical tensors (the caller
    renames them as stored)."""
    if shard.grouped:      # TP inside a DP rank: whole experts of the D x T ranks, the rest as under TP
        shard.split_shared = split_shared(state, shard.size, fmt)
        state = own_experts(state, *shard.owned_experts(args.n_routed_experts), whole=args.n_routed_experts,
                            slots=shard.local_placement(args.n_routed_experts))
        state = shard_state(state, shard.rank, shard.size, True, shard.split_shared, fmt,
                            whole=args.n_routed_experts)
    elif shard.size > 1:
        shard.split_shared = split_shared(state, shard.size, fmt)
        state = shard_state(state, shard.rank, shard.size, shard.expert_parallel, shard.split_shared, fmt,
                            whole=args.n_routed_experts)
    elif shard.dp_size > 1:
        state = own_experts(state, *shard.owned_experts(args.n_routed_experts), whole=args.n_routed_experts,
                            slots=shard.local_placement(args.n_routed_experts))
    with torch.device("meta"), _no_init():
        model = Transformer(args, kernel_backend, mtp_layer_count(state), shard)
    try:
        quantized = install_quantized(model, state, fmt)
    except QuantFormatError as e:
        raise CheckpointError(str(e)) from None
    expected = {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers())
                if not k.startswith("ropes.")}
    missing = sorted(set(expected) - set(state) - quantized)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match config: missing {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}")
    for k, v in expected.items():
        if k not in quantized and tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}")
    for k, t in state.items():
        if t.dtype in QUANT_DTYPES:
            raise CheckpointError(f"{k} is {t.dtype} but has no scale; kvmesh expects FP8/FP4 "
                                  "weights with their `.scale` / `.weight_scale_inv`")
    target = DTYPES[dtype_name]
    converted = {}
    for k in expected:
        if k in quantized:
            converted[k] = expected[k].to(device)
            continue
        src = state[k]
        want = src.dtype if not src.is_floating_point() else (torch.float32 if FP32_PARAM.search(k) else target)
        converted[k] = src.to(device=device, dtype=want)
    model.load_state_dict(converted, strict=False, assign=True)
    # rope tables are computed, not loaded; build only them (a whole second Transformer here
    # would allocate every weight again in fp32 on the CPU)
    model.ropes = torch.nn.ModuleDict({"main": Rope(args.main_rope, args.rope_head_dim),
                                       "compress": Rope(args.compress_rope, args.rope_head_dim)}).to(device)
    return model.eval()
