"""Triton FP8 block-scaled GEMM and FP4 grouped expert GEMM == the torch reference
(`kvmesh.kernels.quant_ops`), run by the Triton interpreter on CPU (small shapes: it is slow)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvmesh.kernels import quant_ops, triton_quant  # noqa: E402
from tests.quant_checkpoint import quantize_fp4, quantize_fp8  # noqa: E402

if not isinstance(triton_quant._fp8_linear_kernel, InterpretedFunction):
    pytest.skip("kernels were compiled for CUDA earlier in this process; run this file in its own process",
                allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("m,n,k,block,ue8m0,rows,dtype", [
    (3, 40, 64, (16, 32), False, None, torch.float32),          # many blocks, ceil-divided N
    (17, 33, 50, (128, 128), True, None, torch.float32),        # one partial block, odd shapes
    (5, 64, 96, (16, 16), True, (8, 40), torch.float32),        # row range off block boundaries
    (4, 32, 64, (32, 32), True, None, torch.bfloat16),
])
def test_fp8_block_scaled_gemm_matches_torch(m, n, k, block, ue8m0, rows, dtype):
    q, s = quantize_fp8(torch.randn(n, k, generator=_gen(0)), block, ue8m0)
    x = torch.randn(m, k, generator=_gen(1)).to(dtype)
    ref = quant_ops.fp8_linear(x, q, s, block, rows)
    out = triton_quant.fp8_linear(x, q, s, block, rows)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_e4m3_decoding_covers_subnormals_signs_and_max():
    q = torch.tensor([[0.0, -0.0, 2 ** -9, -2 ** -7, 1.0, -1.75, 448.0, -448.0, 0.015625, 3.5, 240.0, -6.0,
                       2 ** -6, 0.125, 96.0, -0.5]]).to(torch.float8_e4m3fn)
    s = torch.ones(1, 1)
    x = torch.eye(16)
    torch.testing.assert_close(triton_quant.fp8_linear(x, q, s, (128, 128)), quant_ops.fp8_linear(x, q, s, (128, 128)))


@pytest.mark.parametrize("counts,n,k,ue8m0,dtype", [
    ([3, 0, 17, 1], 40, 64, True, torch.float32),     # an expert with no rows, one with >1 row tile
    ([5, 2], 32, 96, False, torch.float32),
    ([4, 4, 4], 16, 64, True, torch.bfloat16),
])
def test_fp4_grouped_expert_gemm_matches_torch(counts, n, k, ue8m0, dtype):
    experts = [quantize_fp4(torch.randn(n, k, generator=_gen(10 + e)), ue8m0) for e in range(len(counts))]
    packed = torch.stack([p for p, _ in experts])
    scale = torch.stack([s for _, s in experts])
    x = torch.randn(sum(counts), k, generator=_gen(2)).to(dtype)
    offsets = torch.tensor([0] + counts).cumsum(0)
    out = triton_quant.fp4_grouped_linear(x, packed, scale, offsets)
    ref = torch.cat([quant_ops.fp4_linear(x[offsets[e]:offsets[e + 1]], packed[e], scale[e])
                     for e in range(len(counts))])
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(triton_quant.fp4_linear(x[:3], packed[0], scale[0]).float(),
                               quant_ops.fp4_linear(x[:3], packed[0], scale[0]).float(), **TOL[dtype])


def test_quant_experts_grouped_path_equals_the_per_expert_torch_path():
    from kvmesh.workers.model.quant import QuantExperts, QuantFormat
    e, n, k, t, topk = 4, 32, 64, 9, 2
    weights = {}
    for w, shape in (("w1", (n, k)), ("w3", (n, k)), ("w2", (k, n))):
        qs = [quantize_fp4(torch.randn(shape, generator=_gen(20 + i)) * 0.1, True) for i in range(e)]
        weights[w] = (torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]))
    from kvmesh.workers.model.moe import swiglu
    experts = QuantExperts(weights, QuantFormat(expert_dtype="fp4"), limit=10.0, act=swiglu)
    x = torch.randn(t, k, generator=_gen(3))
    idx = torch.stack([torch.randperm(e, generator=_gen(30 + i))[:topk] for i in range(t)])
    gate = torch.rand(t, topk, generator=_gen(4))
    torch.testing.assert_close(experts._grouped(x, idx, gate), experts(x, idx, gate), atol=1e-4, rtol=1e-4)
