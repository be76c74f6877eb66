"""The built-in default model: a small DeepSeek-V4-shaped checkpoint, made deterministically.

It has every part of the real network (SWA, CSA and HCA layers, mHC, hash and top-k MoE
with a shared expert, indexer, YaRN compress rope) at toy width, and is written in the
same on-disk format `save_pretrained` produces (config.json + model.safetensors with the
upstream tensor names), so the whole load path is the real one. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_MODEL_VERSION = 1
DEFAULT_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 128,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_hash_layers": 1,
    "compress_ratios": [0, 4, 128, 4],
    "sliding_window": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 64,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def default_model_dir() -> Path:
    base = Path(os.path.expanduser("~")) / ".cache" / "kvmesh"
    return base / f"default-v4-tiny-v{DEFAULT_MODEL_VERSION}"


def make_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the upstream names for `config` (any small V4 config)."""
    from .config import ModelArgs
    from .model import Transformer
    args = ModelArgs.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    out: dict[str, torch.Tensor] = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("ropes."):
            continue
        if name.endswith("tid2eid"):
            t = torch.stack([torch.randperm(args.n_routed_experts, generator=g)[:args.num_experts_per_tok]
                             for _ in range(args.vocab_size)])
        elif name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
            t = torch.ones(p.shape)
        elif name.endswith(("attn_sink", "gate.bias", "_base")) or ".ape" in name:
            t = torch.randn(p.shape, generator=g) * 0.1
        else:
            t = torch.randn(p.shape, generator=g) * 0.02
        out.update(_upstream(name, t.to(p.dtype)))
    return out


def _upstream(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our stacked experts -> per-expert tensors; `model.` prefix as save_pretrained writes."""
    if ".ffn.experts.w" in name:
        stem, w = name.rsplit(".", 1)
        return {f"model.{stem}.{e}.{w}.weight": t[e].contiguous() for e in range(t.shape[0])}
    if name == "head.weight":
        return {name: t}
    if name == "embed.weight":
        return {"model.embed_tokens.weight": t}
    if name.startswith("hc_head_"):
        return {f"model.hc_head.hc_{name.removeprefix('hc_head_')}": t}
    return {f"model.{name}": t}


def write_checkpoint(path: Path, config: dict, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file(make_weights(config, seed), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def ensure_default_model(path: Path | None = None) -> Path:
    path = path or default_model_dir()
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        write_checkpoint(path, DEFAULT_CONFIG, seed=0)
    return path
