"""EvicPress's host tier: context blobs kept in the slots of SGLang's HiCache host pool.

With ``--enable-hierarchical-cache`` SGLang allocates a host KV pool
(``mem_cache/pool_host/mha.py`` ``MHATokenToKVPoolHost``: one slot holds one token's K
and V for every layer, ``get_size_per_token()`` bytes, sized by ``--hicache-size`` or
``--hicache-ratio``). Under ``--radix-cache-backend evicpress`` the radix tree does not
back nodes up into that pool itself; the pool is EvicPress's host tier, and a context's
blob (full or compressed, :mod:`.codec`) occupies ``ceil(len(blob) / slot_bytes)`` slots
taken from the pool's own allocator (``alloc``/``free``). A compressed context therefore
takes proportionally fewer host slots -- the same memory, the same accounting as plain
HiCache.

Bytes are written into the slots' rows of the pool buffer through an integer view of
the buffer dtype, so they round-trip bit-exactly (no float canonicalisation). Supported
pool layouts: ``layer_first`` ``[2, L, size, H, D]`` and ``page_first``
``[2, size, L, H, D]``.

:class:`RamHostStore` is the same interface over plain memory, for tests and for runs
without a host pool.
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch

__all__ = ["HostSlotStore", "RamHostStore"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Stats:
    def __init__(self) -> None:
        self.puts = 0
        self.put_rejected = 0
        self.gets = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.deletes = 0


class RamHostStore:
    """Blobs in a dict, at most ``capacity_bytes`` (counted as blob bytes)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._blobs: dict[str, bytes] = {}
        self._used = 0
        self.stats = _Stats()
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        return int(nbytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self._used)

    def __contains__(self, key: str) -> bool:
        return key in self._blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def put(self, key: str, blob: bytes) -> bool:
        with self._lock:
            old = len(self._blobs.get(key, b""))
            if self._used - old + len(blob) > self.capacity_bytes:
                self.stats.put_rejected += 1
                return False
            self._blobs[key] = bytes(blob)
            self._used += len(blob) - old
            self.stats.puts += 1
            self.stats.bytes_written += len(blob)
            return True

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            self.stats.gets += 1
            blob = self._blobs.get(key)
            if blob is not None:
                self.stats.bytes_read += len(blob)
            return blob

    def delete(self, key: str) -> bool:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is None:
                return False
            self._used -= len(blob)
            self.stats.deletes += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._used = 0


class HostSlotStore:
    """Blobs in slots of a HiCache host pool; at most ``capacity_bytes`` of slots
    (default: the whole pool).

    ``pool`` needs ``kv_buffer``, ``layout``, ``page_size``, ``get_size_per_token()``,
    ``alloc(n)`` (slot indices or None) and ``free(indices)`` -- SGLang's host pool API.
    """

    def __init__(self, pool, capacity_bytes: Optional[int] = None) -> None:
        layout = getattr(pool, "layout", None)
        if layout not in ("layer_first", "page_first"):
            raise ValueError(
                f"EvicPress stores blobs in HiCache host pools with layout layer_first or "
                f"page_first, got {layout!r} (use --hicache-mem-layout layer_first)"
            )
        self.pool = pool
        self._token_dim = 2 if layout == "layer_first" else 1
        buf = pool.kv_buffer
        if not buf.is_contiguous():
            raise ValueError("host pool buffer must be contiguous")
        self._ibuf = buf.view(_INT_VIEW[buf.element_size()])
        self.slot_bytes = int(pool.get_size_per_token())
        shape = list(buf.shape)
        self._row_shape = shape[: self._token_dim] + shape[self._token_dim + 1 :]
        assert math.prod(self._row_shape) * buf.element_size() == self.slot_bytes, (
            self._row_shape, self.slot_bytes)
        self.page_size = int(getattr(pool, "page_size", 1))
        pool_bytes = int(pool.size) * self.slot_bytes if hasattr(pool, "size") else None
        if capacity_bytes is None:
            capacity_bytes = pool_bytes
        elif pool_bytes is not None:
            capacity_bytes = min(int(capacity_bytes), pool_bytes)
        self.capacity_bytes = int(capacity_bytes)
        self._slots: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (indices, nbytes)
        self._used = 0  # bytes of slots held
        self.stats = _Stats()
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        """Slot bytes a blob of ``nbytes`` occupies."""
        return self._num_slots(nbytes) * self.slot_bytes

    def _num_slots(self, nbytes: int) -> int:
        n = max(1, math.ceil(nbytes / self.slot_bytes))
        return math.ceil(n / self.page_size) * self.page_size

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self._used)

    def __contains__(self, key: str) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def _region(self, idx: torch.Tensor):
        return (slice(None),) * self._token_dim + (idx,)

    def put(self, key: str, blob: bytes) -> bool:
        """Store ``blob`` under ``key`` (replacing it); False when it does not fit."""
        n = self._num_slots(len(blob))
        with self._lock:
            old = self._slots.get(key)
            old_bytes = 0 if old is None else len(old[0]) * self.slot_bytes
            if self._used - old_bytes + n * self.slot_bytes > self.capacity_bytes:
                self.stats.put_rejected += 1
                return False
            idx = self.pool.alloc(n)
            if idx is None:
                self.stats.put_rejected += 1
                return False
            padded = bytearray(n * self.slot_bytes)
            padded[: len(blob)] = blob
            rows = torch.frombuffer(padded, dtype=self._ibuf.dtype)
            rows = rows.view(*self._row_shape[: self._token_dim], n, *self._row_shape[self._token_dim :])
            self._ibuf[self._region(idx.to(self._ibuf.device))] = rows.to(self._ibuf.device)
            if old is not None:
                self.pool.free(old[0])
                self._used -= old_bytes
            self._slots[key] = (idx, len(blob))
            self._used += n * self.slot_bytes
            self.stats.puts += 1
            self.stats.bytes_written += len(blob)
            return True

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            self.stats.gets += 1
            entry = self._slots.get(key)
            if entry is None:
                return None
            idx, nbytes = entry
            rows = self._ibuf[self._region(idx.to(self._ibuf.device))].cpu().contiguous()
            blob = rows.view(torch.uint8).numpy().tobytes()[:nbytes]
            self.stats.bytes_read += nbytes
            return blob

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._slots.pop(key, None)
            if entry is None:
                return False
            self.pool.free(entry[0])
            self._used -= len(entry[0]) * self.slot_bytes
            self.stats.deletes += 1
            return True

    def clear(self, pool_was_cleared: bool = False) -> None:
        """Forget every blob; frees the slots unless the pool itself was cleared
        (SGLang's cache reset clears the host pool's allocator)."""
        with self._lock:
            if not pool_was_cleared:
                for idx, _ in self._slots.values():
                    self.pool.free(idx)
            self._slots.clear()
            self._used = 0
