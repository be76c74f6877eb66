"""The cache tensors: paged classical blocks and per-request state slots, per layer.

Shapes (NB blocks, S slots, EPB = block_tokens / ratio entries per block):
    ring[S, window, D]                          every layer (SWA K=V by position % window)
    comp[NB, EPB, D]                            CSA and HCA layers (compressed entries)
    idx[NB, EPB, Di]                            CSA layers (indexer keys)
    tail_kv/tail_gate[S, m, W]                  CSA/HCA (W = 2D for CSA, D for HCA)
    itail_kv/itail_gate[S, m, 2Di]              CSA indexer
    ovl_kv/ovl_gate[S, m, D], iovl_*[S, m, Di]  CSA overlap state (gate -inf = no previous window)

With `kv_dtype="fp8"` comp and idx are uint8 pages of FP8 records [NB, EPB x record bytes]
(`kvstore/fp8_kv.py`); the model writes and reads them through `write_entries` / `paged`.

With `swa_blocks` (the `full` SWA policy) blocks also carry what rebuilding the state at
any block boundary needs:
    swa[NB, block_tokens, D]                    every layer (K=V of the block's tokens)
    bovl_kv/bovl_gate[NB, m, D], biovl_*[NB, m, Di]  CSA overlap state at the block's end
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .fp8_kv import Fp8EntryFormat
from .layout import CSA, HCA, CacheLayout


@dataclass
class LayerCache:
    ring: torch.Tensor
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)   # paged, indexed by block id
    tails: dict[str, torch.Tensor] = field(default_factory=dict)    # per slot
    formats: dict[str, Fp8EntryFormat] = field(default_factory=dict)  # FP8 record fields ("comp", "idx")

    def write_entries(self, name: str, blocks: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store entries x [N, D] at (blocks[i], slots[i]) of paged field `name`."""
        store = self.blocks[name]
        if x.shape[0] == 0:
            return
        if name in self.formats:
            self.formats[name].write(store, blocks, slots, x)
        else:
            store[blocks, slots] = x.to(store.dtype)

    def entries_per_block(self, name: str) -> int:
        store = self.blocks[name]
        return store.shape[1] // self.formats[name].entry_bytes if name in self.formats else store.shape[1]

    def paged(self, name: str, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(paged [NB', EPB, D] in `dtype`, block table into it) for the attention kernels. A float
        cache of that dtype is returned as is; FP8 records (or another float dtype) are decoded
        for the blocks `block_table` references only."""
        store = self.blocks[name]
        if name not in self.formats and store.dtype == dtype:
            return store, block_table
        used = torch.unique(block_table[block_table >= 0]).long()
        if name in self.formats:
            dense = self.formats[name].read(store, used, dtype)
        else:
            dense = store[used].to(dtype)
        local = torch.searchsorted(used, block_table.long().clamp(min=0)).to(block_table.dtype)
        return dense, torch.where(block_table >= 0, local, block_table)

    @property
    def comp(self) -> torch.Tensor | None:
        return self.blocks.get("comp")

    @property
    def idx(self) -> torch.Tensor | None:
        return self.blocks.get("idx")

    @property
    def swa(self) -> torch.Tensor | None:
        return self.blocks.get("swa")


OVERLAP_FIELDS = ("ovl_kv", "ovl_gate", "iovl_kv", "iovl_gate")
SLOT_FIELDS = ("tail_kv", "tail_gate", "itail_kv", "itail_gate", "ovl_kv", "ovl_gate", "iovl_kv", "iovl_gate")


class CacheTensors:
    def __init__(self, layout: CacheLayout, num_blocks: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", swa_blocks: bool = False):
        self.layout, self.num_blocks, self.num_slots = layout, num_blocks, num_slots
        self.swa_blocks = swa_blocks
        p, bt = layout.params, layout.block_tokens
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        ninf = lambda *s: torch.full(s, float("-inf"), dtype=dtype, device=device)  # noqa: E731
        fmts = p.entry_formats()
        entry_dtype = torch.bfloat16 if p.kv_dtype == "bfloat16" else dtype

        def entries(name: str, n: int, dim: int) -> torch.Tensor:
            if name in fmts:
                return torch.zeros(num_blocks, fmts[name].block_bytes(n), dtype=torch.uint8, device=device)
            return torch.zeros(num_blocks, n, dim, dtype=entry_dtype, device=device)

        self.layers: list[LayerCache] = []
        for t, spec in zip(p.layer_types, layout.specs):
            lc = LayerCache(ring=z(num_slots, p.window, p.head_dim))
            m, d, di = spec.ratio, p.head_dim, p.index_head_dim
            if swa_blocks:
                lc.blocks["swa"] = z(num_blocks, bt, d)
            if t in (CSA, HCA):
                lc.blocks["comp"] = entries("comp", bt // m, d)
                lc.formats = {k: f for k, f in fmts.items() if k == "comp" or t == CSA}
                w = 2 * d if t == CSA else d
                lc.tails.update(tail_kv=z(num_slots, m, w), tail_gate=z(num_slots, m, w))
            if t == CSA:
                lc.blocks["idx"] = entries("idx", bt // m, di)
                if swa_blocks:
                    lc.blocks.update(bovl_kv=z(num_blocks, m, d), bovl_gate=z(num_blocks, m, d),
                                     biovl_kv=z(num_blocks, m, di), biovl_gate=z(num_blocks, m, di))
                lc.tails.update(itail_kv=z(num_slots, m, 2 * di), itail_gate=z(num_slots, m, 2 * di),
                                ovl_kv=z(num_slots, m, d), ovl_gate=ninf(num_slots, m, d),
                                iovl_kv=z(num_slots, m, di), iovl_gate=ninf(num_slots, m, di))
            self.layers.append(lc)

    def reset_slot(self, slot: int) -> None:
        """Forget any previous window: the next first window pools only its own half."""
        for lc in self.layers:
            for name in ("ovl_gate", "iovl_gate"):
                if name in lc.tails:
                    lc.tails[name][slot].fill_(float("-inf"))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-fork of a partly written block (every block tensor, every layer)."""
        for lc in self.layers:
            for t in lc.blocks.values():
                t[dst].copy_(t[src])

    def copy_slot(self, src: int, dst: int) -> None:
        """A forked sequence starts from its parent's state: rings, tails, overlap state."""
        for lc in self.layers:
            lc.ring[dst].copy_(lc.ring[src])
            for t in lc.tails.values():
                t[dst].copy_(t[src])

    def write_ring_rows(self, slots: torch.Tensor, rows: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Put back window-ring rows (speculative rollback): values[layer] [N, D] at (slots, rows)."""
        for lc, v in zip(self.layers, values):
            lc.ring[slots, rows] = v

    def block_state(self, block: int) -> dict[str, torch.Tensor]:
        """Copies of one block's tensors across layers, named '{layer}.{field}'."""
        return {f"{i}.{name}": t[block].to("cpu", copy=True)
                for i, lc in enumerate(self.layers) for name, t in lc.blocks.items()}

    def load_block(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        """Fill one block from a stored object; KeyError/RuntimeError if it does not fit."""
        self.load_blocks([block], [tensors])

    def block_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one block object must hold: name -> (shape, dtype)."""
        return {f"{i}.{name}": (tuple(t.shape[1:]), t.dtype)
                for i, lc in enumerate(self.layers) for name, t in lc.blocks.items()}

    def load_blocks(self, blocks: list[int], objects: list[dict[str, torch.Tensor]]) -> None:
        """Fill many blocks at once (one copy per cache tensor); objects must fit block_shapes()."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long)
        for i, lc in enumerate(self.layers):
            for name, t in lc.blocks.items():
                key = f"{i}.{name}"
                t[idx] = torch.stack([o[key] for o in objects]).to(t.device, t.dtype)

    def load_packed(self, blocks: list[int], rows: torch.Tensor, data_start: int, table: tuple) -> None:
        """Fill many blocks from store objects of one layout, straight from their bytes:
        `rows[i, data_start:]` holds block i's tensor data, laid out by `table`
        ((name, dtype, shape, offset, nbytes) rows that fit block_shapes()). One strided
        copy per cache tensor."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long)
        targets = {f"{i}.{name}": t for i, lc in enumerate(self.layers) for name, t in lc.blocks.items()}
        for name, dtype, shape, offset, nbytes in table:
            t = targets[name]
            start = data_start + offset
            field = rows[:, start:start + nbytes]
            if rows.shape[1] % dtype.itemsize or start % dtype.itemsize:
                field = field.contiguous()
            t[idx] = field.view(dtype).view(len(blocks), *shape).to(t.device, t.dtype)

    def rebuild_slot(self, slot: int, position: int, block_table: list[int]) -> None:
        """`full` policy: the state at block boundary `position` from the blocks' SWA K=V
        (ring) and the last block's end-of-block overlap state. Tails are empty there."""
        bt = self.layout.block_tokens
        for lc in self.layers:
            w = lc.ring.shape[1]
            pos = torch.arange(max(0, position - w), position)
            blocks = torch.tensor(block_table, dtype=torch.long)[pos // bt]
            lc.ring[slot, pos % w] = lc.swa[blocks, pos % bt]
            for name in OVERLAP_FIELDS:
                if name in lc.tails:
                    src = lc.blocks["b" + name][block_table[position // bt - 1]] if position else None
                    if src is None:
                        lc.tails[name][slot].fill_(float("-inf") if name.endswith("gate") else 0.0)
                    else:
                        lc.tails[name][slot].copy_(src)

    def slot_state(self, slot: int, position: int) -> dict[str, torch.Tensor]:
        """Copies of the state a snapshot at a block boundary needs: rings (ordered oldest
        first, ending at `position`) and the overlap state. Tails are empty there."""
        out = {}
        for i, lc in enumerate(self.layers):
            w = lc.ring.shape[1]
            order = torch.arange(position - w, position) % w
            out[f"{i}.ring"] = lc.ring[slot, order].to("cpu", copy=True)
            for name in OVERLAP_FIELDS:
                if name in lc.tails:
                    out[f"{i}.{name}"] = lc.tails[name][slot].to("cpu", copy=True)
        return out

    def slot_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one checkpoint object must hold (what slot_state returns): name -> (shape, dtype)."""
        out = {}
        for i, lc in enumerate(self.layers):
            out[f"{i}.ring"] = (tuple(lc.ring.shape[1:]), lc.ring.dtype)
            for name in OVERLAP_FIELDS:
                if name in lc.tails:
                    out[f"{i}.{name}"] = (tuple(lc.tails[name].shape[1:]), lc.tails[name].dtype)
        return out

    def load_slot(self, slot: int, position: int, tensors: dict[str, torch.Tensor]) -> None:
        for i, lc in enumerate(self.layers):
            w = lc.ring.shape[1]
            order = torch.arange(position - w, position) % w
            lc.ring[slot, order] = tensors[f"{i}.ring"].to(lc.ring.device, lc.ring.dtype)
            for name in OVERLAP_FIELDS:
                if name in lc.tails:
                    lc.tails[name][slot].copy_(tensors[f"{i}.{name}"])


    # ---- what moves when a request changes worker (NIXL or the Ray fallback) ----------------
    def named_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """[(name, kind, tensor)] for every cache tensor; kind is 'block' or 'slot'."""
        out = []
        for i, lc in enumerate(self.layers):
            out.append((f"{i}.ring", "slot", lc.ring))
            out += [(f"{i}.{name}", "block", t) for name, t in lc.blocks.items()]
            out += [(f"{i}.{name}", "slot", t) for name, t in lc.tails.items()]
        return out

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for _, _, t in self.named_tensors()]

    def block_regions(self, block_ids: list[int], slot: int) -> list[tuple[int, int, int]]:
        """(tensor index in all_tensors(), byte offset, nbytes) of the given blocks and slot."""
        out = []
        for i, (_, kind, t) in enumerate(self.named_tensors()):
            row = t.stride(0) * t.element_size()
            out += [(i, r * row, row) for r in (block_ids if kind == "block" else [slot])]
        return out

    def gather(self, block_ids: list[int], slot: int) -> dict[str, torch.Tensor]:
        """CPU copies of the blocks and the whole state slot (the Ray-object handoff payload)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return {name: (t[idx] if kind == "block" else t[slot]).to("cpu", copy=True)
                for name, kind, t in self.named_tensors()}

    def scatter(self, block_ids: list[int], slot: int, tensors: dict[str, torch.Tensor]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long)
        for name, kind, t in self.named_tensors():
            src = tensors[name].to(t.device, t.dtype)
            if kind == "block":
                t[idx] = src
            else:
                t[slot] = src


def size_pools(layout: CacheLayout, budget_bytes: int, max_slots: int, swa_blocks: bool = False
               ) -> tuple[int, int]:
    """Split a memory budget into (num_blocks, num_slots): up to `max_slots` slots, each
    leaving room for at least one block, and the rest as blocks."""
    slot_b, block_b = layout.slot_bytes, max(1, layout.resident_block_bytes(swa_blocks))
    slots = max(1, min(max_slots, budget_bytes // (slot_b + block_b)))
    blocks = max(1, (budget_bytes - slots * slot_b) // block_b)
    return int(blocks), int(slots)
