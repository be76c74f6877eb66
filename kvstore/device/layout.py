"""Cache layout: one frozen spec per layer type, naming the tensors its blocks and its
state slot hold (name, shape, dtype); every size follows from those tensor specs.

The classical (compressed) cache is paged in blocks of `block_tokens` original tokens;
one block id addresses the same token range in every layer (EPB = block_tokens/m entries):

    CSA layer, one block:  | comp: EPB x head_dim | idx: EPB x index_head_dim |
    HCA layer, one block:  | comp: EPB x head_dim |
    SWA layer:             (nothing: all its state is in the slot)

The state cache is one fixed-size slot per running request:

    every layer:  | ring: window x head_dim (SWA K=V) |
    CSA adds:     | tail_kv, tail_gate: m x 2*head_dim | itail_kv, itail_gate: m x 2*index_head_dim |
                  | ovl_kv, ovl_gate: m x head_dim | iovl_kv, iovl_gate: m x index_head_dim |
    HCA adds:     | tail_kv, tail_gate: m' x head_dim |

With `swa_blocks` (the `full` SWA policy) blocks also carry what rebuilding the state at
any block boundary needs:

    every layer:  | swa: block_tokens x head_dim (K=V of the block's tokens) |
    CSA adds:     | bovl_kv, bovl_gate: m x head_dim | biovl_kv, biovl_gate: m x index_head_dim |

A checkpoint (the state at a block boundary) is the slot's `ring` and overlap tensors.

Tensor dtypes: the compute dtype for rings, tails, overlap state and SWA K=V; the KV dtype
for `comp` and `idx`. With `kv_dtype="fp8"` that dtype is an FP8 record format
(`kvstore/device/fp8_kv.py`): the tensor is [EPB, D] values stored as EPB records of bytes
(e4m3 non-RoPE dims + ue8m0 scales + bf16 RoPE dims, 584 B instead of 1,024 B per entry at
V4's shape; indexer keys e4m3 + an fp32 scale, 132 B instead of 256 B).

kvstore imports nothing from workers: `LayoutParams` carries the plain numbers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvmesh.kvstore.device.fp8_kv import Fp8EntryFormat

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYOUT_VERSION = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
KV_DTYPES = ("auto", "bfloat16", "fp8")

KVDType = str | Fp8EntryFormat      # a torch dtype name, or FP8 records stored as bytes


class LayoutError(ValueError):
    """block_tokens or the model shape cannot form a valid cache layout."""


@dataclass(frozen=True)
class TensorSpec:
    """One cache tensor, per block or per state slot (the block/slot dimension is not in
    `shape`). `name` keys it in block and checkpoint objects and in transfers ("{layer}.{name}")."""
    name: str
    shape: tuple[int, ...]          # values: [entries, dim] for entries and keys
    dtype: KVDType
    fill: float = 0.0               # what a fresh slot holds: -inf for overlap gates (no previous window)
    checkpoint: bool = False        # slot tensors a checkpoint at a block boundary carries

    @property
    def record(self) -> Fp8EntryFormat | None:
        return self.dtype if isinstance(self.dtype, Fp8EntryFormat) else None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """FP8 records: [EPB x record bytes], all entries' data then all scales."""
        return (self.record.block_bytes(self.shape[0]),) if self.record else self.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.record else getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * self.torch_dtype.itemsize


@dataclass(frozen=True)
class CompressorSpec:
    """The tensors of one compressor: a layer's main one (entries at head_dim) or its
    indexer's (keys at index_head_dim). Overlap state only when windows overlap (CSA)."""
    entries: TensorSpec                         # block [EPB, D]
    tail_kv: TensorSpec                         # slot [m, W]: rows of the open window
    tail_gate: TensorSpec
    ovl_kv: TensorSpec | None = None            # slot [m, D]: the last window's Ca half
    ovl_gate: TensorSpec | None = None
    block_ovl_kv: TensorSpec | None = None      # block [m, D]: the same at the block's end (swa_blocks)
    block_ovl_gate: TensorSpec | None = None

    @property
    def overlap(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in (self.ovl_kv, self.ovl_gate) if t)

    @property
    def block_overlap(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in (self.block_ovl_kv, self.block_ovl_gate) if t)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache: the tensors of a block of `block_tokens` tokens and of a state slot."""
    block_tokens: int
    head_dim: int
    window: int
    dtype: str                      # compute dtype: ring, tails, overlap state, SWA K=V
    ratio: int = 0
    index_head_dim: int = 0
    entry_dtype: KVDType = ""       # compressed entries (a dtype name or an FP8 record format)
    index_dtype: KVDType = ""       # indexer keys

    @property
    def entries_per_block(self) -> int:
        return self.block_tokens // self.ratio if self.ratio else 0

    @property
    def ring(self) -> TensorSpec:
        return TensorSpec("ring", (self.window, self.head_dim), self.dtype, checkpoint=True)

    @property
    def swa(self) -> TensorSpec:
        return TensorSpec("swa", (self.block_tokens, self.head_dim), self.dtype)

    def compressor(self, swa_blocks: bool = False) -> CompressorSpec | None:
        """The main compressor's tensors (CSA, HCA)."""
        return None

    def indexer(self, swa_blocks: bool = False) -> CompressorSpec | None:
        """The indexer's compressor's tensors (CSA)."""
        return None

    def _compressor(self, prefix: str, entries: str, dim: int, dtype: KVDType, overlap: bool,
                    swa_blocks: bool) -> CompressorSpec:
        m, t = self.ratio, self.dtype
        width = 2 * dim if overlap else dim                   # overlapping windows: (Ca, Cb) halves
        main = (TensorSpec(entries, (self.entries_per_block, dim), dtype),
                TensorSpec(f"{prefix}tail_kv", (m, width), t), TensorSpec(f"{prefix}tail_gate", (m, width), t))
        if not overlap:
            return CompressorSpec(*main)
        ovl = (TensorSpec(f"{prefix}ovl_kv", (m, dim), t, checkpoint=True),
               TensorSpec(f"{prefix}ovl_gate", (m, dim), t, fill=float("-inf"), checkpoint=True))
        bovl = ((TensorSpec(f"b{prefix}ovl_kv", (m, dim), t), TensorSpec(f"b{prefix}ovl_gate", (m, dim), t))
                if swa_blocks else (None, None))
        return CompressorSpec(*main, *ovl, *bovl)

    def _compressors(self, swa_blocks: bool) -> list[CompressorSpec]:
        return [c for c in (self.compressor(swa_blocks), self.indexer(swa_blocks)) if c]

    @functools.cache                # specs are frozen: build each layer type's tensor list once
    def block_tensors(self, swa_blocks: bool = False) -> tuple[TensorSpec, ...]:
        """What one block holds in this layer (with swa_blocks also its tokens' SWA K=V and
        the end-of-block overlap state)."""
        comps = self._compressors(swa_blocks)
        return ((self.swa,) * swa_blocks + tuple(c.entries for c in comps)
                + tuple(t for c in comps for t in c.block_overlap))

    @functools.cache
    def state_tensors(self) -> tuple[TensorSpec, ...]:
        """What one state slot holds in this layer."""
        comps = self._compressors(False)
        return ((self.ring,) + tuple(t for c in comps for t in (c.tail_kv, c.tail_gate))
                + tuple(t for c in comps for t in c.overlap))

    def block_bytes(self) -> int:
        return sum(t.nbytes for t in self.block_tensors())

    def swa_block_bytes(self) -> int:
        """What a block also carries under the `full` policy."""
        return sum(t.nbytes for t in self.block_tensors(True)) - self.block_bytes()

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors())

    def checkpoint_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors() if t.checkpoint)


@dataclass(frozen=True)
class SWASpec(LayerSpec):
    pass


@dataclass(frozen=True)
class HCASpec(LayerSpec):
    def compressor(self, swa_blocks: bool = False) -> CompressorSpec:
        return self._compressor("", "comp", self.head_dim, self.entry_dtype, False, swa_blocks)


@dataclass(frozen=True)
class CSASpec(LayerSpec):
    def compressor(self, swa_blocks: bool = False) -> CompressorSpec:
        return self._compressor("", "comp", self.head_dim, self.entry_dtype, True, swa_blocks)

    def indexer(self, swa_blocks: bool = False) -> CompressorSpec:
        return self._compressor("i", "idx", self.index_head_dim, self.index_dtype, True, swa_blocks)


SPEC_FOR_TYPE = {SWA: SWASpec, CSA: CSASpec, HCA: HCASpec}


@dataclass(frozen=True)
class LayoutParams:
    layer_types: tuple[str, ...]
    head_dim: int
    index_head_dim: int
    csa_ratio: int
    hca_ratio: int
    window: int
    dtype: str = "bfloat16"         # compute dtype: SWA rings, tails, overlap state
    kv_dtype: str = "auto"          # compressed entries + indexer keys: auto (= dtype) | bfloat16 | fp8
    rope_dim: int = 0               # trailing RoPE dims of an entry (kept in bf16 under fp8)

    @property
    def entry_dtype(self) -> str:
        return self.dtype if self.kv_dtype == "auto" else self.kv_dtype

    def kv_dtypes(self) -> tuple[KVDType, KVDType]:
        """(compressed entries, indexer keys) dtypes: a dtype name, or FP8 record formats."""
        if self.entry_dtype == "fp8":
            return Fp8EntryFormat.main(self.head_dim, self.rope_dim), Fp8EntryFormat.indexer(self.index_head_dim)
        return self.entry_dtype, self.entry_dtype


@dataclass(frozen=True)
class CacheLayout:
    params: LayoutParams
    block_tokens: int
    specs: tuple[LayerSpec, ...]

    @classmethod
    def build(cls, params: LayoutParams, block_tokens: int = 128) -> "CacheLayout":
        if params.dtype not in DTYPE_BYTES:
            raise LayoutError(f"unsupported cache dtype {params.dtype!r}; one of {sorted(DTYPE_BYTES)}")
        if params.kv_dtype not in KV_DTYPES:
            raise LayoutError(f"unsupported kv_cache_dtype {params.kv_dtype!r}; one of {KV_DTYPES}")
        if params.entry_dtype == "fp8" and not 0 < params.rope_dim < params.head_dim:
            raise LayoutError(f"kv_cache_dtype fp8 needs 0 < rope_dim < head_dim, got {params.rope_dim}")
        ratio = {CSA: params.csa_ratio, HCA: params.hca_ratio, SWA: 0}
        unit = math.lcm(*[r for r in map(ratio.get, params.layer_types) if r] or [1])
        if block_tokens <= 0 or block_tokens % unit:
            raise LayoutError(f"block_tokens={block_tokens} must be a positive multiple of {unit} "
                              f"(lcm of the compress ratios) so no compressor window spans two blocks")
        entry, index = params.kv_dtypes()
        specs = tuple(SPEC_FOR_TYPE[t](block_tokens=block_tokens, head_dim=params.head_dim, window=params.window,
                                       dtype=params.dtype, ratio=ratio[t],
                                       index_head_dim=params.index_head_dim if t == CSA else 0,
                                       entry_dtype=entry if t != SWA else "", index_dtype=index if t == CSA else "")
                      for t in params.layer_types)
        return cls(params=params, block_tokens=block_tokens, specs=specs)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return sum(s.block_bytes() for s in self.specs)

    def resident_block_bytes(self, swa_blocks: bool) -> int:
        """Bytes of one block in memory: compressed entries, plus SWA K=V and end-of-block
        overlap state when blocks carry them (the `full` policy)."""
        extra = sum(s.swa_block_bytes() for s in self.specs) if swa_blocks else 0
        return self.block_bytes + extra

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state slot across all layers."""
        return sum(s.state_bytes() for s in self.specs)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint (the state at a block boundary: rings + CSA overlap state)."""
        return sum(s.checkpoint_bytes() for s in self.specs)

    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_tokens

    def bytes_per_token_by_type(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, s in zip(self.params.layer_types, self.specs):
            out[t] = out.get(t, 0.0) + s.block_bytes() / self.block_tokens
        return out

    def layer_count_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.params.layer_types:
            out[t] = out.get(t, 0) + 1
        return out

    def footprint(self, context_tokens: int) -> int:
        """KV bytes of one request at `context_tokens`: its blocks plus one state slot."""
        blocks = -(-context_tokens // self.block_tokens)
        return blocks * self.block_bytes + self.slot_bytes

    def swa_bytes_per_token(self) -> float:
        """SWA K=V bytes per token across layers (what the `full` policy persists)."""
        return sum(s.swa.nbytes for s in self.specs) / self.block_tokens
