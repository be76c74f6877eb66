"""FP8 classical-cache entries, byte-laid-out as the V4 reference implementations store them.

Compressed CSA/HCA entry (FlashMLA / vLLM `fp8_ds_mla` for V4, 584 B at head_dim 512, rope 64):

    | nope: D-R e4m3 | rope: R bf16 (2R B) | scales: ceil((D-R)/64) ue8m0, padded to 8 B |

Indexer key (vLLM / SGLang V4 indexer cache, 132 B at index_head_dim 128):

    | key: Di e4m3 | scales: ceil(Di/128) fp32 |

As in FlashMLA's paged cache, a block (= a page of EPB entries) stores all entries' data
first, then all entries' scales:

    block bytes = | EPB x data | EPB x scale |

The nope/key values are quantized per group with a power-of-two (ue8m0) or fp32 scale
= amax / 448, so one entry's bytes never depend on what else is in the batch.

In the cache layout an `Fp8EntryFormat` is the dtype of the `comp` / `idx` tensor specs
(`kvstore/device/layout.py`: `TensorSpec.record`), so their sizes and storage follow from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
MAIN_GROUP, INDEX_GROUP = 64, 128
SCALE_ALIGN = 8


@dataclass(frozen=True)
class Fp8EntryFormat:
    dim: int            # D: values per entry
    rope_dim: int       # R: trailing dims kept in bf16 (0 for indexer keys)
    group: int          # values per scale
    ue8m0: bool         # power-of-two 1-byte scales (else fp32)

    @classmethod
    def main(cls, head_dim: int, rope_dim: int) -> "Fp8EntryFormat":
        return cls(head_dim, rope_dim, MAIN_GROUP, True)

    @classmethod
    def indexer(cls, index_head_dim: int) -> "Fp8EntryFormat":
        return cls(index_head_dim, 0, INDEX_GROUP, False)

    @property
    def quant_dim(self) -> int:
        return self.dim - self.rope_dim

    @property
    def groups(self) -> int:
        return math.ceil(self.quant_dim / self.group)

    @property
    def data_bytes(self) -> int:
        return self.quant_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        if self.ue8m0:
            return math.ceil(self.groups / SCALE_ALIGN) * SCALE_ALIGN
        return 4 * self.groups

    @property
    def entry_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def block_bytes(self, entries: int) -> int:
        return entries * self.entry_bytes

    # ---- encode / decode ------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, D] -> (data uint8 [N, data_bytes], scales uint8 [N, scale_bytes])."""
        n, q, g = x.shape[0], self.quant_dim, self.group
        xf = x.float()
        padded = torch.zeros(n, self.groups * g, device=x.device)
        padded[:, :q] = xf[:, :q]
        groups = padded.view(n, self.groups, g)
        scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=2.0 ** -126)
        if self.ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        values = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(n, -1)[:, :q]
        data = torch.cat([values.to(torch.float8_e4m3fn).view(torch.uint8),
                          xf[:, q:].to(torch.bfloat16).view(torch.uint8).view(n, -1)], 1)
        if self.ue8m0:
            raw = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
        else:
            raw = scale.view(torch.uint8).view(n, -1)
        scales = torch.zeros(n, self.scale_bytes, dtype=torch.uint8, device=x.device)
        scales[:, :raw.shape[1]] = raw
        return data, scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(data [.., data_bytes], scales [.., scale_bytes]) uint8 -> [.., D] in `dtype`."""
        lead, q = data.shape[:-1], self.quant_dim
        if self.ue8m0:
            scale = scales[..., :self.groups].contiguous().view(torch.float8_e8m0fnu).float()
        else:
            scale = scales[..., :4 * self.groups].contiguous().view(torch.float32)
        values = data[..., :q].contiguous().view(torch.float8_e4m3fn).float()
        values = values * scale.repeat_interleave(self.group, -1)[..., :q]
        rope = data[..., q:].contiguous().view(torch.bfloat16).float().view(*lead, self.rope_dim)
        return torch.cat([values, rope], -1).to(dtype)

    # ---- paged blocks: | EPB x data | EPB x scale | ----------------------------------------
    def split(self, blocks: torch.Tensor, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[.., block_bytes] -> views (data [.., EPB, data_bytes], scales [.., EPB, scale_bytes])."""
        cut = entries * self.data_bytes
        lead = blocks.shape[:-1]
        return (blocks[..., :cut].view(*lead, entries, self.data_bytes),
                blocks[..., cut:].view(*lead, entries, self.scale_bytes))

    def write(self, store: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [N, D] into entry `slots[i]` of block `blocks[i]` of a paged store [NB, block_bytes]."""
        epb = store.shape[1] // self.entry_bytes
        data, scales = self.encode(x)
        d_view, s_view = self.split(store, epb)
        d_view[blocks, slots] = data
        s_view[blocks, slots] = scales

    def read(self, store: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks [U] of a paged store -> dense [U, EPB, D]."""
        epb = store.shape[1] // self.entry_bytes
        return self.decode(*self.split(store[blocks], epb), dtype)
