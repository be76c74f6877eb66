"""The state-slot pool (kvstore/device/state_slots.py, DESIGN §1): each slot handed out once, a
double free caught."""
from __future__ import annotations

import pytest

from kvmesh.kvstore.device.state_slots import OutOfSlots, SlotPool


def test_slot_pool_allocates_each_slot_once():
    pool = SlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfSlots):
        pool.allocate()
    pool.release(slots[1])
    assert pool.num_free == 1 and pool.allocate() == slots[1]
    pool.release(slots[0])
    with pytest.raises(AssertionError, match="double free"):
        pool.release(slots[0])


def test_slot_pool_rejects_an_empty_size():
    with pytest.raises(ValueError):
        SlotPool(0)
