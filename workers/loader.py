"""Load a DeepSeek-V4 checkpoint directory (HF layout, upstream tensor names).

Accepts `model.safetensors` or shards listed in `model.safetensors.index.json`, names with
or without the `model.` prefix that `save_pretrained` adds, per-expert tensors
(`ffn.experts.E.w1.weight`) which are stacked here, and ignores the MTP head (`mtp.*`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, ModelArgs
from .model import Rope, Transformer

FP32_PARAM = re.compile(r"(norm\.weight|attn_sink|\.ape|hc_.*|gate\.bias)$")
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
RENAMES = [
    (re.compile(r"^model\."), ""),
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


def weights_identity(model_dir: str | Path) -> str:
    """A content identity of the weights that every node computes alike: each safetensors
    file's header (names, dtypes, shapes, offsets) and its first and last MiB of data."""
    import xxhash
    h = xxhash.xxh3_128()
    for f in weight_files(Path(model_dir)):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
        h.update(str(size).encode())
    return h.hexdigest()


def check_not_quantized(args: ModelArgs, model_dir: Path) -> None:
    q = args.raw.get("quantization_config")
    if q:
        raise CheckpointError(
            f"{model_dir}: quantized checkpoint ({q.get('quant_method', q)}); kvmesh loads bf16/fp32 weights "
            "only - dequantize it to bf16 first")


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises several untyped errors on a bad header
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    return out


def to_model_state(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state, experts = {}, {}
    for name, t in raw.items():
        name = canonical_name(name)
        if name.startswith("mtp."):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or name.endswith(("scale_inv", ".scale")):
            raise CheckpointError(f"tensor {name} is FP8/FP4-quantized; dequantize the checkpoint to bf16 first")
        m = EXPERT.match(name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
        else:
            state[name] = t
    for name, per_expert in experts.items():
        n = max(per_expert) + 1
        if sorted(per_expert) != list(range(n)):
            raise CheckpointError(f"{name}: experts {sorted(set(range(n)) - set(per_expert))} missing")
        state[name] = torch.stack([per_expert[i] for i in range(n)])
    return state


def load_model(model_dir: str | Path, dtype: str | None = None, device: str = "cpu",
               kernel_backend: str = "auto") -> tuple[ModelArgs, Transformer]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    try:
        args = ModelArgs.from_file(model_dir / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_not_quantized(args, model_dir)
    dtype_name = dtype or args.torch_dtype
    if dtype_name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype_name!r}; use one of {sorted(DTYPES)}")
    state = to_model_state(read_tensors(weight_files(model_dir)))
    with torch.device("meta"):
        model = Transformer(args, kernel_backend)
    expected = {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers())
                if not k.startswith("ropes.")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: checkpoint does not match config: missing {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{model_dir}: {k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}")
    target = DTYPES[dtype_name]
    converted = {}
    for k in expected:
        src = state[k]
        want = src.dtype if not src.is_floating_point() else (torch.float32 if FP32_PARAM.search(k) else target)
        converted[k] = src.to(device=device, dtype=want)
    model.load_state_dict(converted, strict=False, assign=True)
    # rope tables are computed, not loaded; build only them (a whole second Transformer here
    # would allocate every weight again in fp32 on the CPU)
    model.ropes = torch.nn.ModuleDict({"main": Rope(args.main_rope, args.rope_head_dim),
                                       "compress": Rope(args.compress_rope, args.rope_head_dim)}).to(device)
    return args, model.eval()
