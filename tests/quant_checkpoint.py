"""Write a tiny V4 checkpoint in the released DeepSeek-V4 format, by quantizing a
transformers-made one ourselves (the test side of the FP8/FP4 loader).

What the release ships, and so what this writes:
* upstream names without the `model.` prefix (`embed.weight`, `hc_head_fn`, `attn.kv_norm`);
* FP8 e4m3 linears (attention, indexer `wq_b`, shared experts, MTP `e_proj`/`h_proj`) with one
  scale per `block` (ceil-divided), named `.scale` in ue8m0 or `.weight_scale_inv` in fp32;
* FP4 e2m1 routed experts: int8 `[out, in/2]` (low nibble = even column) + `[out, in/32]` scales
  (`expert_dtype="fp4"`; `expert_dtype="fp8"` quantizes them like the linears instead);
* BF16 embeddings, head, router, compressor and indexer projections; FP32 norms, sinks, mHC;
* `mtp_layers` synthetic MTP layers (`mtp.N.*`, a sliding-window MoE block + e/h_proj).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])   # round |x| to the nearest e2m1
BF16_LINEAR = re.compile(r"(compressor\.(wkv|wgate)|indexer\.weights_proj|ffn\.gate|^head|^embed)\.weight$")
FP8_LINEAR = re.compile(r"\.(wq_a|wq_b|wkv|wo_a|wo_b|w1|w2|w3|e_proj|h_proj)\.weight$")
EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
RENAMES = [(r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_", "hc_head_"),
           (r"\.attn\.norm\.", ".attn.kv_norm.")]


def _scale_out(amax: torch.Tensor, qmax: float, ue8m0: bool) -> torch.Tensor:
    s = (amax / qmax).clamp(min=1e-12)
    return torch.exp2(torch.ceil(torch.log2(s))) if ue8m0 else s


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight + per-block dequant scale [ceil(out/bo), ceil(in/bi)] (fp32 or e8m0)."""
    out, inn = w.shape
    bo, bi = block
    so, si = math.ceil(out / bo), math.ceil(inn / bi)
    padded = torch.zeros(so * bo, si * bi)
    padded[:out, :inn] = w.float()
    blocks = padded.view(so, bo, si, bi)
    scale = _scale_out(blocks.abs().amax(dim=(1, 3)), FP8_MAX, ue8m0)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(so * bo, si * bi)[:out, :inn]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu if ue8m0 else torch.float32)


def quantize_fp4(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 packed two per int8 byte (low nibble first) + one scale per 32 inputs."""
    out, inn = w.shape
    groups = w.float().view(out, inn // 32, 32)
    scale = _scale_out(groups.abs().amax(-1), 6.0, ue8m0)
    x = (groups / scale[..., None]).view(out, inn)
    code = torch.bucketize(x.abs(), E2M1_MIDPOINTS) | ((x < 0).long() << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu if ue8m0 else torch.float32)


def _upstream_name(name: str) -> str:
    for pattern, repl in RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def _mtp_tensors(state: dict[str, torch.Tensor], cfg: dict, n_mtp: int, seed: int) -> dict[str, torch.Tensor]:
    """MTP layer N = a copy of the last MoE layer's attention/FFN as a sliding-window block,
    plus its own e_proj/h_proj/enorm/hnorm/norm/hc_head (random)."""
    if n_mtp == 0:
        return {}
    g = torch.Generator().manual_seed(seed)
    c, n = cfg["hidden_size"], cfg.get("hc_mult", 4)
    src = next(i for i in reversed(range(cfg["num_hidden_layers"])) if cfg["mlp_layer_types"][i] == "moe")
    out = {}
    for k in range(n_mtp):
        for name, t in state.items():
            if name.startswith(f"layers.{src}.") and ".compressor." not in name and ".indexer." not in name:
                out[f"mtp.{k}." + name.removeprefix(f"layers.{src}.")] = t.clone()
        for proj in ("e_proj", "h_proj"):
            out[f"mtp.{k}.{proj}.weight"] = torch.randn(c, c, generator=g) * 0.02
        for norm in ("enorm", "hnorm", "norm"):
            out[f"mtp.{k}.{norm}.weight"] = torch.ones(c)
        out[f"mtp.{k}.hc_head_fn"] = torch.randn(n, n * c, generator=g) * 0.02
        out[f"mtp.{k}.hc_head_base"] = torch.zeros(n)
        out[f"mtp.{k}.hc_head_scale"] = torch.ones(1)
    return out


def quantize_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] = (128, 128), scale_fmt: str = "ue8m0",
                        expert_dtype: str = "fp4", expert_dtype_in_quant_config: bool = False,
                        mtp_layers: int = 1, seed: int = 0) -> Path:
    """Quantize the transformers-saved checkpoint at `src` into the released format at `dst`."""
    ue8m0 = scale_fmt == "ue8m0"
    state = {_upstream_name(k): v for k, v in load_file(str(src / "model.safetensors")).items()}
    cfg = json.loads((src / "config.json").read_text())
    state.update(_mtp_tensors(state, cfg, mtp_layers, seed))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        stem = name.removesuffix(".weight")
        scale_name = f"{stem}.scale" if ue8m0 else f"{stem}.weight_scale_inv"
        if EXPERT.search(name) and expert_dtype == "fp4":
            out[name], out[scale_name] = quantize_fp4(t, ue8m0)
        elif FP8_LINEAR.search(name) and not BF16_LINEAR.search(name):
            out[name], out[scale_name] = quantize_fp8(t, block, ue8m0)
        elif t.is_floating_point() and name.endswith(".weight") and t.dim() == 2:
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t.float() if t.is_floating_point() else t
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block), "scale_fmt": scale_fmt}
    cfg.update(dtype="bfloat16", num_nextn_predict_layers=mtp_layers, quantization_config=quant)
    if expert_dtype_in_quant_config:
        quant["expert_dtype"] = expert_dtype
    else:
        cfg["expert_dtype"] = expert_dtype
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def random_released_checkpoint(dst: Path, config: dict, seed: int = 0, **quant_kw) -> Path:
    """A released-format checkpoint of any size straight from a config (no transformers model):
    random dense weights shaped by kvmesh's own model, quantized as `quantize_checkpoint` does."""
    from kvmesh.workers.model.args import ModelArgs
    from kvmesh.workers.model.transformer import Transformer
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(ModelArgs.from_dict(config)).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    dense = {}
    for name, shape in shapes.items():
        if name.endswith("tid2eid"):
            dense[name] = torch.randint(0, config["n_routed_experts"], shape, generator=g)
        elif ".ffn.experts.w" in name:
            stem, w = name.rsplit(".", 1)
            for e in range(shape[0]):
                dense[f"{stem}.{e}.{w}.weight"] = torch.randn(shape[1:], generator=g) * 0.02
        else:
            dense[name] = torch.randn(shape, generator=g) * 0.02
    src = dst.with_name(dst.name + "-dense")
    src.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(config))
    del dense
    out = quantize_checkpoint(src, dst, mtp_layers=0, **quant_kw)
    (src / "model.safetensors").unlink()
    return out


def dequantize_checkpoint(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The same weights dense (FP8/FP4 dequantized to `dtype`, quantization_config dropped):
    the baseline a released checkpoint is compared against."""
    from kvmesh.kernels.quant_ops import dequant_fp4, dequant_fp8
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config")
    cfg.pop("expert_dtype", None)
    block = tuple(q["weight_block_size"])
    out = {}
    for name, t in tensors.items():
        if name.endswith((".scale", ".weight_scale_inv")):
            continue
        stem = name.removesuffix(".weight")
        s = tensors.get(f"{stem}.scale", tensors.get(f"{stem}.weight_scale_inv"))
        if s is None:
            out[name] = t
        elif t.dtype == torch.int8:
            out[name] = dequant_fp4(t, s, dtype)
        else:
            out[name] = dequant_fp8(t, s, block, dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
