"""EvicPress's host tier: SGLang's HiCache host pool.

:class:`HostTierStore` is the tier the manager sees. A full copy of a context whose rows
are on the device is SGLang's own HiCache backup of the context's tree nodes (the
controller writes it; SGLang loads it back for a request); anything else is a blob in
pool slots (:class:`HostSlotStore`, below).

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

import dataclasses
import math
import threading
from typing import Any, Callable, Optional, Protocol

import torch

from . import codec
from .tier_store import TierStore
from .codec import FullKV
from .config import FULL

__all__ = ["HostSlotStore", "HostTierStore", "RamHostStore"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Stats:
    def __init__(self) -> None:
        self.puts = 0
        self.put_rejected = 0
        self.gets = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.deletes = 0
        self.backups = 0  # full copies kept as HiCache node backups (HostTierStore)
        self.write_errors = 0  # host memory refuses nothing: a put that fails did not fit


class RamHostStore(TierStore):
    """Blobs in a dict, at most ``capacity_bytes`` (counted as blob bytes)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._blobs: dict[str, bytes] = {}
        self._used = 0
        self.stats = _Stats()
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        return int(nbytes)

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

    def clear(self, pool_was_cleared: bool = False) -> None:
        with self._lock:
            self._blobs.clear()
            self._used = 0


class HostSlotStore(TierStore):
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
        # called with a slot count when the pool allocator is out of slots (HostTierStore:
        # evict the HiCache backups EvicPress released); returns the slots freed
        self.on_pool_full: Optional[Callable[[int], int]] = None
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        """Slot bytes a blob of ``nbytes`` occupies."""
        return self._num_slots(nbytes) * self.slot_bytes

    def _num_slots(self, nbytes: int) -> int:
        n = max(1, math.ceil(nbytes / self.slot_bytes))
        return math.ceil(n / self.page_size) * self.page_size

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
            if idx is None and self.on_pool_full is not None and self.on_pool_full(n) > 0:
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


class HostTree(Protocol):
    """What the host tier needs from the radix cache (:class:`~.radix.EvicPressRadixCache`)
    to keep full copies as SGLang's own HiCache backups of tree nodes."""

    def back_up_full(self, ctx: Any) -> Optional[Any]:
        """Back the context's device node path up into the host pool through the HiCache
        controller and host-lock it; a handle, or None (not on the device, no room)."""

    def read_backed(self, handle: Any) -> Optional[FullKV]:
        """The full KV of a backed-up context (device rows, then host rows of the
        evicted part); None when SGLang no longer holds all of it."""

    def release_backed(self, handle: Any) -> None:
        """Drop the host lock: the backup becomes evictable by SGLang's host LRU."""

    def free_host(self, num_slots: int) -> int:
        """Evict unlocked backups from the host pool (SGLang's ``evict_host``)."""


@dataclasses.dataclass
class BackedCopy:
    """A full context kept as HiCache node backups: the tree handle and its slots."""

    handle: Any
    slots: int


class HostTierStore(TierStore):
    """EvicPress's host tier over SGLang's HiCache host pool.

    * A **full** copy of a context whose rows are on the device is SGLang's own backup of
      the context's tree nodes, written by the HiCache controller (``write``) and
      host-locked; a request that finds the device copy evicted gets SGLang's host hit
      and layer-wise load-back (``init_load_back``, ``LayerDoneCounter``), not ours.
    * Compressed copies (which SGLang's per-token backup cannot represent) and full
      copies arriving from another tier are blobs in pool slots (:class:`HostSlotStore`).

    Both come out of the same pool allocator and one byte budget, beside the backups
    HiCache's write-through makes of plain prefixes. A backup EvicPress releases (the
    context was demoted or dropped) stays in SGLang's tree until SGLang's host LRU
    evicts it; the radix cache asks for that at the next scheduler step
    (``_trim_host_pool``), so a context does not keep answering from the host beyond
    its placement. A blob that finds no free slots evicts SGLang's least recently used
    backups first (``free_host``).
    """

    def __init__(self, slots: HostSlotStore, tree: HostTree,
                 context_of: Callable[[str], Optional[Any]]) -> None:
        self.slots = slots
        self.tree = tree
        self._context_of = context_of
        self.backed: dict[str, BackedCopy] = {}
        self.capacity_bytes = slots.capacity_bytes
        self.slot_bytes = slots.slot_bytes
        self.stats = slots.stats
        slots.on_pool_full = tree.free_host

    def footprint(self, nbytes: int) -> int:
        return self.slots.footprint(nbytes)

    @property
    def used_bytes(self) -> int:
        return self.slots.used_bytes + sum(c.slots for c in self.backed.values()) * self.slot_bytes

    @property
    def pool_used_bytes(self) -> int:
        """Bytes of the HiCache host pool in use: EvicPress's copies, HiCache's backups of
        plain prefixes, and backups EvicPress released that SGLang has not evicted yet."""
        pool = self.slots.pool
        return (int(pool.size) - int(pool.available_size())) * self.slot_bytes

    def __contains__(self, key: str) -> bool:
        return key in self.backed or key in self.slots

    def __len__(self) -> int:
        return len(self.backed) + len(self.slots)

    def is_backed(self, key: str) -> bool:
        """Whether ``key`` is kept as SGLang node backups (served by SGLang's load-back)."""
        return key in self.backed

    def put(self, key: str, blob: bytes) -> bool:
        self.delete(key)
        if codec.blob_config(blob).is_full:
            ctx = self._context_of(key)
            slots = math.ceil(codec.blob_tokens(blob) / self.slots.page_size) * self.slots.page_size
            if ctx is not None and self.used_bytes + slots * self.slot_bytes <= self.capacity_bytes:
                handle = self.tree.back_up_full(ctx)
                if handle is not None:
                    self.backed[key] = BackedCopy(handle, slots)
                    self.stats.puts += 1
                    self.stats.backups += 1
                    self.stats.bytes_written += len(blob)
                    return True
        if self.used_bytes + self.slots.footprint(len(blob)) > self.capacity_bytes:
            self.stats.put_rejected += 1
            return False
        return self.slots.put(key, blob)

    def get(self, key: str) -> Optional[bytes]:
        copy = self.backed.get(key)
        if copy is None:
            return self.slots.get(key)
        self.stats.gets += 1
        kv = self.tree.read_backed(copy.handle)
        if kv is None:  # SGLang lost part of it: the manager recomputes the context
            return None
        blob = codec.encode(kv, FULL)
        self.stats.bytes_read += len(blob)
        return blob

    def delete(self, key: str) -> bool:
        copy = self.backed.pop(key, None)
        if copy is None:
            return self.slots.delete(key)
        self.tree.release_backed(copy.handle)
        self.stats.deletes += 1
        return True

    def clear(self, pool_was_cleared: bool = False) -> None:
        """Forget every copy (SGLang's cache reset also drops the tree's backups and locks)."""
        backed, self.backed = self.backed, {}
        if not pool_was_cleared:
            for copy in backed.values():
                self.tree.release_backed(copy.handle)
        self.slots.clear(pool_was_cleared)
