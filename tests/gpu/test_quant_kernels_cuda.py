"""Triton FP8 / FP4 GEMMs == the torch reference on CUDA, at serving-sized shapes (V4-Flash
expert and attention projection widths). Skipped without CUDA; never run on this project's
CPU machines (no device was available when they were written)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvmesh.kernels import quant_ops, triton_quant  # noqa: E402
from tests.quant_checkpoint import quantize_fp4, quantize_fp8  # noqa: E402

if isinstance(triton_quant._fp8_linear_kernel, InterpretedFunction):
    pytest.skip("TRITON_INTERPRET was set earlier in this process; run tests/gpu on its own", allow_module_level=True)


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (64, 1024, 4096), (7, 512, 1000)])
def test_fp8_gemm_matches_torch_on_cuda(m, n, k):
    q, s = quantize_fp8(torch.randn(n, k), (128, 128), True)
    x = torch.randn(m, k).to(torch.bfloat16)
    q, s, x = q.cuda(), s.cuda(), x.cuda()
    torch.testing.assert_close(triton_quant.fp8_linear(x, q, s, (128, 128)).float(),
                               quant_ops.fp8_linear(x, q, s, (128, 128)).float(), atol=0.1, rtol=0.03)


def test_fp4_grouped_gemm_matches_torch_on_cuda():
    counts, n, k = [5, 0, 64, 1], 2048, 4096
    experts = [quantize_fp4(torch.randn(n, k), True) for _ in counts]
    packed = torch.stack([p for p, _ in experts]).cuda()
    scale = torch.stack([s for _, s in experts]).cuda()
    x = torch.randn(sum(counts), k).to(torch.bfloat16).cuda()
    offsets = torch.tensor([0] + counts).cumsum(0).cuda()
    out = triton_quant.fp4_grouped_linear(x, packed, scale, offsets)
    ref = torch.cat([quant_ops.fp4_linear(x[offsets[e]:offsets[e + 1]], packed[e], scale[e]) for e in range(len(counts))])
    torch.testing.assert_close(out.float(), ref.float(), atol=0.5, rtol=0.03)
