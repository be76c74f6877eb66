"""The released DeepSeek-V4 configs, architecture fields only, so `kvmesh plan --config V4-Pro`
sizes a deployment without a download.

Values as the model cards / config.json files of deepseek-ai/DeepSeek-V4-Flash and
DeepSeek-V4-Pro give them (FP8 block-scaled linears, FP4 routed experts, one MTP layer);
`compress_ratios` is one entry per main layer here (the shipped list carries extra
entries for the MTP layer, which `ModelArgs` cuts to `num_hidden_layers` anyway).
"""
from __future__ import annotations

_COMMON = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "head_dim": 512, "qk_rope_head_dim": 64,
    "num_key_value_heads": 1, "o_lora_rank": 1024, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "index_n_heads": 64, "index_head_dim": 128, "sliding_window": 128, "num_hash_layers": 3,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

RELEASED_CONFIGS: dict[str, dict] = {
    # 43 layers: two sliding-window only, then CSA / HCA alternating, a last CSA (21 + 20 + 2)
    "V4-Flash": {**_COMMON, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
                 "q_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "moe_intermediate_size": 2048,
                 "index_topk": 512, "compress_ratios": [0, 0] + [4, 128] * 20 + [4]},
    # 61 layers: HCA, HCA, then CSA / HCA alternating, a last CSA (30 CSA + 31 HCA)
    "V4-Pro": {**_COMMON, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
               "q_lora_rank": 1536, "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072,
               "index_topk": 1024, "compress_ratios": [128, 128] + [4, 128] * 29 + [4]},
}
