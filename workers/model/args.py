"""ModelArgs: the DeepSeek-V4 hyper-parameters kvmesh needs, parsed once from config.json.

Accepts both the modern transformers keys (`layer_types`, `compress_rates`,
`mlp_layer_types`, `partial_rotary_factor`, nested `rope_parameters`) and the legacy
keys real checkpoints ship (`compress_ratios`, `compress_rate_csa/hca`,
`num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SWA, CSA, HCA)
RATIO_TO_LAYER_TYPE = {0: SWA, 4: CSA, 128: HCA}
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


class ConfigError(ValueError):
    """A model or engine config that kvmesh cannot serve; the message names the offending key."""


@dataclass(frozen=True)
class RopeArgs:
    theta: float
    rope_type: str = "default"          # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_head_dim: int
    main_rope: RopeArgs
    compress_rope: RopeArgs
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def ratio(self, layer_type: str) -> int:
        return {CSA: self.csa_ratio, HCA: self.hca_ratio}.get(layer_type, 0)

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(self.ratio(t) for t in self.layer_types)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read config ({e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelArgs":
        return _parse(raw, source)


def _require(raw: dict, key: str, source: str, default=None):
    if key in raw and raw[key] is not None:
        return raw[key]
    if default is not None:
        return default
    raise ConfigError(f"{source}: missing required key {key!r}")


def _positive_int(raw: dict, key: str, source: str, default=None) -> int:
    value = _require(raw, key, source, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_types(raw: dict, n: int, source: str) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        bad = [r for r in ratios if r not in RATIO_TO_LAYER_TYPE]
        if bad:
            raise ConfigError(f"{source}: compress_ratios entries must be 0, 4 or 128, got {bad}")
        types = [RATIO_TO_LAYER_TYPE[r] for r in ratios]
    if types is None:  # transformers' default: 2x HCA bootstrap then CSA/HCA interleave
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n:
        raise ConfigError(f"{source}: {len(types)} layer types for num_hidden_layers={n}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"{source}: layer_types entries must be one of {LAYER_TYPES}, got {bad}")
    return tuple(types)


def _mlp_types(raw: dict, n: int, source: str) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = 3 if n_hash is None else n_hash
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = list(types)[:n]
    bad = [t for t in types if t not in MLP_TYPES]
    if bad or len(types) != n:
        raise ConfigError(f"{source}: mlp_layer_types must be {n} entries from {MLP_TYPES}, got {types}")
    return tuple(types)


def _rope(raw: dict, label: str, theta: float, source: str) -> RopeArgs:
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get(label), dict):
        params = params[label]
    elif label == "main":
        params = {}
    else:  # flat legacy rope_scaling / rope_parameters apply to the compress rope only, and
        # (as in transformers) its theta is always compress_rope_theta, never a flat rope_theta
        params = {k: v for k, v in {**(raw.get("rope_scaling") or {}), **params}.items()
                  if k not in ("main", "compress", "rope_theta")}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    if rope_type == "default":
        return RopeArgs(theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default or yarn)")
    factor = params.get("factor")
    omax = params.get("original_max_position_embeddings")
    if omax is None:
        raise ConfigError(f"{source}: yarn rope needs 'original_max_position_embeddings'")
    if factor is None:
        factor = raw.get("max_position_embeddings", 1 << 20) / omax
    attention_factor = params.get("attention_factor", 1.0)
    if attention_factor not in (None, 1.0):
        raise ConfigError(f"{source}: yarn attention_factor {attention_factor} != 1.0 is not what V4 uses")
    return RopeArgs(theta=theta, rope_type="yarn", factor=float(factor),
                    original_max_position_embeddings=int(omax),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)))


def _parse(raw: dict, source: str) -> ModelArgs:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: config must be a JSON object")
    model_type = raw.get("model_type")
    if model_type != "deepseek_v4":
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; kvmesh serves 'deepseek_v4'")
    n = _positive_int(raw, "num_hidden_layers", source)
    head_dim = _positive_int(raw, "head_dim", source)
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa") or rates.get(CSA, 4))
    hca = int(raw.get("compress_rate_hca") or rates.get(HCA, 128))
    if raw.get("qk_rope_head_dim") is not None and raw.get("partial_rotary_factor") is None:
        rope_dim = int(raw["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"{source}: rope head dim {rope_dim} must be even and within head_dim {head_dim}")
    heads = _positive_int(raw, "num_attention_heads", source)
    o_groups = _positive_int(raw, "o_groups", source, 8)
    if heads % o_groups:
        raise ConfigError(f"{source}: num_attention_heads {heads} not divisible by o_groups {o_groups}")
    kv_heads = raw.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (shared K=V head), got {kv_heads}")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"{source}: scoring_func {scoring!r} not in {SCORING_FUNCS}")
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    experts = _positive_int(raw, "n_routed_experts", source)
    topk_experts = _positive_int(raw, "num_experts_per_tok", source)
    if topk_experts > experts:
        raise ConfigError(f"{source}: num_experts_per_tok {topk_experts} > n_routed_experts {experts}")
    return ModelArgs(
        vocab_size=_positive_int(raw, "vocab_size", source),
        hidden_size=_positive_int(raw, "hidden_size", source),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=_positive_int(raw, "q_lora_rank", source),
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size", source),
        n_routed_experts=experts,
        num_experts_per_tok=topk_experts,
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        layer_types=_layer_types(raw, n, source),
        mlp_layer_types=_mlp_types(raw, n, source),
        csa_ratio=csa,
        hca_ratio=hca,
        sliding_window=_positive_int(raw, "sliding_window", source, 128),
        o_groups=o_groups,
        o_lora_rank=_positive_int(raw, "o_lora_rank", source, 1024),
        index_n_heads=_positive_int(raw, "index_n_heads", source, 64),
        index_head_dim=_positive_int(raw, "index_head_dim", source, 128),
        index_topk=_positive_int(raw, "index_topk", source, 512),
        rope_head_dim=rope_dim,
        main_rope=_rope(raw, "main", float(raw.get("rope_theta", 10000.0)), source),
        compress_rope=_rope(raw, "compress", float(raw.get("compress_rope_theta", 160000.0)), source),
        hc_mult=_positive_int(raw, "hc_mult", source, 4),
        hc_sinkhorn_iters=_positive_int(raw, "hc_sinkhorn_iters", source, 20),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        scoring_func=scoring,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1 << 20)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        raw=raw,
    )
