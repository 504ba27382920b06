"""The staggered schedule of VeriCache §4.2 and §5.2, driven by :class:`ReloadPlanner`.

One SGLang decode iteration under ``--vc-schedule staggered`` (the default):

* every **speculating** request drafts ONE token from its compressed KV, except
* the requests whose reserved verify falls on this iteration (ADMIT's ``d_r``): they
  verify all the tokens drafted since their admission in one extend over the full KV
  and commit the accepted run (the only iterations in which they commit anything);
* a request ADMIT could not place (no room on the BW or HBM ring, or the verify cap of
  the window) **waits**: it commits nothing and retries ADMIT next iteration; after
  ``window`` deferrals in a row it falls back to **full** decoding;
* a **full** request (appendix B.1's ``B_g``: its KV was never compressed, or it fell
  back) decodes one exact token per iteration from its full device KV.

In-pool drafters (their full KV resident: nothing to reload) are staggered the same way
by default on the CPU. With ``uniform_in_pool`` (``--vc-in-pool-verify uniform``, the
default where verify graphs were captured) they form one cohort instead: the first one
admitted in an iteration chooses the draft length, every other in-pool drafter admitted
while that cohort drafts is placed on the same verify iteration (a newcomer drafts fewer
tokens in its first cycle), exempt from the verify cap. The cohort then drafts in the same
iterations and verifies in one forward at one width: what a captured verify graph replays
(:mod:`.decode_graphs`).

A request's reload is kicked off at the first window of its reserved span (``d_r - S_r
+ 1``) and stages every layer of its full KV before its verify, overlapped with the
drafting iterations in between. ADMIT runs again after each verify (at the start of the
next iteration), anchored at ``X``, so draft lengths vary round by round with the load
on the link and on device memory.

This module keeps the per-request state and decides the roles; the worker runs the
forwards. No SGLang dependency.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from typing import Callable, Optional

from .reload_planner import Admission, ReloadPlanner
from .admit import AdmitState


class Role(enum.Enum):
    DRAFT = "draft"  # one draft token from the compressed KV
    VERIFY = "verify"  # reserved verify: extend over the drafts against the full KV
    WAIT = "wait"  # ADMIT deferred it: commits nothing this iteration
    FULL = "full"  # decodes from its full device KV (never compressed, or fell back)


@dataclasses.dataclass
class Track:
    """What the schedule knows of one decoding request between iterations."""

    rid: str
    row: int  # req_pool_idx
    committed: int  # L: KV length committed by verifies (the drafts sit at L .. L+j-1)
    drafts: list[int] = dataclasses.field(default_factory=list)
    admission: Optional[Admission] = None
    reload: object = None  # the LayerwiseReload kicked off for its next verify
    reload_started_at: Optional[int] = None
    full: bool = False  # decodes from full device KV (no more speculation)


@dataclasses.dataclass(frozen=True)
class Slot:
    """The inputs of one request's forward this iteration."""

    index: int  # in the SGLang batch
    role: Role
    track: Track


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a request committed this iteration (VERIFY and FULL requests)."""

    drafts: int  # drafts it verified
    tokens: int  # tokens it committed (accepted drafts + correction or bonus)


@dataclasses.dataclass
class IterationPlan:
    iteration: int
    slots: list[Slot]
    reloads_due: list[Slot]  # kick these reloads off now (before drafting)

    def of(self, role: Role) -> list[Slot]:
        return [s for s in self.slots if s.role is role]


class StaggeredSchedule:
    """Per-request tracks plus the reload scheduler, one iteration at a time.

    ``plan(...)`` admits what needs admitting and returns each request's role;
    ``finish(...)`` records what the worker did (the per-iteration trace) and slides the
    window. ``kv_bytes(index)`` gives the reload size of a compressed request, None for a
    request whose KV is not compressed (it decodes as FULL).
    """

    def __init__(self, scheduler: ReloadPlanner, draft_len: int,
                 trace_path: Optional[str] = None, ema: float = 0.2):
        self.sched = scheduler
        self.draft_len = draft_len
        # ADMIT's anchor for one request, given the batch size (the worker's DraftLength)
        self.anchor: Callable[[str, int], int] = lambda rid, batch: draft_len
        self.tracks: dict[str, Track] = {}
        self.trace_path = trace_path
        # in-pool drafters (nothing to reload) verify together: ``--vc-in-pool-verify uniform``
        self.uniform_in_pool = False
        # the widest uniform verify a captured graph replays (X + 1), None: no cap
        self.uniform_max_drafts: Optional[int] = None
        self.iter_time: Optional[float] = None
        self._ema = ema
        if trace_path:
            open(trace_path, "w").close()

    @property
    def now(self) -> int:
        return self.sched.now

    # ------------------------------------------------------------------ per iteration

    def plan(self, rids: list[str], rows: list[int], committed: list[int],
             kv_bytes: Callable[[int], Optional[int]],
             draft_caps: Optional[list[Optional[int]]] = None,
             hbm_bytes: Optional[Callable[[int], int]] = None) -> IterationPlan:
        """``draft_caps[i]``: the most drafts request ``i`` may make before its next
        verify (it has few tokens left; :func:`.decode_slots.draft_cap`), None: no cap.
        ``hbm_bytes(i)``: the device memory request ``i``'s reload holds until its verify
        (the pool slots it lands in), where it differs from the bytes it copies."""
        live = set(rids)
        for rid in [r for r in self.tracks if r not in live]:
            self.forget(rid)
        slots, due = [], []
        cohort = self._in_pool_cohort() if self.uniform_in_pool else None
        due_now = set(self.sched.due_reloads())
        verify_now = set(self.sched.due_verifies())
        for i, (rid, row, length) in enumerate(zip(rids, rows, committed)):
            track = self.tracks.get(rid)
            if track is None or track.row != row or track.committed != length:
                # new, or retracted and prefilled again: start over
                if track is not None:
                    self.forget(rid)
                track = self.tracks[rid] = Track(rid, row, length)
            nbytes = kv_bytes(i)
            if track.full and nbytes != 0:
                nbytes = None  # fell back: only in-pool drafting (its full KV resident) resumes it
            elif track.full:
                track.full = False  # full KV resident, and drafting pays again: in-pool
            if nbytes is None:  # not compressed (any more): nothing to verify against
                if not track.full:
                    self.fall_back(track)
                slots.append(Slot(i, Role.FULL, track))
                continue
            cap = draft_caps[i] if draft_caps is not None else None
            if track.admission is None and cap is not None and cap < 1:
                if nbytes == 0:  # its last token, its full KV resident: decoded, not drafted
                    track.full = True  # for this iteration (no fallback: see above)
                    slots.append(Slot(i, Role.FULL, track))
                    continue
                cap = 1  # compressed: one draft, then the verify (its only exact path)
            if track.admission is None and self.uniform_in_pool and nbytes == 0:
                # in-pool: verify with the in-pool drafters already admitted, or lead a new cohort
                if cohort is None or cohort <= self.now:
                    x = self.anchor(rid, len(rids))
                    x = x if self.uniform_max_drafts is None else min(x, self.uniform_max_drafts)
                else:
                    x = cohort - self.now
                x = x if cap is None else min(x, cap)
                track.admission = self.sched.admit(rid, 0, x, max_draft_len=x, stagger=False)
                if track.admission is not None and (cohort is None or cohort <= self.now):
                    cohort = track.admission.verify_iteration
            elif track.admission is None:
                anchor = self.anchor(rid, len(rids))
                track.admission = self.sched.admit(rid, nbytes, anchor if cap is None else min(anchor, cap),
                                                   hbm_bytes=hbm_bytes(i) if hbm_bytes is not None else None,
                                                   max_draft_len=cap)
            if track.admission is None:
                if self.sched.mode(rid) is AdmitState.FALLBACK:
                    slots.append(Slot(i, Role.FULL, track))  # the worker restores its full KV
                else:
                    slots.append(Slot(i, Role.WAIT, track))
                continue
            slot = Slot(i, Role.VERIFY if rid in verify_now else Role.DRAFT, track)
            slots.append(slot)
            if rid in due_now and track.reload is None:
                due.append(slot)
        return IterationPlan(self.now, slots, due)

    def _in_pool_cohort(self) -> Optional[int]:
        """The iteration the admitted in-pool drafters verify at (the latest, if a short
        output made one verify early), None if none is admitted."""
        return max((t.admission.verify_iteration for t in self.tracks.values()
                    if t.admission is not None and t.admission.kv_bytes == 0), default=None)

    def finish(self, plan: IterationPlan, iter_seconds: float, outcome: dict[str, "Outcome"],
               reloaded: dict[str, int], phases: Optional[dict[str, float]] = None) -> None:
        """Record the iteration, then slide the window: the verified requests are
        re-admitted at the start of the next iteration."""
        self.iter_time = iter_seconds if self.iter_time is None else (
            (1 - self._ema) * self.iter_time + self._ema * iter_seconds)
        self.sched.set_iter_time(max(self.iter_time, 1e-4))
        if self.trace_path:
            self._trace(plan, iter_seconds, outcome, reloaded, phases or {})
        for rid in self.sched.advance():
            track = self.tracks.get(rid)
            if track is not None:
                track.admission = None
                if track.reload is not None:  # consumed by its verify (or not: then dropped now)
                    track.reload.close()
                track.reload = None
                track.reload_started_at = None

    def verified(self, track: Track, accepted_tokens: int) -> None:
        """A verify committed ``accepted_tokens``: the drafts are spent."""
        track.committed += accepted_tokens
        track.drafts = []

    def fall_back(self, track: Track) -> None:
        """The request decodes from full device KV from now on; drafts not verified yet
        are dropped (nothing of them was committed)."""
        track.full = True
        track.drafts = []
        if track.reload is not None:
            track.reload.close()
            track.reload = None
        self.sched.release(track.rid)
        track.admission = None

    def forget(self, rid: str) -> None:
        track = self.tracks.pop(rid, None)
        if track is not None and track.reload is not None:
            track.reload.close()
        self.sched.release(rid)

    # ------------------------------------------------------------------ trace

    def _trace(self, plan, iter_seconds, outcome, reloaded, phases) -> None:
        """One JSON line per iteration: what each request did, next to what ADMIT had
        reserved for it (``--vc-schedule-trace``; the tests check one against the other)."""
        rows = []
        for s in plan.slots:
            adm = s.track.admission
            done = outcome.get(s.track.rid)
            rows.append({
                "rid": s.track.rid,
                "role": s.role.value,
                "drafts": len(s.track.drafts),  # drafted and not verified yet
                "verified_drafts": None if done is None else done.drafts,
                "committed": 0 if done is None else done.tokens,
                "admitted_at": None if adm is None else adm.admitted_at,
                "verify_at": None if adm is None else adm.verify_iteration,
                "reload_at": None if adm is None else adm.reload_iteration,
                "draft_len": None if adm is None else adm.draft_len,
                "reload_started_at": s.track.reload_started_at,
                "reload_bytes": reloaded.get(s.track.rid, 0),
            })
        record = {"iteration": plan.iteration, "seconds": round(iter_seconds, 6), "wall": round(time.time(), 4),
                  "phases": {k: round(v, 6) if isinstance(v, float) else v for k, v in phases.items()},
                  "iter_time_ema": self.sched.bw_ring.iter_time, "requests": rows}
        with open(self.trace_path, "a") as f:
            f.write(json.dumps(record) + "\n")
