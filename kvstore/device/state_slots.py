"""A fixed pool of state slots (SWA rings, compressor tails, overlap state)."""
from __future__ import annotations


class OutOfSlots(RuntimeError):
    """All state slots are in use; the caller should wait."""


class SlotPool:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots("no free state slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"double free of slot {slot}"
        self._free.append(slot)
