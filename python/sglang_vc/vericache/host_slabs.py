"""The host store's rows in a few large pinned slabs, not one pinned tensor per layer.

A pinned tensor per layer and K/V (64 per request on 8B shapes) goes through torch's
caching host allocator: the first time each size class is seen it is a ``cudaHostAlloc``
(milliseconds, and it synchronizes the device), sizes round up to a power of two (up to
twice the bytes pinned), and what it caches is never given back. Here the rows are views
of slabs of :data:`SLAB_BYTES`, each pinned once, the first when a request is first
offloaded (never at start-up: a server whose requests stay on the device pins nothing)
and the next ones only when the others are full, up to the store's bound. A request's
rows take blocks of a slab (first fit, :class:`~.staging_arena.StagingArena`) and give
them back when its entry dies, once the copies queued by then have passed (the fences of
the copy stream and the compute stream, recorded on the scheduler thread at the next
allocation: a reload's copy thread may hold the entry last).

Where no slab has room and none may be added, a row is a pinned tensor of its own, as
before, and counted (``host_rows_outside_slabs``): the store's own byte bound, not the
slabs, decides what is offloaded.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import torch

from sglang_vc import stats

from .staging_arena import Block, StagingArena, _numel, aligned

logger = logging.getLogger(__name__)

# One slab: 1 GiB is ~8k tokens of 8B shapes' full KV (128 KiB per token), and few enough
# ``cudaHostAlloc`` calls that their cost is paid a handful of times per server
SLAB_BYTES = 1 << 30


class HostSlabs:
    """Host rows handed out as views of pinned slabs (plain host memory when ``pin`` is
    false: the CPU runs the same code). ``limit_bytes`` bounds the slabs' total (None:
    unbounded); ``fences()`` gives the events a freed block waits for."""

    def __init__(self, pin: bool, limit_bytes: Optional[int] = None, slab_bytes: int = SLAB_BYTES,
                 fences: Callable[[], tuple] = tuple):
        self.pin = pin
        self.limit = limit_bytes
        self.slab_bytes = slab_bytes if limit_bytes is None else max(1, min(slab_bytes, limit_bytes))
        self.fences = fences
        self.slabs: list[StagingArena] = []
        self.outside = 0  # rows that found no slab room: pinned tensors of their own

    def empty(self, shape, dtype: torch.dtype, owner: object) -> torch.Tensor:
        """A host tensor of ``shape``: a view of a slab, whose block goes back when
        ``owner`` is garbage collected (the rows' views must not outlive it)."""
        nbytes = _numel(shape) * dtype.itemsize
        found = self._alloc(nbytes)
        if found is None:
            self.outside += 1
            stats.add("vericache", host_rows_outside_slabs=1)
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
        slab, block = found
        weakref.finalize(owner, slab.orphan, block)
        return slab.view(block, 0, shape, dtype)

    def _alloc(self, nbytes: int) -> Optional[tuple[StagingArena, Block]]:
        for slab in self.slabs:
            block = slab.alloc(nbytes)
            if block is not None:
                return slab, block
        size = max(self.slab_bytes, aligned(nbytes))
        if self.limit is not None and self.pinned_bytes() + size > self.limit:
            return None
        slab = StagingArena(size, "cpu", self.fences, pin=self.pin, what="pinned host slab for offloaded KV")
        if not slab.capacity:
            return None
        self.slabs.append(slab)
        logger.info("VERICACHE: pinned host slab %d of %.2f GB for offloaded KV", len(self.slabs), size / 1e9)
        block = slab.alloc(nbytes)
        return (slab, block) if block is not None else None

    def pinned_bytes(self) -> int:
        return sum(s.capacity for s in self.slabs)

    def stats(self) -> dict:
        return {"host_slabs": len(self.slabs), "host_slab_bytes": self.pinned_bytes(),
                "host_slab_in_use_bytes": sum(s.held() for s in self.slabs),
                "host_rows_outside_slabs": self.outside}

