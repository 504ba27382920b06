"""The byte budget every EvicPress tier store keeps (host slots, disk files, storage)."""

from __future__ import annotations


class ByteBudget:
    """``capacity_bytes`` and the ``_used`` bytes a store holds, with the two readings
    the manager asks of every tier."""

    capacity_bytes: int
    _used: int

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)
