"""mHC mixing weights from the projected streams: the pre/post gates and the doubly
stochastic `comb` matrix (a softmax, then Sinkhorn's alternating normalisation).

`hc_mix(mix, base, scale, n, eps, iters)` is the whole computation after the projection.
In eager torch it is about 130 tiny ops per call at the released 20 iterations (6 per
iteration), two calls per block: on a CPU decode step, where these tensors hold a few
hundred floats, that was 1,024 of the default model's 1,775 dispatched ops. On CPU, with numba
(an install dependency), one compiled loop does it in a single call; elsewhere (CUDA and
CUDA-graph capture, or numba missing) the torch reference runs. Both evaluate the same
float32 formula in the same order, so they agree to float32 rounding
(tests/unit/test_hc_mix.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch

try:        # a missing or broken numba falls back to the torch reference
    import numba
except Exception:   # pragma: no cover - only on machines without numba
    numba = None


def hc_mix_torch(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, eps: float,
                 iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [T, (2+n)n] float32 -> pre [T,n], post [T,n], comb [T,n,n] (the reference formula)."""
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + math.exp(-x))


def _normalize(c, at, n, eps, line, step):
    """comb[i, j] is c[at + i*n + j]. Divide each of the n lines (rows: line=n, step=1; columns:
    line=1, step=n) by its sum + eps."""
    for k in range(n):
        first = at + k * line
        total = np.float32(0.0)
        for m in range(n):
            total += c[first + m * step]
        total += eps
        for m in range(n):
            c[first + m * step] = c[first + m * step] / total


def _hc_mix_loop(mix, base, scale, n, eps, iters, out):
    """Per token: the same operations, in the same order, as hc_mix_torch (float32 throughout).
    mix and out are [T, (2+n)n]; out receives pre, post and comb (row-major) side by side."""
    for t in range(mix.shape[0]):
        x, y = mix[t], out[t]
        for i in range(n):
            y[i] = _sigmoid(x[i] * scale[0] + base[i]) + eps
            y[n + i] = np.float32(2.0) * _sigmoid(x[n + i] * scale[1] + base[n + i])
        at = 2 * n
        for i in range(n):
            k = at + i * n
            m = x[k] * scale[2] + base[k]
            for j in range(n):
                y[k + j] = x[k + j] * scale[2] + base[k + j]
                m = max(m, y[k + j])
            total = np.float32(0.0)
            for j in range(n):
                y[k + j] = math.exp(y[k + j] - m)
                total += y[k + j]
            for j in range(n):
                y[k + j] = y[k + j] / total + eps
        _normalize(y, at, n, eps, 1, n)                # columns
        for _ in range(iters - 1):
            _normalize(y, at, n, eps, n, 1)            # rows
            _normalize(y, at, n, eps, 1, n)            # columns


if numba is not None:
    _sigmoid = numba.njit(cache=True)(_sigmoid)
    _normalize = numba.njit(cache=True)(_normalize)
    _hc_mix_loop = numba.njit(cache=True)(_hc_mix_loop)


def compiled_available() -> bool:
    return numba is not None


def hc_mix(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, eps: float,
           iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As hc_mix_torch; one compiled call on CPU when numba is there."""
    if (numba is None or mix.device.type != "cpu" or mix.requires_grad or mix.dtype != torch.float32
            or base.dtype != torch.float32 or scale.dtype != torch.float32 or not mix.is_contiguous()):
        return hc_mix_torch(mix, base, scale, n, eps, iters)
    out = torch.empty_like(mix)
    _hc_mix_loop(mix.numpy(), base.numpy(), scale.numpy(), n, np.float32(eps), iters, out.numpy())
    return out[:, :n], out[:, n:2 * n], out[:, 2 * n:].view(-1, n, n)
