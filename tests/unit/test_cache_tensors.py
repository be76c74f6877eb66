"""The cache tensors (kvstore/device/cache_tensors.py) are what the layout spec names: for every layer
type, compute dtype, KV dtype and SWA policy, the allocated tensors, their typed views and their
bytes are the specs' (and the layout's sizes); `size_pools` splits a memory budget into state
slots and blocks. The `full` policy's copies happen in the cache layer (`append_kv`,
`save_overlap`), for every token of a step."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors, size_pools
from kvmesh.kvstore.device.fp8_kv import Fp8EntryFormat
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutError, LayoutParams
from tests.unit.test_layout import V4_PRO
from kvmesh.workers.model.step import StepInput

TYPES = (SWA, CSA, HCA, CSA)
BT = 16


def build(dtype: str, kv: str, swa_blocks: bool, window: int = 8) -> tuple[CacheLayout, CacheTensors]:
    layout = CacheLayout.build(LayoutParams(TYPES, head_dim=32, index_head_dim=16, csa_ratio=4, hca_ratio=16,
                                            window=window, dtype=dtype, kv_dtype=kv, rope_dim=8), BT)
    return layout, CacheTensors(layout, num_blocks=3, num_slots=2, swa_blocks=swa_blocks)


def row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


CASES = [(d, kv, swa) for d in ("float32", "bfloat16") for kv in ("auto", "bfloat16", "fp8") for swa in (False, True)]


@pytest.mark.parametrize("dtype,kv,swa_blocks", CASES)
def test_allocated_tensors_are_what_the_specs_name(dtype, kv, swa_blocks):
    layout, cache = build(dtype, kv, swa_blocks)
    for t, spec, lc in zip(TYPES, layout.specs, cache.layers):
        blocks = {s.name: (s.stored_shape, s.torch_dtype) for s in spec.block_tensors(swa_blocks)}
        assert blocks == {n: (tuple(x.shape[1:]), x.dtype) for n, x in lc.blocks.items()}
        assert all(x.shape[0] == 3 for x in lc.blocks.values())
        slots = {s.name: (s.stored_shape, s.torch_dtype) for s in spec.state_tensors()}
        allocated = {"ring": lc.ring, **lc.tails}
        assert slots == {n: (tuple(x.shape[1:]), x.dtype) for n, x in allocated.items()}
        assert all(x.shape[0] == 2 for x in allocated.values())
        expect = {SWA: set(), HCA: {"comp"}, CSA: {"comp", "idx"}}[t] | ({"swa"} if swa_blocks else set())
        if t == CSA and swa_blocks:
            expect |= {"bovl_kv", "bovl_gate", "biovl_kv", "biovl_gate"}
        assert set(blocks) == expect
        compute = getattr(torch, dtype)
        assert lc.ring.dtype == compute and all(x.dtype == compute for x in lc.tails.values())
        for name in {"comp", "idx"} & set(lc.blocks):
            want = torch.uint8 if kv == "fp8" else torch.bfloat16 if kv == "bfloat16" else compute
            assert lc.blocks[name].dtype == want


@pytest.mark.parametrize("dtype,kv,swa_blocks", CASES)
def test_byte_sizes_are_the_allocated_bytes_per_block_and_per_slot(dtype, kv, swa_blocks):
    layout, cache = build(dtype, kv, swa_blocks)
    for spec, lc in zip(layout.specs, cache.layers):
        per_block = sum(row_bytes(x) for x in lc.blocks.values())
        assert per_block == spec.block_bytes() + (spec.swa_block_bytes() if swa_blocks else 0)
        assert spec.state_bytes() == row_bytes(lc.ring) + sum(row_bytes(x) for x in lc.tails.values())
    assert sum(row_bytes(x) for lc in cache.layers for x in lc.blocks.values()) == layout.resident_block_bytes(swa_blocks)
    assert sum(row_bytes(x) for _, kind, x in cache.named_tensors() if kind == "slot") == layout.slot_bytes
    nbytes = lambda d: sum(x.numel() * x.element_size() for x in d.values())  # noqa: E731
    assert nbytes(cache.block_state(1)) == layout.resident_block_bytes(swa_blocks)
    assert nbytes(cache.slot_state(0, BT)) == layout.checkpoint_bytes
    assert {n: (tuple(x.shape), x.dtype) for n, x in cache.block_state(1).items()} == cache.block_shapes()
    assert {n: (tuple(x.shape), x.dtype) for n, x in cache.slot_state(0, BT).items()} == cache.slot_shapes()


@pytest.mark.parametrize("dtype,kv,swa_blocks", CASES)
def test_typed_views_are_the_allocated_tensors(dtype, kv, swa_blocks):
    layout, cache = build(dtype, kv, swa_blocks)
    for t, lc in zip(TYPES, cache.layers):
        assert (lc.swa is not None) == swa_blocks and (lc.swa is None or lc.swa is lc.blocks["swa"])
        assert (lc.compressor is None) == (t == SWA) and (lc.indexer is None) == (t != CSA)
        for c, prefix, entries in ((lc.compressor, "", "comp"), (lc.indexer, "i", "idx")):
            if c is None:
                continue
            assert c.entries is lc.blocks[entries]
            assert c.tail_kv is lc.tails[f"{prefix}tail_kv"] and c.tail_gate is lc.tails[f"{prefix}tail_gate"]
            assert c.entries_per_block == BT // c.ratio
            if t == HCA:
                assert c.ovl_kv is None and c.block_ovl_kv is None
                continue
            assert c.ovl_kv is lc.tails[f"{prefix}ovl_kv"] and c.ovl_gate is lc.tails[f"{prefix}ovl_gate"]
            assert bool(torch.isneginf(c.ovl_gate).all())                  # no previous window yet
            assert (c.block_ovl_kv is not None) == swa_blocks
            if kv == "fp8":                                                 # the record format is the dtype
                fmt = c.spec.entries.dtype
                assert isinstance(fmt, Fp8EntryFormat) and fmt.ue8m0 == (entries == "comp")
                assert c.entries.shape[1] == c.entries_per_block * fmt.entry_bytes


def test_cache_in_another_dtype_than_the_layout_is_refused():
    layout, _ = build("float32", "auto", False)
    with pytest.raises(LayoutError, match="build the layout with the model's dtype"):
        CacheTensors(layout, num_blocks=1, num_slots=1, dtype=torch.bfloat16)


def one_sequence_step(start: int, n: int, blocks: list[int], slot: int = 1, keep: int = 0) -> StepInput:
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return StepInput(tokens=torch.zeros(n, dtype=torch.long), positions=torch.arange(start, start + n),
                     q_seq=torch.zeros(n, dtype=torch.long), starts=t([start]), lengths=t([n]), slots=t([slot]),
                     block_table=torch.tensor([blocks], dtype=torch.int32), ring_from=t([0]), keep_tokens=t([keep]),
                     logits_at=t([n - 1]))


@pytest.mark.parametrize("swa_blocks", [False, True])
def test_append_kv_fills_the_ring_and_pages_every_token_only_with_swa_blocks(swa_blocks):
    _, cache = build("float32", "auto", swa_blocks, window=8)
    lc = cache.layers[0]
    kv = torch.randn(2 * BT, 32)                                  # one chunk: 4x the window, two blocks
    lc.append_kv(one_sequence_step(0, 2 * BT, [2, 0]), kv)
    pos = torch.arange(2 * BT - 8, 2 * BT)
    assert torch.equal(lc.ring[1, pos % 8], kv[pos])             # the newest window, by position
    assert lc.ring[0].count_nonzero() == 0
    if swa_blocks:
        assert torch.equal(lc.swa[2], kv[:BT]) and torch.equal(lc.swa[0], kv[BT:])
        assert lc.swa[1].count_nonzero() == 0
    else:
        assert lc.swa is None and not lc.blocks


def test_append_kv_leaves_restored_tokens_in_their_blocks():
    _, cache = build("float32", "auto", True)
    lc = cache.layers[0]
    lc.swa.fill_(7.0)
    kv = torch.randn(BT, 32)
    lc.append_kv(one_sequence_step(BT - 4, BT, [0, 1], keep=BT), kv)   # tokens < BT were restored
    assert bool((lc.swa[0] == 7.0).all())
    assert torch.equal(lc.swa[1, :BT - 4], kv[4:])


@pytest.mark.parametrize("swa_blocks", [False, True])
def test_save_overlap_keeps_the_last_window_and_snapshots_block_ends_with_swa_blocks(swa_blocks):
    _, cache = build("float32", "auto", swa_blocks)
    c = cache.layers[1].compressor                                # CSA, ratio 4: 4 windows per block
    step = one_sequence_step(0, 2 * BT, [2, 0])
    windows = step.windows(4)                                     # 8 windows close, 2 of them end a block
    kv, gate = torch.randn(8, 4, 32), torch.randn(8, 4, 32)
    c.save_overlap(step, windows, kv, gate)
    assert torch.equal(c.ovl_kv[1], kv[7]) and torch.equal(c.ovl_gate[1], gate[7])
    assert bool(torch.isneginf(c.ovl_gate[0]).all())
    if swa_blocks:
        assert torch.equal(c.block_ovl_kv[2], kv[3]) and torch.equal(c.block_ovl_gate[0], gate[7])
        assert c.block_ovl_kv[1].count_nonzero() == 0
        cache.rebuild_slot(0, BT, [2, 0])                         # a restore at the first block's end
        assert torch.equal(c.ovl_kv[0], kv[3]) and torch.equal(c.ovl_gate[0], gate[3])
        cache.rebuild_slot(0, 0, [2, 0])
        assert bool(torch.isneginf(c.ovl_gate[0]).all()) and c.ovl_kv[0].count_nonzero() == 0


# ---- the memory split and the allocated bytes ------------------------------------------------------
def test_size_pools_splits_the_budget_into_slots_and_blocks():
    layout = CacheLayout.build(V4_PRO, 128)
    budget = 1 << 30
    blocks, slots = size_pools(layout, budget, max_slots=16)
    assert slots == 16
    assert slots * layout.slot_bytes + blocks * layout.block_bytes <= budget
    assert budget - (slots * layout.slot_bytes + blocks * layout.block_bytes) < layout.block_bytes


def test_size_pools_leaves_each_slot_room_for_a_block_when_memory_is_short():
    layout = CacheLayout.build(V4_PRO, 128)
    budget = 3 * (layout.slot_bytes + layout.block_bytes) + 10
    blocks, slots = size_pools(layout, budget, max_slots=64)
    assert slots == 3 and blocks >= slots
    assert slots * layout.slot_bytes + blocks * layout.block_bytes <= budget


@pytest.mark.parametrize("swa_blocks", [False, True])
def test_layout_sizes_equal_what_the_cache_tensors_allocate(swa_blocks):
    layout = CacheLayout.build(LayoutParams((SWA, CSA, HCA, CSA), 64, 32, 4, 128, 64, "float32"), 128)
    cache = CacheTensors(layout, num_blocks=3, num_slots=2, dtype=torch.float32, swa_blocks=swa_blocks)
    per_block = sum(t[0].numel() * t.element_size() for lc in cache.layers for t in lc.blocks.values())
    per_slot = sum(t[0].numel() * t.element_size() for lc in cache.layers for t in [lc.ring, *lc.tails.values()])
    assert per_block == layout.resident_block_bytes(swa_blocks)
    assert per_slot == layout.slot_bytes


@pytest.mark.parametrize("blocks", [[2, 3, 4, 5], [6, 1, 4, 0], [0, 1, 5, 6], list(range(12))[::-1] + [12, 13]])
def test_load_packed_writes_what_load_blocks_writes_for_consecutive_and_scattered_blocks(blocks):
    """Runs of consecutive ids are copied as slices, scattered ones by index: the same bytes."""
    layout = CacheLayout.build(LayoutParams(TYPES, head_dim=32, index_head_dim=16, csa_ratio=4, hca_ratio=16,
                                            window=8, dtype="bfloat16", kv_dtype="auto", rope_dim=8), BT)
    packed, plain = (CacheTensors(layout, num_blocks=16, num_slots=1, swa_blocks=True) for _ in range(2))
    shapes = packed.block_shapes()
    g = torch.Generator().manual_seed(len(blocks))
    objects = [{name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in shapes.items()}
               for _ in blocks]
    table, offset = [], 0
    for name, (shape, dtype) in shapes.items():
        nbytes = objects[0][name].numel() * dtype.itemsize
        table.append((name, dtype, shape, offset, nbytes))
        offset += nbytes
    rows = torch.stack([torch.cat([o[name].reshape(-1).view(torch.uint8) for name in shapes]) for o in objects])
    packed.load_packed(blocks, rows, 0, tuple(table))
    plain.load_blocks(blocks, objects)
    for a, b in zip(packed.layers, plain.layers):
        for name in a.blocks:
            assert torch.equal(a.blocks[name], b.blocks[name]), name
