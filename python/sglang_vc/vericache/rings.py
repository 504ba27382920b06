"""Reserve rings over the lookahead window of future iterations (VeriCache paper, §5.1).

The runtime looks ``W`` iterations ahead. Window ``i in [0, W)`` is relative to the
iteration now running (``i = 0``). Two rings track what is already promised there:

* the **BW ring** ``T[i]``: interconnect time (seconds) reserved for reloads landing in
  window ``i``; the link is serialised, so ``T[i] <= T_iter``;
* the **HBM ring** ``B[i]``: bytes of in-flight full KV occupying device memory in
  window ``i`` (streaming in for an upcoming verify, not yet consumed), constrained by
  ``M + KV_resident + B[i] <= HBM``.

Both are the same structure, a circular buffer of per-window amounts with a per-window
capacity; ``advance()`` slides the window one iteration in O(1) (§5.2 step iii).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

# Amounts are floats (seconds, bytes); a reservation that exactly fills a window must not
# be refused because of rounding in ``ell_r * T_iter`` and friends.
_REL_TOL = 1e-9


class Ring:
    """Per-window reservations over the next ``window`` iterations.

    Contract: ``ring[i]`` is the amount reserved in window ``i`` (0 = now);
    ``fits(start, amounts)`` says whether adding ``amounts[k]`` to window ``start + k``
    keeps every touched window within ``capacity``; ``add``/``remove`` change the
    reservations without checking; ``advance()`` retires window 0 and opens an empty
    window at ``W - 1``.
    """

    def __init__(self, window: int, capacity: float = math.inf) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window = int(window)
        self._capacity = float(capacity)
        self._slots = [0.0] * self.window
        self._head = 0  # physical slot of window 0

    # -- capacity -------------------------------------------------------------------
    @property
    def capacity(self) -> float:
        return self._capacity

    @capacity.setter
    def capacity(self, value: float) -> None:
        self._capacity = float(value)

    # -- access ---------------------------------------------------------------------
    def _phys(self, i: int) -> int:
        if not 0 <= i < self.window:
            raise IndexError(f"window {i} outside [0, {self.window})")
        return (self._head + i) % self.window

    def __len__(self) -> int:
        return self.window

    def __getitem__(self, i: int) -> float:
        return self._slots[self._phys(i)]

    def to_list(self) -> list[float]:
        """Reservations of windows ``0..W-1`` in order."""
        return [self[i] for i in range(self.window)]

    def peak(self) -> float:
        return max(self._slots)

    def free(self, i: int, capacity: float | None = None) -> float:
        cap = self.capacity if capacity is None else float(capacity)
        return cap - self[i]

    # -- reservations ---------------------------------------------------------------
    def fits(self, start: int, amounts: Sequence[float], capacity: float | None = None) -> bool:
        """True if ``amounts`` placed from window ``start`` on keep each window within
        capacity (``capacity`` overrides the ring's own for this check)."""
        cap = self.capacity if capacity is None else float(capacity)
        if start < 0 or start + len(amounts) > self.window:
            return False
        slack = _REL_TOL * cap if math.isfinite(cap) else 0.0
        return all(
            self[start + k] + a <= cap + slack for k, a in enumerate(amounts) if a > 0
        )

    def add(self, start: int, amounts: Iterable[float]) -> None:
        for k, a in enumerate(amounts):
            self._slots[self._phys(start + k)] += a

    def remove(self, start: int, amounts: Iterable[float]) -> None:
        """Undo ``add`` on the windows still inside the ring (negative ``start + k`` are
        windows already retired and are skipped)."""
        for k, a in enumerate(amounts):
            i = start + k
            if 0 <= i < self.window:
                p = self._phys(i)
                # clamp: float drift must not leave tiny negative reservations behind
                self._slots[p] = max(0.0, self._slots[p] - a)

    def advance(self) -> float:
        """Slide one iteration forward; returns what window 0 held."""
        retired = self._slots[self._head]
        self._slots[self._head] = 0.0
        self._head = (self._head + 1) % self.window
        return retired


class BwRing(Ring):
    """BW ring of §5.1: ``T[i]`` = interconnect seconds reserved in window ``i``;
    capacity per window is the iteration time ``T_iter``."""

    def __init__(self, window: int, iter_time: float) -> None:
        if iter_time <= 0:
            raise ValueError("iter_time must be > 0")
        super().__init__(window, iter_time)

    @property
    def iter_time(self) -> float:
        return self.capacity

    @iter_time.setter
    def iter_time(self, value: float) -> None:
        if value <= 0:
            raise ValueError("iter_time must be > 0")
        self.capacity = value


class HbmRing(Ring):
    """HBM ring of §5.1: ``B[i]`` = bytes of transient (in-flight) KV in window ``i``.

    The constraint ``M + KV_resident + B[i] <= HBM`` is kept as a capacity of
    ``HBM - M - KV_resident`` per window; ``hbm_bytes=None`` leaves it unconstrained.
    ``resident_bytes`` changes as requests come and go (compressed KV of drafting
    requests, full KV of pinned / non-speculating ones)."""

    def __init__(
        self,
        window: int,
        hbm_bytes: float | None = None,
        weights_bytes: float = 0.0,
        resident_bytes: float = 0.0,
    ) -> None:
        self.hbm_bytes = math.inf if hbm_bytes is None else float(hbm_bytes)
        self.weights_bytes = float(weights_bytes)
        self.resident_bytes = float(resident_bytes)
        super().__init__(window)

    @property
    def capacity(self) -> float:  # HBM - M - KV_resident
        return max(0.0, self.hbm_bytes - self.weights_bytes - self.resident_bytes)

    @capacity.setter
    def capacity(self, value: float) -> None:
        raise AttributeError("set hbm_bytes, weights_bytes or resident_bytes instead")

    def device_peak(self) -> float:
        """Peak device memory over the window: ``M + KV_resident + max_i B[i]``."""
        return self.weights_bytes + self.resident_bytes + self.peak()
