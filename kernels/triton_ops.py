"""Triton implementations of V4's three hot attention ops, with `kvmesh.kernels.torch_ops`' API.

    sparse_attention  -> kernels/triton_attention.py  (window + paged compressed entries, sinks)
    compress_windows  -> kernels/triton_compressor.py (gated pooling, RMSNorm, RoPE)
    indexer_topk      -> kernels/triton_indexer.py    (paged key scores, stable top-k)

On CUDA these compile; on CPU they run only under TRITON_INTERPRET=1, which the caller
must set before triton is first imported (the tests do).
"""
from __future__ import annotations

from .triton_attention import sparse_attention
from .triton_compressor import compress_windows
from .triton_indexer import indexer_topk

__all__ = ["sparse_attention", "compress_windows", "indexer_topk"]
