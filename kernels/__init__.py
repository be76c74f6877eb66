"""Attention, compressor and indexer ops behind one API: torch on CPU, Triton on CUDA.

`get_ops(backend, device)` returns a `KernelOps` whose three functions share the
signatures of `kvmesh.kernels.torch_ops`. Triton is imported lazily, so `import kvmesh.kernels`
works on machines without it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

BACKENDS = ("auto", "torch", "triton")


class KernelOps(NamedTuple):
    name: str
    sparse_attention: Callable
    compress_windows: Callable
    indexer_topk: Callable


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here."""


def _torch_ops() -> KernelOps:
    from . import torch_ops as t
    return KernelOps("torch", t.sparse_attention, t.compress_windows, t.indexer_topk)


def _triton_ops() -> KernelOps:
    try:
        from . import triton_ops as t
    except ImportError as e:
        raise KernelBackendError(f"triton kernels unavailable: {e}") from e
    return KernelOps("triton", t.sparse_attention, t.compress_windows, t.indexer_topk)


def get_ops(backend: str = "auto", device_type: str = "cpu") -> KernelOps:
    """'auto' picks Triton on CUDA and torch elsewhere; 'triton' on CPU needs TRITON_INTERPRET=1
    set by the caller before triton is first imported."""
    if backend not in BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "torch"
    return _triton_ops() if backend == "triton" else _torch_ops()
