"""The tier interface: one API for every place cache objects live outside the device pool.

A tier holds *objects* (a block's tensors, or a checkpoint's state), keyed by kind
(``"block"`` | ``"checkpoint"``) and prefix hash. The host cache (`kvmesh.kvstore.store.host_cache`)
and the shared store (`kvmesh.kvstore.store.object_store`) implement it; the prefix cache asks them in
order, fastest first (LMCache's ``contains`` / ``batched_get`` / ``put``).

Objects come back as mappings name -> tensor. The store's blocks are `RowTensors`:
views of one object read into a row of a shared uint8 tensor, so a batch of them can
be copied into the cache in one strided copy per tensor (`packed_runs`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import NamedTuple, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]
Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]   # name -> (shape, dtype)


class CacheTier(ABC):
    """Where cache objects live. Implementations are thread-safe."""

    @abstractmethod
    def contains(self, kind: str, h: int) -> bool:
        """Whether the tier holds the object (not verified: `get_many` verifies)."""

    @abstractmethod
    def get_many(self, kind: str, hashes: Sequence[int], expect: Shapes | None = None
                 ) -> list[Tensors | None]:
        """The objects, in order; None for one that is absent or unusable: corrupt, or (with
        `expect`) not holding exactly those tensor names, shapes and dtypes. An unusable
        object is dropped from the tier. Mutates only the tier's own bookkeeping (LRU order,
        counters). May raise `IoTimeoutError` (a read that hung); nothing else it finds raises."""

    @abstractmethod
    def put(self, kind: str, h: int, parent: int | None, token_count: int, tensors: Tensors) -> int:
        """Keep one object (replacing one of the same key); returns the bytes kept, 0 when
        it does not fit the tier at all."""


def shapes_of(tensors: Tensors) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(tensors, RowTensors):
        return tensors.shapes()
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def nbytes(tensors: Tensors) -> int:
    if isinstance(tensors, RowTensors):
        return tensors.nbytes
    return sum(t.numel() * t.element_size() for t in tensors.values())


class RowTensors(Mapping):
    """One object whose tensor data is ``rows[row, data_start:]``, laid out by ``table``
    (``(name, dtype, shape, offset, nbytes)`` rows, offsets from data_start). Tensors are
    views of those bytes (copied only when an offset is misaligned for the dtype)."""

    def __init__(self, rows: torch.Tensor, row: int, data_start: int, table: tuple, nbytes: int):
        self.rows, self.row, self.data_start, self.table, self.nbytes = rows, row, data_start, table, nbytes
        self._at = {entry[0]: entry for entry in table}

    def __getitem__(self, name: str) -> torch.Tensor:
        _, dtype, shape, offset, size = self._at[name]
        start = self.data_start + offset
        field = self.rows[self.row, start:start + size]
        if field.storage_offset() % dtype.itemsize:
            field = field.clone()
        return field.view(dtype).view(shape)

    def __iter__(self):
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(shape), dtype) for name, dtype, shape, _, _ in self.table}


class PackedRows(NamedTuple):
    """Same-layout objects in consecutive rows: `CacheTensors.load_packed`'s arguments."""
    rows: torch.Tensor
    data_start: int
    table: tuple


def packed_runs(objects: Sequence[Tensors]) -> list[tuple[int, int, PackedRows | None]]:
    """`objects` cut into runs `(start, stop, rows)`: each run consecutive rows of one tensor with
    one layout (one get_many of the store, or one part of a prefetch) packed as `rows`, copied in
    one strided copy per cache tensor; `rows` None: a run of other objects, copied one mapping at
    a time."""
    runs: list[tuple[int, int, PackedRows | None]] = []
    start = 0
    while start < len(objects):
        first = objects[start]
        stop = start + 1
        if isinstance(first, RowTensors):
            while stop < len(objects):
                o = objects[stop]
                if not (isinstance(o, RowTensors) and o.rows is first.rows and o.row == first.row + stop - start
                        and o.data_start == first.data_start and o.table == first.table):
                    break
                stop += 1
            runs.append((start, stop, PackedRows(first.rows[first.row:first.row + stop - start], first.data_start,
                                                 first.table)))
        else:
            while stop < len(objects) and not isinstance(objects[stop], RowTensors):
                stop += 1
            runs.append((start, stop, None))
        start = stop
    return runs
