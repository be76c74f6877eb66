"""`make gpu-check`: everything that only a CUDA device can verify, in one run of <= 8 minutes.

    python bench/gpu_check.py [--out DIR] [--interpret]

On CUDA it checks, and prints as one table (and writes to DIR/gpu_check.json with --out,
which `make gpu-check` passes from $OUT):

* each Triton kernel (sparse attention, compressor, indexer) against its torch reference on
  V4-Flash-shaped inputs (head_dim 512, rope 64, 64 heads, index heads 64 x 128, top-k
  512 and 2048, blocks of 128 tokens), with its time and its fraction of the roofline;
* the FP8 block-scaled GEMM and the FP4 grouped expert GEMM against torch's
  dequantize-then-matmul, same comparison, time and roofline;
* decode step time of the built-in model with and without CUDA graphs, tokens compared;
* tensor parallelism over two ranks (NCCL) against one, when two devices are visible;
* `tests/gpu` (pytest in its own process, so the kernels compile rather than interpret),
  given what is left of the time budget.

The roofline of a case is max(bytes it must move / copy bandwidth, FLOPs / dense bf16
matmul rate), both measured in the same run; "roofline" is that bound over the measured
time. Bytes count each input element the op reads once and its output once (see
bench/kernels.py), so the fraction is an honest lower bound of what the kernel achieves.

Without CUDA it prints one "no CUDA" line and exits 0. `--interpret` runs the kernel and
GEMM comparisons on the CPU under TRITON_INTERPRET=1 at small shapes (how the tests run
this script's own comparison code).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGET_S = 480.0                 # the whole run, tests/gpu included
TESTS_GPU_MIN_S = 60.0           # tests/gpu is skipped when less than this is left
NO_CUDA = "gpu-check: no CUDA device visible (torch.cuda.is_available() is False); nothing to check here."
TOL = {"float32": (5e-5, 5e-5), "bfloat16": (3e-2, 3e-2)}


@dataclass
class Row:
    section: str
    check: str
    status: str                  # ok | FAIL | skip | error
    ms: float | None = None      # the kernel / path under test
    ref_ms: float | None = None  # its reference (torch, eager decode, one rank)
    roofline: float | None = None
    detail: str = ""


@dataclass
class Device:
    name: str
    cuda: bool
    bandwidth_gbs: float | None = None
    bf16_tflops: float | None = None

    def roofline(self, nbytes: float, flops: float, ms: float) -> float | None:
        if not self.cuda or ms <= 0:
            return None
        bound_s = max(nbytes / (self.bandwidth_gbs * 1e9), flops / (self.bf16_tflops * 1e12))
        return bound_s / (ms / 1e3)


def time_ms(fn, cuda: bool) -> float:
    """Median of do_bench on CUDA; one timed call after a warm-up on the CPU (interpreter)."""
    if cuda:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_device(cuda: bool) -> Device:
    import torch
    if not cuda:
        return Device("cpu (Triton interpreter)", False)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (time_ms(lambda: dst.copy_(src), True) / 1e3) / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192 ** 3 / (time_ms(lambda: a @ a, True) / 1e3) / 1e12
    del src, dst, a
    return Device(torch.cuda.get_device_name(), True, bw, tflops)


# --- Triton kernels vs torch ------------------------------------------------------------------
def kernel_cases(small: bool, device: str):
    """(op, label, case kwargs, bytes, flops, exact): V4-Flash shapes, or small ones under the
    interpreter (same code path)."""
    import torch

    from bench.kernels import attention_bytes, compressor_bytes, indexer_bytes
    from tests.kernel_cases import attention_case, compressor_case, indexer_case
    bf16 = torch.bfloat16
    if small:
        d, rope, h, hi, di, b, ctx, topks, win = 64, 16, 4, 8, 32, 2, 300, (8, 24), 16
    else:
        d, rope, h, hi, di, b, ctx, topks, win = 512, 64, 64, 64, 128, 32, 65536, (512, 2048), 128
    epb_csa, epb_hca = (4, 1) if small else (128 // 4, 128 // 128)
    for topk in topks:
        c = attention_case([ctx] * b, [1] * b, h, d, mode="csa", window=win, ratio=4, epb=epb_csa, topk=topk,
                           dtype=bf16, device=device)
        yield ("sparse_attention", f"decode CSA B={b} ctx={ctx} top-k {topk} H{h} D{d}", c, attention_bytes(c),
               4 * b * h * d * (topk + win), False)
    c = attention_case([ctx] * b, [1] * b, h, d, mode="hca", window=win, ratio=128 if not small else 16,
                       epb=epb_hca, dtype=bf16, device=device)
    yield ("sparse_attention", f"decode HCA B={b} ctx={ctx} H{h} D{d}", c, attention_bytes(c),
           4 * b * h * d * (ctx // 128 + win), False)
    chunk = 16 if small else 1024
    c = attention_case([ctx // 8], [chunk], h, d, mode="csa", window=win, ratio=4, epb=epb_csa, topk=topks[0],
                       dtype=bf16, device=device)
    yield ("sparse_attention", f"prefill CSA chunk={chunk} top-k {topks[0]} H{h} D{d}", c, attention_bytes(c),
           4 * chunk * h * d * (topks[0] + win), False)
    n = 8 if small else 8192
    c = compressor_case(n, 4, d, overlap=True, with_prev=True, rope_dim=rope, dtype=bf16, device=device)
    yield "compress_windows", f"CSA m=4 d={d} windows={n}", c, compressor_bytes(c), 0, False
    c = compressor_case(max(1, n // 32), 128, d, overlap=False, with_prev=False, rope_dim=rope, dtype=bf16,
                        device=device)
    yield "compress_windows", f"HCA m=128 d={d} windows={max(1, n // 32)}", c, compressor_bytes(c), 0, False
    for topk in topks:
        c = indexer_case([ctx] * b, [1] * b, hi, di, ratio=4, epb=epb_csa, topk=topk, dtype=bf16, device=device,
                         integer=True)
        yield ("indexer_topk", f"decode B={b} ctx={ctx} Hi{hi} Di{di} top-k {topk}", c, indexer_bytes(c),
               2 * b * hi * di * ctx // 4, True)


def compare(out, ref, exact: bool) -> tuple[bool, str]:
    import torch
    if exact:
        same = torch.equal(out, ref)
        return same, "picks equal" if same else f"{int((out != ref).sum())} picks differ"
    atol, rtol = TOL[str(ref.dtype).removeprefix("torch.")]
    diff = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    ok = out.shape == ref.shape and torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
    return ok, f"max |diff| {diff:.2e}"


def check_kernels(dev: Device, small: bool) -> list[Row]:
    from kvmesh.kernels import torch_ops, triton_ops
    rows = []
    for op, label, case, nbytes, flops, exact in kernel_cases(small, "cuda" if dev.cuda else "cpu"):
        tri, ref = getattr(triton_ops, op), getattr(torch_ops, op)
        ok, detail = compare(tri(**case), ref(**case), exact)
        ms, ref_ms = time_ms(lambda: tri(**case), dev.cuda), time_ms(lambda: ref(**case), dev.cuda)
        rows.append(Row("kernel", f"{op}: {label}", "ok" if ok else "FAIL", ms, ref_ms,
                        dev.roofline(nbytes, flops, ms), detail))
    return rows


# --- FP8 / FP4 GEMMs vs dequantize-then-matmul ----------------------------------------------
def check_gemms(dev: Device, small: bool) -> list[Row]:
    import torch
    import torch.nn.functional as F

    from kvmesh.kernels import quant_ops, triton_quant
    from tests.quant_checkpoint import quantize_fp4, quantize_fp8
    device, bf16, rows = "cuda" if dev.cuda else "cpu", torch.bfloat16, []
    fp8 = [(1, 256, 256), (8, 128, 512)] if small else [(1, 4096, 4096), (64, 32768, 1024), (2048, 4096, 4096)]
    for m, n, k in fp8:
        q, s = (t.to(device) for t in quantize_fp8(torch.randn(n, k), (128, 128), True))
        x = torch.randn(m, k).to(bf16).to(device)
        fused = lambda: triton_quant.fp8_linear(x, q, s, (128, 128))  # noqa: E731
        naive = lambda: F.linear(x, quant_ops.dequant_fp8(q, s, (128, 128), bf16))  # noqa: E731
        ok = torch.allclose(fused().float(), naive().float(), atol=0.1, rtol=0.03)
        ms, ref_ms = time_ms(fused, dev.cuda), time_ms(naive, dev.cuda)
        nbytes, flops = n * k + s.numel() * s.element_size() + 2 * (m * k + m * n), 2 * m * n * k
        rows.append(Row("gemm", f"FP8 block-scaled M={m} N={n} K={k}", "ok" if ok else "FAIL", ms, ref_ms,
                        dev.roofline(nbytes, flops, ms), f"{flops / ms / 1e9:.1f} TFLOP/s"))
    fp4 = [([3, 0, 5, 1], 64, 128)] if small else [([6] * 16, 2048, 4096), ([256] * 16, 2048, 4096)]
    for counts, n, k in fp4:
        experts = [quantize_fp4(torch.randn(n, k), True) for _ in counts]
        packed = torch.stack([p for p, _ in experts]).to(device)
        scale = torch.stack([s for _, s in experts]).to(device)
        x = torch.randn(sum(counts), k).to(bf16).to(device)
        offsets = torch.tensor([0] + counts).cumsum(0).to(device)
        bounds = offsets.tolist()
        fused = lambda: triton_quant.fp4_grouped_linear(x, packed, scale, offsets)  # noqa: E731
        naive = lambda: torch.cat([F.linear(x[bounds[e]:bounds[e + 1]], quant_ops.dequant_fp4(packed[e], scale[e], bf16))  # noqa: E731
                                   for e in range(len(counts))])
        ok = torch.allclose(fused().float(), naive().float(), atol=0.5, rtol=0.03)
        ms, ref_ms = time_ms(fused, dev.cuda), time_ms(naive, dev.cuda)
        t = sum(counts)
        nbytes = packed.numel() + scale.numel() * scale.element_size() + 2 * (t * k + t * n)
        flops = 2 * t * n * k
        rows.append(Row("gemm", f"FP4 grouped E={len(counts)} rows={t} N={n} K={k}", "ok" if ok else "FAIL", ms,
                        ref_ms, dev.roofline(nbytes, flops, ms), f"{flops / ms / 1e9:.1f} TFLOP/s"))
    return rows


# --- decode with / without CUDA graphs, tensor parallelism ----------------------------------------
def decode_run(batch: int, tokens: int, device: str = "cuda", dtype: str = "bfloat16",
               **kw) -> tuple[list[list[int]], float]:
    """(greedy tokens, ms per step of the second, warm run) on the built-in model."""
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.engine_config import EngineConfig
    from kvmesh.workers.sampling.params import SamplingParams
    engine = Engine(EngineConfig(device=device, dtype=dtype, max_num_seqs=batch, **{"speculative_tokens": 0, **kw}))
    prompts = [f"The king said to his servants, number {i}:" for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)                                  # warm-up (captures the graphs)
    steps = engine.counters.steps
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], (time.perf_counter() - start) * 1e3 / (engine.counters.steps - steps)


def check_decode() -> list[Row]:
    rows = []
    for batch in (1, 16):
        eager, eager_ms = decode_run(batch, 64, cuda_graphs=False, max_model_len=1024)
        graphed, graph_ms = decode_run(batch, 64, cuda_graphs=True, max_model_len=1024)
        same = sum(a == b for g, e in zip(graphed, eager) for a, b in zip(g, e))
        total = sum(len(e) for e in eager)
        rows.append(Row("decode", f"built-in model, batch {batch}, CUDA graphs vs eager",
                        "ok" if same == total else "FAIL", graph_ms, eager_ms, None,
                        f"ms/step; {same}/{total} tokens equal, {eager_ms / graph_ms:.2f}x"))
    return rows


def check_tensor_parallel() -> list[Row]:
    import torch
    if torch.cuda.device_count() < 2:
        return [Row("parallel", "tensor_parallel_size=2 over NCCL", "skip",
                    detail=f"{torch.cuda.device_count()} device(s) visible")]
    one, one_ms = decode_run(4, 32)
    two, two_ms = decode_run(4, 32, tensor_parallel_size=2)
    return [Row("parallel", "tensor_parallel_size=2 over NCCL vs 1 rank", "ok" if one == two else "FAIL",
                two_ms, one_ms, None, "ms/step; greedy tokens " + ("equal" if one == two else "differ"))]


# --- tests/gpu ----------------------------------------------------------------------------------
def run_tests_gpu(timeout_s: float) -> Row:
    if timeout_s < TESTS_GPU_MIN_S:
        return Row("tests", "pytest tests/gpu", "skip", detail=f"only {timeout_s:.0f}s of the budget left")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    start = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Row("tests", "pytest tests/gpu", "FAIL", detail=f"timed out after {timeout_s:.0f}s")
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"passed|failed|error|skipped", line)),
                   run.stderr[-200:])
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return Row("tests", "pytest tests/gpu", "ok" if run.returncode == 0 else "FAIL",
               (time.perf_counter() - start) * 1e3, None, None, "; ".join([summary.strip("= ")] + failed[:5]))


# --- the run ------------------------------------------------------------------------------------
def guarded(section: str, fn, *a) -> list[Row]:
    """A section that raises becomes one `error` row; the other sections still run."""
    try:
        return fn(*a)
    except Exception as e:      # noqa: BLE001 - the table reports it
        return [Row(section, fn.__name__, "error", detail=f"{type(e).__name__}: {str(e)[:300]}")]


def table(rows: list[Row], dev: Device) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    head = f"{'section':<8} {'check':<58} {'status':<6} {'ms':>9} {'ref ms':>9} {'roofline':>8}  detail"
    lines = [f"device: {dev.name}" + (f"  copy bandwidth {dev.bandwidth_gbs:,.0f} GB/s, dense bf16 "
                                      f"{dev.bf16_tflops:,.0f} TFLOP/s (measured)" if dev.cuda else ""),
             head, "-" * len(head)]
    for r in rows:
        roof = "-" if r.roofline is None else f"{100 * r.roofline:.0f}%"
        lines.append(f"{r.section:<8} {r.check[:58]:<58} {r.status:<6} {fmt(r.ms, '9.3f')} "
                     f"{fmt(r.ref_ms, '9.3f')} {roof:>8}  {r.detail}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder to write gpu_check.json into (make gpu-check passes $OUT)")
    parser.add_argument("--interpret", action="store_true",
                        help="without CUDA: run the kernel and GEMM comparisons under the Triton interpreter at "
                             "small shapes")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"     # before the kernels are first imported
    try:
        import torch
    except ImportError:
        print(f"gpu-check: torch is not importable by {sys.executable} (run `make setup`)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.interpret
    if not cuda and not args.interpret:
        print(NO_CUDA)
        return 0
    start = time.perf_counter()
    dev = measure_device(cuda)
    rows = guarded("kernel", check_kernels, dev, not cuda) + guarded("gemm", check_gemms, dev, not cuda)
    if cuda:
        rows += guarded("decode", check_decode) + guarded("parallel", check_tensor_parallel)
        rows.append(run_tests_gpu(BUDGET_S - (time.perf_counter() - start) - 10))
    wall = time.perf_counter() - start
    print(table(rows, dev) + f"\n{sum(r.status == 'ok' for r in rows)}/{len(rows)} ok in {wall:.0f}s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = dict(device=dataclasses.asdict(dev), wall_s=wall, rows=[dataclasses.asdict(r) for r in rows])
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if all(r.status in ("ok", "skip") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
