"""Cache layout: one frozen spec per layer type, each computing its own sizes.

The classical (compressed) cache is paged in blocks of `block_tokens` original tokens;
one block id addresses the same token range in every layer:

    CSA layer, one block:  | block_tokens/m entries x head_dim | block_tokens/m keys x index_head_dim |
    HCA layer, one block:  | block_tokens/m' entries x head_dim |
    SWA layer:             (nothing: all its state is in the slot)

The state cache is one fixed-size slot per running request:

    every layer:  | SWA ring: window x head_dim |
    CSA adds:     | tails: m x 2*head_dim (kv, gate) | indexer tails: m x 2*index_head_dim (kv, gate) |
                  | overlap: m x head_dim (kv, gate) | indexer overlap: m x index_head_dim (kv, gate) |
    HCA adds:     | tails: m' x head_dim (kv, gate) |

With `kv_dtype="fp8"` the compressed entries and indexer keys are FP8 records
(`kvstore/fp8_kv.py`: e4m3 non-RoPE dims + ue8m0 scales + bf16 RoPE dims, 584 B instead of
1,024 B per entry at V4's shape; indexer keys e4m3 + an fp32 scale, 132 B instead of 256 B);
the SWA rings, tails and overlap state stay in the compute dtype.

kvstore imports nothing from workers: `LayoutParams` carries the plain numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .fp8_kv import Fp8EntryFormat

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYOUT_VERSION = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
KV_DTYPES = ("auto", "bfloat16", "fp8")


class LayoutError(ValueError):
    """block_tokens or the model shape cannot form a valid cache layout."""


@dataclass(frozen=True)
class LayerSpec:
    head_dim: int
    window: int
    dtype_bytes: int
    ratio: int = 0
    index_head_dim: int = 0
    entry_bytes: int = 0            # one compressed entry (head_dim values, or an FP8 record)
    index_entry_bytes: int = 0      # one indexer key

    def entries_per_block(self, block_tokens: int) -> int:
        return block_tokens // self.ratio if self.ratio else 0

    def block_bytes(self, block_tokens: int) -> int:
        return 0

    def swa_block_bytes(self, block_tokens: int) -> int:
        """What a block also carries under the `full` policy: its tokens' SWA K=V."""
        return block_tokens * self.head_dim * self.dtype_bytes

    def state_bytes(self) -> int:
        return self.window * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class SWASpec(LayerSpec):
    pass


@dataclass(frozen=True)
class HCASpec(LayerSpec):
    def block_bytes(self, block_tokens: int) -> int:
        return self.entries_per_block(block_tokens) * self.entry_bytes

    def state_bytes(self) -> int:
        tails = 2 * self.ratio * self.head_dim
        return super().state_bytes() + tails * self.dtype_bytes


@dataclass(frozen=True)
class CSASpec(LayerSpec):
    def block_bytes(self, block_tokens: int) -> int:
        return self.entries_per_block(block_tokens) * (self.entry_bytes + self.index_entry_bytes)

    def swa_block_bytes(self, block_tokens: int) -> int:
        """Plus the overlap state at the block's end (kv and gate, compressor and indexer)."""
        overlap = 2 * self.ratio * (self.head_dim + self.index_head_dim) * self.dtype_bytes
        return super().swa_block_bytes(block_tokens) + overlap

    def state_bytes(self) -> int:
        d, di, m = self.head_dim, self.index_head_dim, self.ratio
        tails = 2 * m * 2 * d + 2 * m * 2 * di
        overlap = 2 * m * d + 2 * m * di
        return super().state_bytes() + (tails + overlap) * self.dtype_bytes


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

    def entry_formats(self) -> dict[str, Fp8EntryFormat]:
        """FP8 record formats by block field ("comp", "idx"); empty for a float cache."""
        if self.entry_dtype != "fp8":
            return {}
        return {"comp": Fp8EntryFormat.main(self.head_dim, self.rope_dim),
                "idx": Fp8EntryFormat.indexer(self.index_head_dim)}


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
        b = DTYPE_BYTES[params.dtype]
        fmts = params.entry_formats()
        eb = DTYPE_BYTES.get(params.entry_dtype, 0)
        entry = fmts["comp"].entry_bytes if fmts else params.head_dim * eb
        index_entry = fmts["idx"].entry_bytes if fmts else params.index_head_dim * eb
        ratio = {CSA: params.csa_ratio, HCA: params.hca_ratio, SWA: 0}
        specs = tuple(SPEC_FOR_TYPE[t](head_dim=params.head_dim, window=params.window, dtype_bytes=b,
                                       ratio=ratio[t], index_head_dim=params.index_head_dim if t == CSA else 0,
                                       entry_bytes=entry if t != SWA else 0,
                                       index_entry_bytes=index_entry if t == CSA else 0)
                      for t in params.layer_types)
        unit = math.lcm(*[s.ratio for s in specs if s.ratio] or [1])
        if block_tokens <= 0 or block_tokens % unit:
            raise LayoutError(f"block_tokens={block_tokens} must be a positive multiple of {unit} "
                              f"(lcm of the compress ratios) so no compressor window spans two blocks")
        return cls(params=params, block_tokens=block_tokens, specs=specs)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return sum(s.block_bytes(self.block_tokens) for s in self.specs)

    def resident_block_bytes(self, swa_blocks: bool) -> int:
        """Bytes of one block in memory: compressed entries, plus SWA K=V and end-of-block
        overlap state when blocks carry them (the `full` policy)."""
        extra = sum(s.swa_block_bytes(self.block_tokens) for s in self.specs) if swa_blocks else 0
        return self.block_bytes + extra

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state slot across all layers."""
        return sum(s.state_bytes() for s in self.specs)

    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_tokens

    def bytes_per_token_by_type(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, s in zip(self.params.layer_types, self.specs):
            out[t] = out.get(t, 0.0) + s.block_bytes(self.block_tokens) / self.block_tokens
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
        return sum(s.head_dim * s.dtype_bytes for s in self.specs)
