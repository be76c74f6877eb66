"""Triton kernels == torch reference on CUDA, at serving-sized shapes.

Same comparisons as tests/unit/test_triton_kernels.py (which runs the kernels in the
Triton interpreter). The kernels are imported only when CUDA is present, so on a CPU
machine this module never fixes them in compiled mode before the interpreter tests run.
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvmesh.kernels import torch_ops, triton_ops  # noqa: E402
from kvmesh.kernels.triton_attention import _sparse_attn_kernel  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.kernel_cases import attention_case, compressor_case, indexer_case  # noqa: E402

if isinstance(_sparse_attn_kernel, InterpretedFunction):
    pytest.skip("TRITON_INTERPRET was set before the kernels were imported in this process "
                "(tests/unit ran first); run tests/gpu in its own pytest process",
                allow_module_level=True)

DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: dict(atol=5e-5, rtol=5e-5), BF16: dict(atol=3e-2, rtol=3e-2)}



# (seq_lens, n_queries, heads, head_dim, mode, window, ratio, entries per block, topk)
ATTENTION_CASES = {
    "decode_csa_h128_d512": ([1, 700, 4096, 8191] * 4, [1] * 16, 128, 512, "csa", 128, 4, 32, 512),
    "prefill_csa_h64_d512": ([300, 2048], [64, 192], 64, 512, "csa", 128, 4, 32, 512),
    "decode_hca_h128_d512": ([5, 1000, 16384] * 4, [1] * 12, 128, 512, "hca", 128, 128, 1, 0),
    "prefill_hca_d256": ([129, 4000], [17, 128], 32, 256, "hca", 128, 128, 1, 0),
    "decode_csa_d128_h16": ([64, 3000] * 8, [1] * 16, 16, 128, "csa", 128, 4, 32, 256),
    "prefill_swa_d64": ([1, 1000], [1, 200], 24, 64, "swa", 128, 4, 32, 0),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_sparse_attention_matches_torch_on_cuda(case, dtype):
    seq_lens, n_q, heads, dim, mode, window, ratio, epb, topk = case
    args = attention_case(seq_lens, n_q, heads, dim, mode=mode, window=window, ratio=ratio,
                          epb=epb, topk=topk, dtype=dtype, device=DEV)
    assert_close(triton_ops.sparse_attention(**args), torch_ops.sparse_attention(**args), TOL)


# (windows, m, d, overlap, with prev, rope dim)
COMPRESSOR_CASES = {
    "csa_m4_d512_prev": (1024, 4, 512, True, True, 64),
    "csa_m4_d512_no_prev": (257, 4, 512, True, False, 64),
    "hca_m128_d512": (64, 128, 512, False, False, 64),
    "indexer_keys_m4_d128": (1024, 4, 128, True, True, 64),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", COMPRESSOR_CASES.values(), ids=COMPRESSOR_CASES.keys())
def test_compress_windows_matches_torch_on_cuda(case, dtype):
    n, m, d, overlap, prev, rope_dim = case
    args = compressor_case(n, m, d, overlap=overlap, with_prev=prev, rope_dim=rope_dim,
                           dtype=dtype, device=DEV)
    assert_close(triton_ops.compress_windows(**args), torch_ops.compress_windows(**args), TOL)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compress_windows_with_a_previous_half_per_window_matches_torch_on_cuda(dtype):
    """The model's batched compressor update: every window takes its Ca half from prev_* [N, m, d]."""
    args = compressor_case(512, 4, 512, overlap=True, with_prev=True, rope_dim=64, dtype=dtype, device=DEV)
    gen = torch.Generator().manual_seed(1)
    prev_kv = torch.randn(512, 4, 512, generator=gen).to(dtype).to(DEV)
    prev_gate = torch.randn(512, 4, 512, generator=gen).to(dtype).to(DEV)
    prev_gate[::7] = float("-inf")
    args = dict(args, prev_kv=prev_kv, prev_gate=prev_gate)
    assert_close(triton_ops.compress_windows(**args), torch_ops.compress_windows(**args), TOL)


# (seq_lens, n_queries, heads, head_dim, ratio, entries per block, topk)
INDEXER_CASES = {
    "decode_top512": ([1, 900, 8192, 16384] * 4, [1] * 16, 64, 128, 4, 32, 512),
    "prefill_top512": ([700, 6000], [100, 156], 64, 128, 4, 32, 512),
    "decode_top2048_epb1": ([3000, 12000], [1, 1], 32, 128, 4, 1, 2048),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", INDEXER_CASES.values(), ids=INDEXER_CASES.keys())
def test_indexer_topk_equals_torch_including_ties_on_cuda(case, dtype):
    seq_lens, n_q, heads, dim, ratio, epb, topk = case
    args = indexer_case(seq_lens, n_q, heads, dim, ratio=ratio, epb=epb, topk=topk, dtype=dtype,
                        device=DEV, integer=True)
    assert torch.equal(triton_ops.indexer_topk(**args), torch_ops.indexer_topk(**args))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_indexer_picks_match_torch_scores_on_random_keys_on_cuda(dtype):
    args = indexer_case([900, 8192], [8, 64], 64, 128, ratio=4, epb=32, topk=512, dtype=dtype,
                        device=DEV, seed=5)
    keys = torch_ops.gather_paged(args["key_cache"], args["block_table"], args["key_len"])
    ref_scores = torch_ops.indexer_scores(args["q"], args["weights"], keys[args["q_seq"]],
                                          args["scale"])
    picks, ref_picks = triton_ops.indexer_topk(**args), torch_ops.indexer_topk(**args)
    assert torch.equal(picks < 0, ref_picks < 0)
    got = ref_scores.gather(1, picks.clamp(min=0)).masked_fill(picks < 0, 0)
    want = ref_scores.gather(1, ref_picks.clamp(min=0)).masked_fill(ref_picks < 0, 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
