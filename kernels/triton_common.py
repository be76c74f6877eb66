"""Small pieces shared by the Triton kernels: dtype mapping, launch shapes, dot and rounding.

Two interpreter quirks (triton 3.9, TRITON_INTERPRET=1) shape these helpers:
  * `tl.dot` on bf16 operands returns garbage, so CPU launches do every dot in fp32
    (exact for bf16 products, which is also what the torch reference computes);
  * `.to(tl.bfloat16)` truncates instead of rounding to nearest even, so `round_to`
    rounds with integer ops and stores only values that are already representable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MIN_DOT = 16  # smallest M/N/K tl.dot accepts on NVIDIA GPUs


def tl_dtype(dtype: torch.dtype):
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"Triton kernels support {sorted(map(str, _TL_DTYPES))}, got {dtype}") from None


def ieee_dot(device: torch.device, dtype: torch.dtype) -> bool:
    """Do the dots in fp32 (IEEE): always in the interpreter, and for fp32 inputs on GPU."""
    return device.type == "cpu" or dtype == torch.float32


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def attention_config(heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, BLOCK_D, num_warps) for sparse attention. The fp32 accumulator is
    BLOCK_H x BLOCK_D per program, so wide heads get fewer heads per tile; these are the
    largest tiles that ptxas (sm_90, bf16) fits without register spills."""
    block_d = pow2_at_least(head_dim)
    if block_d <= 128:
        max_h, block_n, warps = 64, 32, 4
    elif block_d <= 256:
        max_h, block_n, warps = 32, 32, 8
    else:
        max_h, block_n, warps = 32, 16, 8
    return min(pow2_at_least(heads), max_h), block_n, block_d, warps


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; `a` is cast to b's dtype unless IEEE (then both go fp32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 x rounded (nearest even) to DT's precision, still as fp32."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
