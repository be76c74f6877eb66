"""The cache tensors, allocated from the layout's tensor specs (`kvstore/device/layout.py`): per
layer, paged block tensors [NB, *shape] and state-slot tensors [S, *shape] (NB blocks, S
slots), FP8 records as uint8 bytes [NB, EPB x record bytes] (`kvstore/device/fp8_kv.py`).

The model reaches a layer's cache through typed views: `ring` [S, window, D], `swa`
[NB, block_tokens, D] (swa_blocks only), and per compressor (`compressor`, and `indexer`
on CSA layers) its entries, tails and overlap state. Whatever the SWA policy adds is done
here: `append_kv` also pages every token's K=V when blocks carry it, `save_overlap` also
snapshots the overlap state at each block's end. Generic code (copies, objects, transfers)
goes by name: `blocks` and `tails` map each tensor's spec name to the tensor.
"""
from __future__ import annotations

import hashlib

from dataclasses import dataclass
from typing import Protocol

import torch

from kvmesh.kvstore.device.layout import CacheLayout, CompressorSpec, LayerSpec, LayoutError, TensorSpec


class StepRows(Protocol):
    """What the cache reads of a forward step (`kvmesh.workers.model.step.StepInput`)."""
    positions: torch.Tensor     # [T] absolute position of each row
    q_seq: torch.Tensor         # [T] sequence of each row
    starts: torch.Tensor        # [B] first position of each sequence's chunk
    lengths: torch.Tensor       # [B] rows of each sequence
    slots: torch.Tensor         # [B] state slot of each sequence
    block_table: torch.Tensor   # [B, MB] block ids
    keep_tokens: torch.Tensor   # [B] tokens restored from stored blocks (not rewritten)
    decode: bool                # one row per sequence, past its restored tokens: no masks needed
    fresh: bool                 # every row lies past its sequence's restored tokens: block writes need no mask
    max_len: int | None         # host-known bound on lengths (None: unknown)


class ClosedWindows(Protocol):
    """What the cache reads of a step's closed compressor windows (`kvmesh.workers.model.step.WindowPlan`)."""
    seq: torch.Tensor           # [N] sequence of each window
    index: torch.Tensor         # [N] window index (covers positions [index*m, (index+1)*m))
    last: torch.Tensor          # [N] bool: its sequence's last window in the step
    keep: torch.Tensor          # [N] bool: not restored from a stored block
    padded: bool                # one row per sequence, closing or not (`last` = it closes): fixed shapes


def allocate(spec: TensorSpec, n: int, device: torch.device | str) -> torch.Tensor:
    return torch.full((n, *spec.stored_shape), spec.fill, dtype=spec.torch_dtype, device=device)


@dataclass
class CompressorCache:
    """One compressor's cache in one layer (views into the layer's tensors)."""
    spec: CompressorSpec
    entries: torch.Tensor                       # [NB, EPB, D], or FP8 records [NB, EPB x record bytes]
    tail_kv: torch.Tensor                       # [S, m, W]
    tail_gate: torch.Tensor
    ovl_kv: torch.Tensor | None = None          # [S, m, D] (overlapping windows only)
    ovl_gate: torch.Tensor | None = None
    block_ovl_kv: torch.Tensor | None = None    # [NB, m, D] (swa_blocks only)
    block_ovl_gate: torch.Tensor | None = None

    @property
    def entries_per_block(self) -> int:
        return self.spec.entries.shape[0]

    @property
    def ratio(self) -> int:
        return self.tail_kv.shape[1]

    def write_entries(self, blocks: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store entries x [N, D] at (blocks[i], slots[i]), in the entries' dtype."""
        if x.shape[0] == 0:
            return
        if record := self.spec.entries.record:
            record.write(self.entries, blocks, slots, x)
        else:
            self.entries[blocks, slots] = x.to(self.entries.dtype)

    def paged(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(paged [NB', EPB, D] in `dtype`, block table into it) for the attention kernels. A float
        cache of that dtype is returned as is; FP8 records (or another float dtype) are decoded
        for the blocks `block_table` references only."""
        record, store = self.spec.entries.record, self.entries
        if record is None and store.dtype == dtype:
            return store, block_table
        used = torch.unique(block_table[block_table >= 0]).long()
        dense = record.read(store, used, dtype) if record else store[used].to(dtype)
        local = torch.searchsorted(used, block_table.long().clamp(min=0)).to(block_table.dtype)
        return dense, torch.where(block_table >= 0, local, block_table)

    def save_overlap(self, step: StepRows, windows: ClosedWindows, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """The closed windows' Ca halves kv, gate [N, m, D]: each sequence's last one becomes
        its slot's overlap state; with swa_blocks each kept window that ends a block is also
        stored in that block (what a restore at the boundary resumes from)."""
        if windows.padded:
            return self._save_overlap_padded(step, windows, kv, gate)
        last = windows.last
        slots = step.slots[windows.seq[last]]
        self.ovl_kv[slots], self.ovl_gate[slots] = kv[last], gate[last]
        if self.block_ovl_kv is None:
            return
        bt = self.entries_per_block * self.ratio
        ends = (windows.index + 1) * self.ratio
        at_end = (ends % bt == 0) & windows.keep
        blocks = step.block_table[windows.seq[at_end], ends[at_end] // bt - 1].long()
        self.block_ovl_kv[blocks], self.block_ovl_gate[blocks] = kv[at_end], gate[at_end]

    def _save_overlap_padded(self, step: StepRows, windows: ClosedWindows, kv: torch.Tensor, gate: torch.Tensor
                             ) -> None:
        """save_overlap with fixed shapes (no boolean masks): every row writes its own slot and
        its current block, the new value where its window closes (ends a block), else the old."""
        closes = windows.last.view(-1, 1, 1)
        slots = step.slots[windows.seq]
        for state, new in ((self.ovl_kv, kv), (self.ovl_gate, gate)):
            state[slots] = torch.where(closes, new, state[slots])
        if self.block_ovl_kv is None:
            return
        bt = self.entries_per_block * self.ratio
        at_end = ((windows.index + 1) * self.ratio % bt == 0) & windows.keep
        blocks = step.block_table[windows.seq, windows.index * self.ratio // bt].long()
        for store, new in ((self.block_ovl_kv, kv), (self.block_ovl_gate, gate)):
            store[blocks] = torch.where(at_end.view(-1, 1, 1), new, store[blocks])

    def restore_overlap(self, slot: int, block: int | None) -> None:
        """The slot's overlap state from `block`'s end-of-block copy, or none (block None)."""
        for state, copy, spec in ((self.ovl_kv, self.block_ovl_kv, self.spec.ovl_kv),
                                  (self.ovl_gate, self.block_ovl_gate, self.spec.ovl_gate)):
            if block is None:
                state[slot].fill_(spec.fill)
            else:
                state[slot].copy_(copy[block])


class LayerCache:
    """One layer's cache tensors, allocated from its spec. Typed views for the model:
    `ring`, `swa` (None unless swa_blocks), `compressor` and `indexer` (None where the layer
    has none)."""

    def __init__(self, spec: LayerSpec, num_blocks: int, num_slots: int, device: torch.device | str = "cpu",
                 swa_blocks: bool = False):
        self.spec = spec
        self.block_specs, self.slot_specs = spec.block_tensors(swa_blocks), spec.state_tensors()
        self.blocks = {t.name: allocate(t, num_blocks, device) for t in self.block_specs}   # by block id
        state = {t.name: allocate(t, num_slots, device) for t in self.slot_specs}           # by slot
        self.ring = state.pop(spec.ring.name)
        self.tails = state
        self.swa = self.blocks.get(spec.swa.name)
        self.compressor = self._view(spec.compressor(swa_blocks))
        self.indexer = self._view(spec.indexer(swa_blocks))

    def _view(self, c: CompressorSpec | None) -> CompressorCache | None:
        if c is None:
            return None
        named = {**self.blocks, **self.tails}
        return CompressorCache(c, *(t and named[t.name] for t in (c.entries, c.tail_kv, c.tail_gate, c.ovl_kv,
                                                                   c.ovl_gate, c.block_ovl_kv, c.block_ovl_gate)))

    @property
    def compressors(self) -> list[CompressorCache]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    def append_kv(self, step: StepRows, kv: torch.Tensor) -> None:
        """This step's K=V rows kv [T, D]: each sequence's newest `window` rows into its ring
        and, with swa_blocks (the `full` policy), every row not restored into its block (a
        prefill chunk may be longer than the window: the blocks get all of it)."""
        w = self.ring.shape[1]
        if step.decode:          # one row per sequence: every row goes to the ring
            self.ring[step.slots, step.positions % w] = kv
        elif step.max_len is not None and step.max_len <= w:   # every row is among its sequence's newest w
            self.ring[step.slots[step.q_seq], step.positions % w] = kv
        else:
            ends = (step.starts + step.lengths)[step.q_seq]
            last = step.positions >= ends - w
            self.ring[step.slots[step.q_seq[last]], step.positions[last] % w] = kv[last]
        if self.swa is None:
            return
        bt = self.swa.shape[1]
        if step.fresh:           # no row was restored: every row goes to its block
            self.swa[step.block_table[step.q_seq, step.positions // bt].long(), step.positions % bt] = kv
        else:
            new = step.positions >= step.keep_tokens[step.q_seq]
            blocks = step.block_table[step.q_seq[new], step.positions[new] // bt].long()
            self.swa[blocks, step.positions[new] % bt] = kv[new]


SLICE_RUNS_MAX = 8        # load_packed: more runs of consecutive blocks than this and one indexed copy is cheaper


def consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(i, j, first block) for each stretch blocks[i:j] of consecutive ids."""
    runs, i = [], 0
    for j in range(1, len(blocks) + 1):
        if j == len(blocks) or blocks[j] != blocks[j - 1] + 1:
            runs.append((i, j, blocks[i]))
            i = j
    return runs


class CacheTensors:
    """Every layer's cache: `num_blocks` blocks and `num_slots` state slots, as the layout's
    specs say (with swa_blocks, blocks also carry SWA K=V and end-of-block overlap state).
    `dtype`, when given, must be the layout's compute dtype: the specs set every tensor's dtype."""

    def __init__(self, layout: CacheLayout, num_blocks: int, num_slots: int,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu", swa_blocks: bool = False):
        if dtype is not None and dtype != getattr(torch, layout.params.dtype):
            raise LayoutError(f"cache tensors in {dtype} for a layout in {layout.params.dtype}: "
                              f"build the layout with the model's dtype")
        self.layout, self.num_blocks, self.num_slots = layout, num_blocks, num_slots
        self.swa_blocks = swa_blocks
        self.layers = [LayerCache(spec, num_blocks, num_slots, device, swa_blocks) for spec in layout.specs]

    def reset_slot(self, slot: int) -> None:
        """Forget any previous window: the next first window pools only its own half."""
        for lc in self.layers:
            for spec in lc.slot_specs:
                if spec.fill:
                    lc.tails[spec.name][slot].fill_(spec.fill)

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

    def ring_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
        """Copies of window-ring rows [N, D] at (slots, rows), one per layer."""
        return [lc.ring[slots, rows] for lc in self.layers]

    def write_ring_rows(self, slots: torch.Tensor, rows: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Put back window-ring rows (speculative rollback): values[layer] [N, D] at (slots, rows)."""
        for lc, v in zip(self.layers, values):
            lc.ring[slots, rows] = v

    def _overlap_states(self) -> list[torch.Tensor]:
        return [t for lc in self.layers for c in lc.compressors if c.ovl_kv is not None for t in (c.ovl_kv, c.ovl_gate)]

    def overlap_ratios(self) -> list[int]:
        """The ratios of the compressors that carry overlap state from window to window (CSA)."""
        return sorted({c.ratio for lc in self.layers for c in lc.compressors if c.ovl_kv is not None})

    def overlap_rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the slots' overlap state, one tensor per overlapping compressor and field."""
        return [t[slots] for t in self._overlap_states()]

    def write_overlap_rows(self, slots: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Put back the slots' overlap state (speculative rollback), as `overlap_rows` read it."""
        for t, v in zip(self._overlap_states(), values):
            t[slots] = v

    def block_state(self, block: int) -> dict[str, torch.Tensor]:
        """Copies of one block's tensors across layers, named '{layer}.{field}'."""
        return {f"{i}.{name}": t[block].to("cpu", copy=True)
                for i, lc in enumerate(self.layers) for name, t in lc.blocks.items()}

    def block_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one block object must hold: name -> (shape, dtype), from the specs."""
        return {f"{i}.{t.name}": (t.stored_shape, t.torch_dtype)
                for i, lc in enumerate(self.layers) for t in lc.block_specs}

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
        ((name, dtype, shape, offset, nbytes) rows that fit block_shapes()). Per cache tensor, one
        slice copy per run of consecutive block ids (a fresh request's blocks mostly are: 6x faster
        than an indexed write here), or one indexed copy when they are scattered."""
        if not blocks:
            return
        runs = consecutive_runs(blocks)
        idx = torch.tensor(blocks, dtype=torch.long) if len(runs) > SLICE_RUNS_MAX else None
        targets = {f"{i}.{name}": t for i, lc in enumerate(self.layers) for name, t in lc.blocks.items()}
        for name, dtype, shape, offset, nbytes in table:
            t = targets[name]
            start = data_start + offset
            field = rows[:, start:start + nbytes]
            if rows.shape[1] % dtype.itemsize or start % dtype.itemsize:
                field = field.contiguous()
            src = field.view(dtype).view(len(blocks), *shape)
            if idx is not None:
                t.index_copy_(0, idx.to(t.device), src.to(t.device, t.dtype))
                continue
            for i, j, b in runs:
                t[b:b + j - i].copy_(src[i:j])

    def rebuild_slot(self, slot: int, position: int, block_table: list[int]) -> None:
        """`full` policy: the state at block boundary `position` from the blocks' SWA K=V
        (ring) and the last block's end-of-block overlap state. Tails are empty there."""
        bt = self.layout.block_tokens
        for lc in self.layers:
            w = lc.ring.shape[1]
            pos = torch.arange(max(0, position - w), position)
            blocks = torch.tensor(block_table, dtype=torch.long)[pos // bt]
            lc.ring[slot, pos % w] = lc.swa[blocks, pos % bt]
            for c in lc.compressors:
                if c.ovl_kv is not None:
                    c.restore_overlap(slot, block_table[position // bt - 1] if position else None)

    def slot_state(self, slot: int, position: int) -> dict[str, torch.Tensor]:
        """Copies of the state a snapshot at a block boundary needs (the checkpoint tensors):
        rings (ordered oldest first, ending at `position`) and the overlap state. Tails are
        empty there."""
        out = {}
        for i, lc in enumerate(self.layers):
            w = lc.ring.shape[1]
            order = torch.arange(position - w, position) % w
            out[f"{i}.ring"] = lc.ring[slot, order].to("cpu", copy=True)
            for name in self._overlap_names(lc):
                out[f"{i}.{name}"] = lc.tails[name][slot].to("cpu", copy=True)
        return out

    @staticmethod
    def _overlap_names(lc: LayerCache) -> list[str]:
        return [t.name for c in lc.compressors for t in c.spec.overlap]

    def slot_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one checkpoint object must hold (what slot_state returns): name -> (shape, dtype)."""
        return {f"{i}.{t.name}": (t.stored_shape, t.torch_dtype)
                for i, lc in enumerate(self.layers) for t in lc.slot_specs if t.checkpoint}

    def load_slot(self, slot: int, position: int, tensors: dict[str, torch.Tensor]) -> None:
        for i, lc in enumerate(self.layers):
            w = lc.ring.shape[1]
            order = torch.arange(position - w, position) % w
            lc.ring[slot, order] = tensors[f"{i}.ring"].to(lc.ring.device, lc.ring.dtype)
            for name in self._overlap_names(lc):
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

    def digest(self) -> str:
        """SHA-256 of every cache tensor's bytes (the ranks of a tensor-parallel group hold the same)."""
        h = hashlib.sha256()
        for t in self.all_tensors():
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def block_regions(self, block_ids: list[int], slot: int) -> list[tuple[int, int, int]]:
        """(tensor index in all_tensors(), byte offset, nbytes) of the given blocks and slot."""
        out = []
        for i, (_, kind, t) in enumerate(self.named_tensors()):
            row = t.stride(0) * t.element_size()
            out += [(i, r * row, row) for r in (block_ids if kind == "block" else [slot])]
        return out

    def region_picks(self, num_blocks: int, skip: int) -> list[int]:
        """Which of `block_regions(ids, slot)` (`num_blocks` ids) cover blocks [skip:] and the slot,
        in order: a destination that holds the first `skip` blocks reads only those.

            block_regions: | t0: b0 .. b(n-1) | t1: slot | t2: b0 .. b(n-1) | ...
            picks (skip=2):|        b2 .. b(n-1) | slot |         b2 .. b(n-1) | ..."""
        picks, at = [], 0
        for _, kind, _ in self.named_tensors():
            rows = num_blocks if kind == "block" else 1
            picks += range(at + (skip if kind == "block" else 0), at + rows)
            at += rows
        return picks

    def skip_blocks(self, tensors: dict[str, torch.Tensor], skip: int) -> dict[str, torch.Tensor]:
        """A `gather` payload without its first `skip` blocks (the slot's tensors as they are)."""
        return {name: tensors[name][skip:] if kind == "block" else tensors[name]
                for name, kind, _ in self.named_tensors()}

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every block tensor (what a handoff moves per block)."""
        return sum(t.stride(0) * t.element_size() for _, kind, t in self.named_tensors() if kind == "block")

    def gather(self, block_ids: list[int], slot: int) -> dict[str, torch.Tensor]:
        """CPU copies of the blocks and the whole state slot (the Ray-object handoff payload)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return {name: (t[idx] if kind == "block" else t[slot]).to("cpu", copy=True)
                for name, kind, t in self.named_tensors()}

    @property
    def real(self) -> "CacheTensors":
        """The tensors themselves (a `kvmesh.kvstore.device.mirror.MirroredCache` wraps them; this is them)."""
        return self

    def resync(self, block_ids: list[int], slot: int) -> None:
        """Blocks and a slot were written behind the cache's back (a NIXL READ): nothing to do
        for a single copy (a `MirroredCache` sends their bytes to the other ranks)."""

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
