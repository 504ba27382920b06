"""The reload scheduler: BW ring + HBM ring + ADMIT + the per-iteration execution loop
of the VeriCache paper, §5.1-5.2. No SGLang dependency; the speculative worker drives it.

Per iteration ``t`` the worker does (§5.2 "Execution loop"):

    for rid in sched.due_reloads(t):   # (i) kick off async full-KV reloads
        start_reload(rid)
    for rid in sched.due_verifies(t):  # (ii) verify these, draft the rest
        verify(rid)
    finished = sched.advance()         # (iii) slide the window; t -> t + 1
    for rid in finished:               # re-ADMIT after every verify
        sched.admit(rid, kv_bytes(rid), x)
    for rid in waiting: sched.admit(...)   # deferred requests retry

Convention (ours; the paper leaves it open): ``admit`` called at iteration ``now`` means
the request drafts in iterations ``now .. d_r - 1`` and verifies at ``d_r``, so
``draft_len = d_r - now`` and a request anchored at ``x`` runs cycles of ``x`` drafts plus
one verify, the ``x + 1`` cycle of appendix B.1. Its reload is kicked off at
``d_r - S_r + 1`` and occupies windows ``d_r - S_r + 1 .. d_r`` on both rings.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable

from sglang_vc.vericache.admit import AdmitState, Placement, admit, load_span
from sglang_vc.vericache.metrics import VeriCacheMetrics
from sglang_vc.vericache.rings import BwRing, HbmRing, Ring


@dataclass(frozen=True)
class Admission:
    """A scheduled verify (absolute iteration numbers)."""

    request_id: Hashable
    admitted_at: int  # iteration ADMIT ran in; drafting starts here
    verify_iteration: int  # d_r
    reload_iteration: int  # first window of span_r: kick off the reload here
    draft_len: int  # verify_iteration - admitted_at
    span: int  # S_r
    load_iters: float  # ell_r
    kv_bytes: int
    hbm_bytes: int


class ReloadPlanner:
    """Admission control and staggering of verify reloads (VeriCache §5).

    Args:
        window: ``W``, lookahead iterations (should exceed the draft length ``x`` so the
            search can go both ways around the anchor).
        iter_time: ``T_iter`` in seconds, the BW-ring capacity per window; update with
            ``set_iter_time`` from measurements.
        bandwidth: ``BW`` of the link feeding the verifier, bytes/s.
        hbm_bytes, weights_bytes, resident_bytes: ``HBM``, ``M`` and ``KV_resident`` of the
            HBM-ring constraint; ``hbm_bytes=None`` leaves HBM unconstrained.
        stagger: cap verifies per window at ``max_verifies_per_iter`` or, when that is
            None, at ``ceil(n / x)`` for ``n`` speculating requests: §4.2's "about B/x
            requests verify per iteration" even when no resource forces it (ours; the
            paper relies on the rings alone).
        fallback_after: after this many consecutive deferrals a request is put in
            FALLBACK mode (decode from full KV); None = never. A request whose span can
            never fit the window (``S_r > W - 1``) falls back at once.
        metrics: optional shared counters to bump alongside the scheduler's own.
    """

    def __init__(
        self,
        window: int,
        iter_time: float,
        bandwidth: float,
        *,
        hbm_bytes: float | None = None,
        weights_bytes: float = 0.0,
        resident_bytes: float = 0.0,
        stagger: bool = True,
        max_verifies_per_iter: int | None = None,
        fallback_after: int | None = None,
        metrics: VeriCacheMetrics | None = None,
    ) -> None:
        if bandwidth <= 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = float(bandwidth)
        self.bw_ring = BwRing(window, iter_time)
        self.hbm_ring = HbmRing(window, hbm_bytes, weights_bytes, resident_bytes)
        self.verify_ring = Ring(window)  # verifies per window (counts)
        self.stagger = stagger
        self.max_verifies_per_iter = max_verifies_per_iter
        self.fallback_after = fallback_after
        self.metrics = metrics
        self.now = 0
        self._pending: dict[Hashable, tuple[Admission, Placement]] = {}
        self._reload_at: dict[int, list[Hashable]] = defaultdict(list)
        self._verify_at: dict[int, list[Hashable]] = defaultdict(list)
        self._mode: dict[Hashable, AdmitState] = {}
        self._deferred_in_row: dict[Hashable, int] = {}
        self.admissions = 0
        self.deferrals = 0
        self.fallbacks = 0

    # -- configuration --------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.bw_ring.window

    def set_iter_time(self, iter_time: float) -> None:
        """Update ``T_iter`` (e.g. a moving average of measured iteration times)."""
        self.bw_ring.iter_time = iter_time

    def set_resident_bytes(self, resident_bytes: float) -> None:
        """Update ``KV_resident`` of the HBM constraint."""
        self.hbm_ring.resident_bytes = float(resident_bytes)

    # -- ADMIT ----------------------------------------------------------------------
    def admit(
        self,
        request_id: Hashable,
        kv_bytes: int,
        preferred_draft_len: int,
        hbm_bytes: int | None = None,
        max_draft_len: int | None = None,
        stagger: bool = True,
    ) -> Admission | None:
        """Run ADMIT (Algorithm 1) for ``request_id`` at the current iteration.

        ``kv_bytes`` is the reload size, ``preferred_draft_len`` the anchor ``x``,
        ``hbm_bytes`` the transient device memory of the reload (default ``kv_bytes``),
        ``max_draft_len`` the most drafts before the verify (None: the window's);
        ``stagger=False`` exempts this verify from the per-window verify cap (in-pool
        drafters aligned to verify together, :mod:`.staggered_schedule`).
        Returns the Admission, or None when the request is deferred (back to waiting;
        call again in a later iteration) or in FALLBACK mode (see ``mode``).
        """
        if request_id in self._pending:
            raise ValueError(
                f"request {request_id!r} already has a verify at "
                f"{self._pending[request_id][0].verify_iteration}; admit after it retires"
            )
        if preferred_draft_len < 1:
            raise ValueError("preferred_draft_len must be >= 1")
        if self._mode.get(request_id) is AdmitState.FALLBACK:
            return None
        _, span = load_span(kv_bytes, self.bandwidth, self.bw_ring.iter_time)
        if span > self.window - 1:  # can never fit: no point waiting
            self._fall_back(request_id)
            return None

        cap = None
        if self.stagger and stagger:
            cap = self.max_verifies_per_iter or math.ceil(
                (len(self._pending) + 1) / preferred_draft_len
            )
        placement = admit(
            self.bw_ring,
            self.hbm_ring,
            kv_bytes,
            self.bandwidth,
            preferred_draft_len,
            hbm_bytes=hbm_bytes,
            verify_ring=self.verify_ring,
            verify_cap=cap,
            max_draft_len=max_draft_len,
        )
        if placement is None:
            self._defer(request_id)
            return None

        adm = Admission(
            request_id=request_id,
            admitted_at=self.now,
            verify_iteration=self.now + placement.verify_offset,
            reload_iteration=self.now + placement.start_offset,
            draft_len=placement.verify_offset,
            span=placement.span,
            load_iters=placement.load_iters,
            kv_bytes=int(kv_bytes),
            hbm_bytes=int(placement.hbm),
        )
        self._pending[request_id] = (adm, placement)
        self._reload_at[adm.reload_iteration].append(request_id)
        self._verify_at[adm.verify_iteration].append(request_id)
        self._mode[request_id] = AdmitState.SPECULATIVE
        self._deferred_in_row.pop(request_id, None)
        self.admissions += 1
        if self.metrics is not None:
            self.metrics.add(admissions=1)
        return adm

    def _defer(self, request_id: Hashable) -> None:
        self.deferrals += 1
        if self.metrics is not None:
            self.metrics.add(admissions_deferred=1)
        n = self._deferred_in_row.get(request_id, 0) + 1
        self._deferred_in_row[request_id] = n
        self._mode[request_id] = AdmitState.WAITING
        if self.fallback_after is not None and n >= self.fallback_after:
            self._fall_back(request_id)

    def _fall_back(self, request_id: Hashable) -> None:
        if self._mode.get(request_id) is not AdmitState.FALLBACK:
            self.fallbacks += 1
            if self.metrics is not None:
                self.metrics.add(fallbacks=1)
        self._mode[request_id] = AdmitState.FALLBACK

    # -- execution loop -------------------------------------------------------------
    def due_reloads(self, iteration: int | None = None) -> list[Hashable]:
        """Requests whose reload must be kicked off at ``iteration`` (default now)."""
        return list(self._reload_at.get(self.now if iteration is None else iteration, ()))

    def due_verifies(self, iteration: int | None = None) -> list[Hashable]:
        """Requests that verify at ``iteration`` (default now)."""
        return list(self._verify_at.get(self.now if iteration is None else iteration, ()))

    def advance(self) -> list[Hashable]:
        """Slide the window one iteration (§5.2 step iii). Returns the requests that
        verified in the iteration just finished; they are free to be re-admitted."""
        done = self._verify_at.pop(self.now, [])
        self._reload_at.pop(self.now, None)
        for rid in done:
            del self._pending[rid]
        self.bw_ring.advance()
        self.hbm_ring.advance()
        self.verify_ring.advance()
        self.now += 1
        return done

    def release(self, request_id: Hashable) -> bool:
        """Forget ``request_id`` (finished or aborted): its reservation still in the
        window is freed. Returns whether it held one."""
        self._mode.pop(request_id, None)
        self._deferred_in_row.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        adm, placement = entry
        placement.unreserve(
            self.bw_ring, self.hbm_ring, self.verify_ring, shift=self.now - adm.admitted_at
        )
        for table, it in ((self._reload_at, adm.reload_iteration), (self._verify_at, adm.verify_iteration)):
            rids = table.get(it)
            if rids and request_id in rids:
                rids.remove(request_id)
                if not rids:
                    del table[it]
        return True

    # -- introspection --------------------------------------------------------------
    def admission(self, request_id: Hashable) -> Admission | None:
        entry = self._pending.get(request_id)
        return entry[0] if entry else None

    def mode(self, request_id: Hashable) -> AdmitState | None:
        """``mode[r]``: SPECULATIVE (holds a verify), WAITING (deferred), FALLBACK, or
        None for an unknown / released request."""
        return self._mode.get(request_id)

    @property
    def num_speculating(self) -> int:
        return len(self._pending)

    def counters(self) -> dict[str, int]:
        return {
            "admissions": self.admissions,
            "deferrals": self.deferrals,
            "fallbacks": self.fallbacks,
        }

    def snapshot(self) -> dict[str, list[float]]:
        """Ring contents for windows ``0..W-1`` (debugging, tests, plots)."""
        return {
            "bw_seconds": self.bw_ring.to_list(),
            "hbm_bytes": self.hbm_ring.to_list(),
            "verifies": self.verify_ring.to_list(),
        }
