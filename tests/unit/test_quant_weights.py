"""Quantized weights: the block-scaled FP8 / packed FP4 matmuls equal a plain dequantize-then-
matmul, and a ~100M-parameter released-format checkpoint stays quantized in memory."""
from __future__ import annotations

import math

import pytest
import torch

from kvmesh.kernels import quant_ops
from tests.quant_checkpoint import quantize_fp4, quantize_fp8, random_released_checkpoint


def naive_fp8(weight, scale, block):
    n, k = weight.shape
    out = torch.empty(n, k)
    for i in range(math.ceil(n / block[0])):
        for j in range(math.ceil(k / block[1])):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rs, cs] = weight[rs, cs].float() * scale[i, j].float()
    return out


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((96, 40), (16, 32)), ((7, 5), (128, 128))])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_linear_with_ceil_divided_block_scales_equals_naive_dequant(shape, block, ue8m0, monkeypatch):
    monkeypatch.setattr(quant_ops, "BAND_BYTES", 64 * shape[1])     # force several bands
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8(w, block, ue8m0)
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    dense = naive_fp8(q, s, block)
    assert (dense - w).abs().max() < 0.07 * w.abs().max()            # it is a quantization of w
    x = torch.randn(3, shape[1])
    torch.testing.assert_close(quant_ops.fp8_linear(x, q, s, block), x @ dense.T)
    r0, r1 = 3, shape[0] - 1                                         # rows not on a block boundary
    torch.testing.assert_close(quant_ops.fp8_linear(x, q, s, block, (r0, r1)), x @ dense[r0:r1].T)


def test_fp4_packs_low_nibble_first_and_matmul_equals_naive_dequant():
    packed = torch.tensor([[0x21, 0x7F]], dtype=torch.uint8).view(torch.int8)   # codes 1,2 then 15,7
    assert quant_ops.unpack_fp4(packed).tolist() == [[0.5, 1.0, -6.0, 6.0]]
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp4(w, ue8m0=True)
    assert q.shape == (40, 32) and s.shape == (40, 2)
    dense = quant_ops.unpack_fp4(q) * s.float().repeat_interleave(32, 1)
    x = torch.randn(5, 64)
    torch.testing.assert_close(quant_ops.fp4_linear(x, q, s), x @ dense.T)


# ~100M parameters: 6 MoE layers of 16 experts at hidden 512
BIG = dict(model_type="deepseek_v4", vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
           head_dim=128, qk_rope_head_dim=32, q_lora_rank=256, moe_intermediate_size=512, n_routed_experts=16,
           num_experts_per_tok=2, n_shared_experts=1, o_groups=4, o_lora_rank=128, index_n_heads=4,
           index_head_dim=64, index_topk=8, sliding_window=32, hc_mult=4, num_hash_layers=1,
           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
           layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
           max_position_embeddings=4096, dtype="bfloat16")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow     # writes and loads a ~100M-parameter checkpoint
def test_a_100m_parameter_checkpoint_stays_within_10_percent_of_its_file_bytes(tmp_path):
    from kvmesh.workers.checkpoint.inspect import weight_stats
    from kvmesh.workers.checkpoint.loader import load_model
    path = random_released_checkpoint(tmp_path / "big", BIG)
    file_bytes = (path / "model.safetensors").stat().st_size
    stats = weight_stats(path)
    assert 90e6 < stats.params < 130e6
    rss0 = _rss()
    _, model = load_model(path)
    rss_growth = _rss() - rss0
    from kvmesh.workers.checkpoint.inspect import resident_bytes
    resident = resident_bytes(model)
    assert resident <= 1.10 * file_bytes and resident >= 0.9 * file_bytes
    assert rss_growth <= 1.25 * file_bytes
    assert model.layers[1].ffn.experts.w1.dtype == torch.int8          # FP4 stays packed
