"""Pool slots leased for VERICACHE's staged reloads and the prefill's host copies.

A reload copies a verifying request's full KV from pinned host memory to the device on
the copy stream, layer by layer, and the verify forward writes each layer into pool slots
(:mod:`.staging`); the prefill's copies to the host go through the device the other way
(:mod:`.host_copy`). Both need device memory for the layers in flight. Nothing is set
aside for it at start-up: each reload (each prefill request's copies) leases a contiguous
run of the pool's own slots (:mod:`sglang_vc.kvruntime.pool_lease`) for its life, and the
layer ``l`` it stages goes into the lease's rows of layer ``l``'s K and V buffers (a slot
holds a token of every layer, so ``n`` staged tokens of every layer take ``n`` slots). A
server that never offloads has SGLang's pool, every slot of it.

A lease comes back to SGLang's allocator once the GPU has passed two events recorded when
its reload closed: the copy stream's last copy and the compute stream's last read. They
are checked without waiting (``Event.query``) at the next lease, and waited on (oldest
first) only when a lease would not fit the cap otherwise. A reload dropped without closing
hands its lease back at the next lease, with events recorded then, on the scheduler thread.

``cap_rows`` (``--vc-staging-fraction`` of the pool) bounds the slots staging holds at
once: a cap on what it may take from the pool, not a reservation. A reload that finds no
run of free slots under it stages into tensors of its own (``staged_outside_pool``):
correct, outside SGLang's budget, counted.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Iterable, Optional

from sglang_vc.kvruntime.pool_lease import PoolLease

logger = logging.getLogger(__name__)


class StagingLeases:
    """Leases of pool slots handed out and taken back for staging, used from the
    scheduler thread. ``take(rows)`` leases from the pool (None: no run), ``give_back``
    returns a lease to it; ``fences()`` gives the events a lease dropped elsewhere waits for."""

    def __init__(self, take: Callable[[int], Optional[PoolLease]], give_back: Callable[[PoolLease], None],
                 cap_rows: int, fences: Callable[[], tuple] = tuple):
        self._take = take
        self._give_back = give_back
        self.cap_rows = max(0, int(cap_rows))
        self.fences = fences
        # leases closed, oldest first, and the events the GPU must pass before they go back
        self._pending: list[tuple[PoolLease, tuple]] = []
        # leases of reloads dropped unclosed, on any thread (a deque's append is thread-safe)
        self._orphans: collections.deque = collections.deque()
        self.in_use = 0  # rows leased and not yet given back
        self.peak = 0
        self.leases = 0
        self.no_room = 0  # leases refused: over the cap, or no run of free slots

    def take(self, rows: int) -> Optional[PoolLease]:
        """A lease of ``rows`` slots, or None where the cap or the pool has no room even
        once the closed leases' events have passed (waited for oldest first, only while
        that could make room)."""
        rows = max(1, int(rows))
        if rows > self.cap_rows:
            self.no_room += 1
            return None
        self._adopt_orphans()
        self._reclaim()
        while self._pending and self.in_use + rows > self.cap_rows:
            self._wait_oldest()
        lease = self._take(rows) if self.in_use + rows <= self.cap_rows else None
        while lease is None and self._pending:  # their slots back may make a run
            self._wait_oldest()
            lease = self._take(rows)
        if lease is None:
            self.no_room += 1
            return None
        self.in_use += lease.size
        self.peak = max(self.peak, self.in_use)
        self.leases += 1
        return lease

    def release(self, lease: PoolLease, events: Iterable[object] = ()) -> None:
        """``lease`` goes back once every one of ``events`` (None: nothing to wait for) passed."""
        self._pending.append((lease, tuple(e for e in events if e is not None)))
        self._reclaim()

    def orphan(self, lease: PoolLease) -> None:
        """``lease``'s reload was dropped without closing, on whatever thread: released at
        the next lease, after events recorded then on the scheduler thread."""
        self._orphans.append(lease)

    def held(self) -> int:
        """Rows leased now, once the leases whose events passed are back (no wait)."""
        self._adopt_orphans()
        self._reclaim()
        return self.in_use

    def stats(self) -> dict:
        return {"cap_rows": self.cap_rows, "in_use_rows": self.in_use, "peak_rows": self.peak,
                "leases": self.leases, "no_room": self.no_room}

    def _adopt_orphans(self) -> None:
        while self._orphans:
            self.release(self._orphans.popleft(), self.fences())

    def _reclaim(self) -> None:
        """Give back the closed leases whose events have passed (no wait)."""
        keep = []
        for lease, events in self._pending:
            if all(e.query() for e in events):
                self._back(lease)
            else:
                keep.append((lease, events))
        self._pending = keep

    def _wait_oldest(self) -> None:
        lease, events = self._pending.pop(0)
        for e in events:  # closed but maybe still copied into or read on the GPU (rare)
            e.synchronize()
        self._back(lease)

    def _back(self, lease: PoolLease) -> None:
        self.in_use -= lease.size
        self._give_back(lease)
