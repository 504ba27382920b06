"""What every EvicPress tier store is (device, host, disk, storage): blobs under keys
inside a byte budget, with counters. The manager places, reads and drops contexts
through this interface only."""

from __future__ import annotations

import abc
from typing import Any, Optional


class TierStore(abc.ABC):
    """``put(key, blob) -> bool`` (False: it does not fit, or the write failed and
    nothing was left behind: ``write_errors`` says which), ``get(key)`` (None: a miss),
    ``delete(key) -> bool``; ``used_bytes`` and ``free_bytes`` of ``capacity_bytes``;
    ``stats``, its counters."""

    capacity_bytes: int
    _used: int
    stats: Any

    @abc.abstractmethod
    def put(self, key, blob) -> bool: ...

    @abc.abstractmethod
    def get(self, key) -> Optional[Any]: ...

    @abc.abstractmethod
    def delete(self, key) -> bool: ...

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    @property
    def write_errors(self) -> int:
        """Writes that failed (the medium refused them), as opposed to ones that did not fit."""
        return self.stats.write_errors
