"""One device buffer handed out in blocks: the prefill's copies of the full KV to the host
pass through it (:mod:`.host_copy`).

Allocated per copy, that memory would be only a count: the caching allocator holds what
it likes beside it (a block freed after a ``record_stream`` is not reused until the
reader's event passes, fragments of different sizes pile up). Here it is one buffer,
allocated once (when the first request is compressed). A piece takes one block (first
fit, 256-byte aligned) and comes back once the GPU has passed the events recorded when it
was released. The arena checks them without waiting (``Event.query``) at the next
allocation, and waits on them (oldest first) only when a block would not fit otherwise.
A block dropped elsewhere (:meth:`StagingArena.orphan`) comes back at the next
allocation, with events recorded then, on the scheduler thread.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

from sglang_vc.kvruntime.pool_lease import ALIGN, aligned  # noqa: F401  (one alignment for views of device memory)


@dataclasses.dataclass(eq=False)
class Block:
    """``size`` bytes of the arena from ``start`` (a multiple of :data:`ALIGN`)."""

    start: int
    size: int


class StagingArena:
    """``nbytes`` of ``device`` memory, allocated once, handed out in blocks. Used from the
    scheduler thread; ``fences()`` gives the events a block dropped elsewhere waits for
    (:meth:`orphan`). An arena the device cannot hold has no room: every piece is then
    copied from a tensor of its own (a warning says so)."""

    def __init__(self, nbytes: int, device, fences: Callable[[], tuple] = tuple, pin: bool = False,
                 what: str = "buffer for the prefill's host copies"):
        capacity = max(0, int(nbytes)) // ALIGN * ALIGN
        try:
            self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pin)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            logger.warning("VERICACHE: no %.2f GB %s (%s); each piece uses a tensor of its own",
                           capacity / 1e9, what, exc)
            capacity, self.buffer = 0, torch.empty(0, dtype=torch.uint8, device=device)
        self.capacity = capacity
        self.fences = fences
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (start, size), sorted
        # blocks closed, oldest first, and the events the GPU must pass before they are reused
        self._pending: list[tuple[Block, tuple]] = []
        # blocks dropped unreleased, on any thread (a deque's append is thread-safe)
        self._orphans: collections.deque = collections.deque()
        self.in_use = 0  # bytes of blocks allocated and not yet reclaimed
        self.peak = 0

    def alloc(self, nbytes: int) -> Optional[Block]:
        """A block of at least ``nbytes``, or None where the arena has no contiguous room
        even once the released blocks' events have passed (waited for oldest first, only
        while a block of this size could still be freed)."""
        size = aligned(max(1, nbytes))
        if size > self.capacity:
            return None
        self._adopt_orphans()
        self._reclaim()
        block = self._first_fit(size)
        # (waiting helps only if the free bytes and the closed blocks' could hold it)
        could_free = self.capacity - self.in_use + sum(b.size for b, _ in self._pending)
        while block is None and self._pending and could_free >= size:
            # blocks released but maybe still read on the GPU: wait for the oldest (rare)
            old, events = self._pending.pop(0)
            for e in events:
                e.synchronize()
            self._give_back(old)
            block = self._first_fit(size)
        if block is not None:
            self.in_use += block.size
            self.peak = max(self.peak, self.in_use)
        return block

    def release(self, block: Block, events: Iterable[object] = ()) -> None:
        """``block`` is free once every one of ``events`` (None: nothing to wait for) passed."""
        self._pending.append((block, tuple(e for e in events if e is not None)))
        self._reclaim()

    def orphan(self, block: Block) -> None:
        """``block`` was dropped unreleased, on whatever thread: released at
        the next allocation, after events recorded then on the scheduler thread."""
        self._orphans.append(block)

    def _adopt_orphans(self) -> None:
        while self._orphans:
            self.release(self._orphans.popleft(), self.fences())

    def view(self, block: Block, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at ``offset`` bytes into ``block``."""
        nbytes = _numel(shape) * dtype.itemsize
        if offset % ALIGN or offset + nbytes > block.size:
            raise ValueError(f"a view of {nbytes} bytes at {offset} does not fit a block of {block.size}")
        start = block.start + offset
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def _first_fit(self, size: int) -> Optional[Block]:
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return Block(start, size)
        return None

    def _reclaim(self) -> None:
        """Give back the closed blocks whose events have passed (no wait)."""
        keep = []
        for block, events in self._pending:
            if all(e.query() for e in events):
                self._give_back(block)
            else:
                keep.append((block, events))
        self._pending = keep

    def _give_back(self, block: Block) -> None:
        self.in_use -= block.size
        i = bisect.bisect(self._free, (block.start, 0))
        start, size = block.start, block.size
        if i < len(self._free) and self._free[i][0] == start + size:  # the free run after it
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # the free run before it
            start, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (start, size))

    def held(self) -> int:
        """Bytes held now, once the blocks whose events passed are back (no wait)."""
        self._adopt_orphans()
        self._reclaim()
        return self.in_use

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity, "in_use_bytes": self.in_use, "peak_bytes": self.peak,
                "free_runs": len(self._free)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
