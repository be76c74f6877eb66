"""Triton kernels == torch reference, run by the Triton interpreter on CPU.

TRITON_INTERPRET must be set before the kernels are decorated (at their first import), so
it is set here at module top. In a process where tests/gpu already imported the kernels
compiled for CUDA, this module skips: tests/gpu covers them there.
"""
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvmesh.kernels import get_ops, torch_ops, triton_ops  # noqa: E402
from kvmesh.kernels.triton_attention import _sparse_attn_kernel  # noqa: E402
from kvmesh.kernels.triton_indexer import indexer_scores_paged  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.kernel_cases import attention_case, compressor_case, indexer_case  # noqa: E402

if not isinstance(_sparse_attn_kernel, InterpretedFunction):
    pytest.skip("kernels were compiled for CUDA earlier in this process (tests/gpu covers them); "
                "run this file in its own pytest process to interpret them", allow_module_level=True)

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
F32, BF16 = torch.float32, torch.bfloat16



# --- sparse attention ------------------------------------------------------------------
# (seq_lens, n_queries, heads, head_dim, mode, window, ratio, entries per block, topk, dtype)
ATTENTION_CASES = {
    "decode_csa_d64_epb1": ([1, 37, 300], [1, 1, 1], 4, 64, "csa", 16, 4, 1, 8, F32),
    "prefill_csa_d64_epb4": ([9, 130], [9, 6], 3, 64, "csa", 16, 4, 4, 16, F32),
    "prefill_csa_d128_epb32_bf16": ([5, 200], [2, 5], 8, 128, "csa", 32, 4, 32, 12, BF16),
    "topk_beyond_entries_csa": ([21, 60], [1, 3], 2, 64, "csa", 8, 4, 4, 40, F32),
    "decode_hca_ratio8_d64": ([1, 70, 333], [1, 1, 1], 4, 64, "hca", 16, 8, 4, 0, F32),
    "prefill_hca_ratio16_d128_epb1": ([40, 290], [4, 3], 4, 128, "hca", 16, 16, 1, 0, F32),
    "hca_ratio128_spanning_blocks": ([1, 900], [1, 2], 2, 128, "hca", 16, 128, 1, 0, BF16),
    "decode_hca_d512": ([3, 150], [1, 1], 2, 512, "hca", 8, 8, 4, 0, F32),
    "decode_hca_h16_d512_bf16": ([1, 520, 2000], [1, 1, 1], 16, 512, "hca", 128, 16, 4, 0, BF16),
    "prefill_csa_d512_bf16": ([17, 80], [2, 3], 2, 512, "csa", 8, 4, 4, 8, BF16),
    "swa_only_d128": ([1, 50], [1, 5], 4, 128, "swa", 16, 4, 4, 0, F32),
    "swa_only_bf16_many_heads": ([12], [4], 20, 64, "swa", 8, 4, 4, 0, BF16),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_sparse_attention_matches_torch(case):
    seq_lens, n_q, heads, dim, mode, window, ratio, epb, topk, dtype = case
    args = attention_case(seq_lens, n_q, heads, dim, mode=mode, window=window, ratio=ratio,
                          epb=epb, topk=topk, dtype=dtype)
    assert_close(triton_ops.sparse_attention(**args), torch_ops.sparse_attention(**args), TOL)


def test_sparse_attention_with_nothing_visible_is_all_sink():
    args = attention_case([3], [1], 2, 64, mode="hca", ratio=4)
    args["win_pos"].fill_(-1)
    out = triton_ops.sparse_attention(**args)
    assert torch.equal(out, torch.zeros_like(out))
    assert_close(out, torch_ops.sparse_attention(**args), TOL)


def test_sparse_attention_skips_empty_rows_inside_the_window():
    args = attention_case([40, 90], [3, 2], 2, 64, mode="hca", window=16, ratio=8)
    win_pos = args["win_pos"].clone()
    for b in range(win_pos.shape[0]):
        filled = (win_pos[b] >= 0).nonzero().flatten()
        win_pos[b, filled[[1, 4, -2]]] = -1                     # holes: rows not written yet
    args["win_pos"] = win_pos
    assert_close(triton_ops.sparse_attention(**args), torch_ops.sparse_attention(**args), TOL)


def test_sparse_attention_drops_picks_past_the_causal_limit():
    args = attention_case([64], [1], 2, 64, mode="csa", ratio=4, topk=4)
    args["q_pos"] = torch.tensor([20])                       # only entries < 5 are visible
    args["topk_idx"] = torch.tensor([[3, 9, -1, 15]])
    only_visible = dict(args, topk_idx=torch.tensor([[3, -1, -1, -1]]))
    assert_close(triton_ops.sparse_attention(**args), triton_ops.sparse_attention(**only_visible), TOL)


def test_sparse_attention_reads_strided_views():
    args = attention_case([9, 130], [2, 3], 4, 64, mode="csa", ratio=4, epb=4, topk=8)
    fused = torch.randn(args["q"].shape[0], 6, 64)                 # q as a slice of a wider projection
    fused[:, 1:5] = args["q"]
    views = dict(args, q=fused[:, 1:5], topk_idx=torch.stack([args["topk_idx"]] * 2, -1)[..., 0])
    assert not views["q"].is_contiguous() and not views["topk_idx"].is_contiguous()
    assert_close(triton_ops.sparse_attention(**views), torch_ops.sparse_attention(**args), TOL)


def test_sparse_attention_mixes_a_bf16_cache_with_fp32_queries():
    args = attention_case([9, 130], [2, 3], 4, 64, mode="csa", ratio=4, epb=4, topk=8)
    args = dict(args, comp_cache=args["comp_cache"].bfloat16(), win_kv=args["win_kv"].bfloat16())
    assert_close(triton_ops.sparse_attention(**args), torch_ops.sparse_attention(**args), TOL)


# --- compressor --------------------------------------------------------------------------
# (windows, m, d, overlap, with prev, rope dim, dtype)
COMPRESSOR_CASES = {
    "csa_m4_d64_no_prev": (3, 4, 64, True, False, 16, F32),
    "csa_m4_d128_prev": (5, 4, 128, True, True, 64, F32),
    "csa_m4_d512_prev_bf16": (2, 4, 512, True, True, 64, BF16),
    "csa_one_window_prev": (1, 4, 64, True, True, 64, F32),
    "pool_m8_d64": (4, 8, 64, False, False, 32, BF16),
    "pool_m16_d512": (2, 16, 512, False, False, 64, F32),
    "hca_m128_d128": (2, 128, 128, False, False, 64, F32),
    "hca_m128_d512_bf16": (1, 128, 512, False, False, 64, BF16),
}


@pytest.mark.parametrize("case", COMPRESSOR_CASES.values(), ids=COMPRESSOR_CASES.keys())
def test_compress_windows_matches_torch(case):
    n, m, d, overlap, prev, rope_dim, dtype = case
    args = compressor_case(n, m, d, overlap=overlap, with_prev=prev, rope_dim=rope_dim, dtype=dtype)
    assert_close(triton_ops.compress_windows(**args), torch_ops.compress_windows(**args), TOL)


def test_compress_windows_writes_into_a_cache_block_view():
    args = compressor_case(3, 4, 64, overlap=True, with_prev=True, rope_dim=16)
    cache = torch.randn(2, 8, 64)
    before = cache.clone()
    out = triton_ops.compress_windows(**args, out=cache[1, 2:5])
    assert out.data_ptr() == cache[1, 2:5].data_ptr()
    assert_close(cache[1, 2:5], torch_ops.compress_windows(**args), TOL)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[1, 2:5] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_compress_windows_reads_kv_and_gate_from_one_fused_projection():
    args = compressor_case(3, 4, 64, overlap=True, with_prev=True, rope_dim=16)
    fused = torch.cat([args["kv"], args["gate"]], dim=-1)         # [N, m, 2W]
    views = dict(args, kv=fused[..., :128], gate=fused[..., 128:])
    assert_close(triton_ops.compress_windows(**views), torch_ops.compress_windows(**args), TOL)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_compress_windows_with_a_previous_half_per_window_matches_torch(dtype):
    """Windows of several sequences in one call: each takes its Ca half from prev_* [N, m, d]."""
    args = compressor_case(5, 4, 64, overlap=True, with_prev=True, rope_dim=16, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    per_window = dict(args, prev_kv=torch.randn(5, 4, 64, generator=gen).to(dtype),
                      prev_gate=torch.randn(5, 4, 64, generator=gen).to(dtype))
    per_window["prev_gate"][2] = float("-inf")     # a sequence's first window ever: no previous half
    assert_close(triton_ops.compress_windows(**per_window), torch_ops.compress_windows(**per_window), TOL)


def test_torch_compress_windows_per_window_prev_equals_one_call_per_window():
    args = compressor_case(3, 4, 64, overlap=True, with_prev=True, rope_dim=16)
    gen = torch.Generator().manual_seed(2)
    prev_kv, prev_gate = torch.randn(3, 4, 64, generator=gen), torch.randn(3, 4, 64, generator=gen)
    batched = torch_ops.compress_windows(**dict(args, prev_kv=prev_kv, prev_gate=prev_gate))
    for n in range(3):
        one = dict(args, kv=args["kv"][n:n + 1], gate=args["gate"][n:n + 1], cos=args["cos"][n:n + 1],
                   sin=args["sin"][n:n + 1], prev_kv=prev_kv[n], prev_gate=prev_gate[n])
        torch.testing.assert_close(batched[n:n + 1], torch_ops.compress_windows(**one), atol=0, rtol=0)


def test_compress_windows_rejects_a_wrong_out_shape():
    args = compressor_case(3, 4, 64, overlap=True, with_prev=False, rope_dim=16)
    with pytest.raises(ValueError, match="out must be"):
        triton_ops.compress_windows(**args, out=torch.empty(2, 64))


# --- indexer -----------------------------------------------------------------------------
# (seq_lens, n_queries, heads, head_dim, ratio, entries per block, topk, dtype)
INDEXER_CASES = {
    "decode_epb1_top1": ([1, 40, 300], [1, 1, 1], 4, 64, 4, 1, 1, F32),
    "prefill_epb4_top8": ([9, 300], [9, 7], 4, 64, 4, 4, 8, F32),
    "topk_beyond_visible": ([30, 100], [2, 3], 2, 64, 4, 4, 64, F32),
    "epb32_ratio16_bf16": ([17, 700], [3, 4], 4, 128, 16, 32, 16, BF16),
    "ratio4_d128_epb32": ([1, 520], [1, 6], 8, 128, 4, 32, 32, BF16),
    "many_heads_decode": ([64, 130], [1, 1], 70, 64, 4, 4, 8, F32),
}


@pytest.mark.parametrize("case", INDEXER_CASES.values(), ids=INDEXER_CASES.keys())
def test_indexer_topk_equals_torch_including_ties(case):
    seq_lens, n_q, heads, dim, ratio, epb, topk, dtype = case
    args = indexer_case(seq_lens, n_q, heads, dim, ratio=ratio, epb=epb, topk=topk, dtype=dtype,
                        integer=True)
    assert torch.equal(triton_ops.indexer_topk(**args), torch_ops.indexer_topk(**args))


def _reference_scores(args):
    keys = torch_ops.gather_paged(args["key_cache"], args["block_table"], args["key_len"])
    scores = torch_ops.indexer_scores(args["q"], args["weights"], keys[args["q_seq"]], args["scale"])
    limit = torch.minimum((args["q_pos"] + 1) // args["ratio"], args["key_len"][args["q_seq"]])
    visible = torch.arange(keys.shape[1]).unsqueeze(0) < limit.unsqueeze(1)
    return scores.masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_indexer_scores_and_picks_match_torch_on_random_keys(dtype):
    args = indexer_case([5, 260], [2, 6], 4, 128, ratio=4, epb=4, topk=24, dtype=dtype, seed=3)
    ref_scores = _reference_scores(args)
    scores = indexer_scores_paged(**{k: v for k, v in args.items() if k != "topk"},
                                  n_entries=ref_scores.shape[1])
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)
    picks, ref_picks = triton_ops.indexer_topk(**args), torch_ops.indexer_topk(**args)
    assert torch.equal(picks < 0, ref_picks < 0)
    # near-ties may swap order across implementations; the picked scores may not differ
    got = ref_scores.gather(1, picks.clamp(min=0)).masked_fill(picks < 0, 0)
    want = ref_scores.gather(1, ref_picks.clamp(min=0)).masked_fill(ref_picks < 0, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_indexer_topk_mixes_a_bf16_key_cache_with_fp32_queries():
    args = indexer_case([9, 300], [2, 3], 4, 64, ratio=4, epb=4, topk=8, integer=True)
    args = dict(args, key_cache=args["key_cache"].bfloat16())
    assert torch.equal(triton_ops.indexer_topk(**args), torch_ops.indexer_topk(**args))


def test_indexer_topk_with_no_keys_returns_all_minus_one():
    args = indexer_case([3, 2], [1, 1], 2, 64, ratio=4, topk=4)
    assert torch.equal(triton_ops.indexer_topk(**args), torch.full((2, 4), -1))


# --- registry ----------------------------------------------------------------------------
def test_registry_serves_the_triton_ops():
    ops = get_ops("triton", "cpu")
    assert ops.name == "triton"
    assert ops.sparse_attention is triton_ops.sparse_attention
    assert ops.indexer_topk is triton_ops.indexer_topk


# --- the compiler, not just the interpreter, accepts the kernels ----------------------------
@pytest.mark.slow     # a subprocess compiling every kernel for sm90: ~20 s
def test_kernels_compile_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernel_cases import compile_kernels_for_cuda; print(len(compile_kernels_for_cuda(90)))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split()[-1] == "7"  # kernel variants built


# --- end to end: the engine on the Triton backend ------------------------------------------
@pytest.mark.slow
def test_engine_on_triton_backend_equals_torch_backend(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers import BLOCK_TOKENS, random_prompt, write_tiny_checkpoint
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.engine_config import EngineConfig
    from kvmesh.workers.sampling.params import SamplingParams

    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    prompts = [random_prompt(n, seed=n) for n in (1, 37)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = [Engine(EngineConfig(model=str(path), block_tokens=BLOCK_TOKENS["swa_csa_hca"],
                                kv_cache_bytes=8 << 20, kernel_backend=backend)).generate(prompts, params)
            for backend in ("torch", "triton")]
    for ref, out in zip(*outs):
        assert out.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-5
