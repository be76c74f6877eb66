"""Time the Triton kernels against their torch references, against a bandwidth roofline.

    python bench/kernels.py [--dtype bf16|fp32] [--small]

For each case it prints the median time of both implementations, the speed-up, and the
achieved bandwidth: bytes the op must touch / time, where "must touch" counts each input
element the op reads (each distinct cache row a sequence's queries can see, once), and its
output, once. Scratch traffic (the indexer's score matrix, re-reads served by L2) is not
counted, so "% peak" is an honest fraction of the roofline. Peak is measured in the same
run with a 1 GiB device-to-device copy. The attention and indexer are decode-bound ops
(bytes dominate FLOPs), which is why a bandwidth roofline is the right yardstick.

Triton needs CUDA; on a CPU machine only the torch reference is timed (small shapes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvmesh.kernels import torch_ops  # noqa: E402
from tests.kernel_cases import attention_case, compressor_case, indexer_case  # noqa: E402

PEAK_COPY_BYTES = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def attention_bytes(c: dict) -> int:
    """q, out, index tensors, every window row, and each sequence's distinct visible entries."""
    row = c["q"].shape[-1] * c["q"].element_size()
    total = 2 * _nbytes(c["q"]) + _nbytes(c["q_pos"], c["q_seq"], c["win_kv"], c["win_pos"],
                                          c["sinks"], c["topk_idx"], c["block_table"])
    if c["comp_cache"] is None:
        return total
    limit = torch.minimum((c["q_pos"] + 1) // c["ratio"], c["comp_len"][c["q_seq"]])
    for b in range(c["comp_len"].shape[0]):
        mine = c["q_seq"] == b
        if not bool(mine.any()):
            continue
        if c["topk_idx"] is None:
            total += int(limit[mine].max()) * row
        else:
            picks = c["topk_idx"][mine]
            visible = (picks >= 0) & (picks < limit[mine].unsqueeze(1))
            total += int(picks[visible].unique().numel()) * row
    return total


def compressor_bytes(c: dict) -> int:
    n, _, width = c["kv"].shape
    d = width // 2 if c["overlap"] else width
    return _nbytes(c["kv"], c["gate"], c["ape"], c["prev_kv"], c["prev_gate"], c["norm_weight"],
                   c["cos"], c["sin"]) + n * d * c["kv"].element_size()


def indexer_bytes(c: dict) -> int:
    row = c["q"].shape[-1] * c["q"].element_size()
    limit = torch.minimum((c["q_pos"] + 1) // c["ratio"], c["key_len"][c["q_seq"]])
    per_seq = torch.zeros_like(c["key_len"]).scatter_reduce(0, c["q_seq"], limit, "amax")
    return (_nbytes(c["q"], c["weights"], c["q_pos"], c["q_seq"], c["block_table"])
            + int(per_seq.sum()) * row + c["q"].shape[0] * c["topk"] * 8)


def cases(dtype, device, small: bool):
    """(op name, case label, kwargs, bytes function); --small divides lengths, batch, heads by 8."""
    s = 8 if small else 1
    b, h, hp = max(1, 32 // s), 128 // s, 64 // s
    ctx_csa, ctx_hca, ctx_pre, chunk, ctx_idx = 32768 // s, 131072 // s, 8192 // s, 512 // s, 65536 // s
    yield ("sparse_attention", f"decode CSA B={b} ctx={ctx_csa} top512 H{h} D512",
           attention_case([ctx_csa] * b, [1] * b, h, 512, mode="csa", window=128, ratio=4,
                          epb=32, topk=512, dtype=dtype, device=device), attention_bytes)
    yield ("sparse_attention", f"decode HCA B={b} ctx={ctx_hca} H{h} D512",
           attention_case([ctx_hca] * b, [1] * b, h, 512, mode="hca", window=128, ratio=128,
                          epb=1, dtype=dtype, device=device), attention_bytes)
    yield ("sparse_attention", f"prefill CSA chunk={chunk} ctx={ctx_pre} top512 H{hp} D512",
           attention_case([ctx_pre], [chunk], hp, 512, mode="csa", window=128, ratio=4, epb=32,
                          topk=512, dtype=dtype, device=device), attention_bytes)
    yield ("compress_windows", f"CSA m=4 d=512 windows={8192 // s}",
           compressor_case(8192 // s, 4, 512, overlap=True, with_prev=True, dtype=dtype,
                           device=device), compressor_bytes)
    yield ("compress_windows", f"HCA m=128 d=512 windows={256 // s}",
           compressor_case(256 // s, 128, 512, overlap=False, with_prev=False, dtype=dtype,
                           device=device), compressor_bytes)
    yield ("indexer_topk", f"decode B={b} ctx={ctx_idx} Hi64 Di128 top512",
           indexer_case([ctx_idx] * b, [1] * b, 64, 128, ratio=4, epb=32, topk=512, dtype=dtype,
                        device=device), indexer_bytes)


def time_ms(fn, device) -> float:
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_bandwidth_gbs() -> float:
    src = torch.empty(PEAK_COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), "cuda")
    return 2 * PEAK_COPY_BYTES / ms / 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--small", action="store_true", help="shrunken shapes (quick smoke run)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = args.small or device == "cpu"
    triton_ops = None
    if device == "cuda":
        from kvmesh.kernels import triton_ops
        peak = peak_bandwidth_gbs()
        print(f"device: {torch.cuda.get_device_name()}  measured copy bandwidth: {peak:,.0f} GB/s")
    else:
        peak = None
        print("bench/kernels.py: the Triton kernels need CUDA; timing the torch reference only "
              "(small shapes).")
    header = (f"{'op':<17} {'case':<44} {'MB':>8} {'torch ms':>9} {'triton ms':>10} "
              f"{'speed-up':>8} {'torch GB/s':>10} {'triton GB/s':>11} {'% peak':>7}")
    print(header + "\n" + "-" * len(header))
    for op, name, case, count in cases(DTYPES[args.dtype], device, small):
        nbytes = count(case)
        t_ref = time_ms(lambda: getattr(torch_ops, op)(**case), device)
        cols = ["-"] * 4
        if triton_ops is not None:
            t_tri = time_ms(lambda: getattr(triton_ops, op)(**case), device)
            gbs = nbytes / t_tri / 1e6
            cols = [f"{t_tri:.3f}", f"{t_ref / t_tri:.2f}x", f"{gbs:,.0f}", f"{100 * gbs / peak:.0f}%"]
        print(f"{op:<17} {name:<44} {nbytes / 1e6:>8.1f} {t_ref:>9.3f} {cols[0]:>10} {cols[1]:>8} "
              f"{nbytes / t_ref / 1e6:>10,.0f} {cols[2]:>11} {cols[3]:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
