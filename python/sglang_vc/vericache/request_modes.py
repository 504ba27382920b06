"""Which mode serves each request of a staggered batch, cycle by cycle.

A request whose full KV is resident gets full-KV decoding or in-pool self-speculation for
its next cycle (:class:`.policy.ModePolicy`), decided at a cycle boundary only (no drafts
outstanding); a compressed one is offload. The decisions live in the worker's ``modes``
(rid -> :class:`.policy.Decision`), which its reply shows (``mode``, ``mode_reason``).
"""

from __future__ import annotations

from typing import Optional

from sglang_vc import stats
from sglang_vc.kvruntime.plan import NO_COMPRESSION

from .policy import Decision, Mode
from .staggered_schedule import Role


def opted_out(req) -> bool:
    """``{"vc_compressor": "none"}`` in the request's ``custom_params``: full KV, no drafts
    over a view of it either."""
    params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(params, dict) and "vc_compressor" in params and \
        str(params["vc_compressor"]).lower() in NO_COMPRESSION


class RequestModes:
    """The mode decisions of one worker's staggered schedule (``round``: its tracks)."""

    def __init__(self, worker, round):
        self.worker = worker
        self.round = round

    def decide(self, batch, rows: list[int], committed: list[int]) -> None:
        """Decide the mode of each request at a cycle boundary (``committed``: the lengths
        the worker committed; SGLang's own may lag by a queued result)."""
        w = self.worker
        tracks = self.round.schedule.tracks
        for req, row, length in zip(batch.reqs, rows, committed):
            if w.runtime.entry_for_row(row) is not None:
                decision = w.modes.get(req.rid)
                if decision is None or decision.mode is not Mode.OFFLOAD:  # not the policy's choice
                    w.modes[req.rid] = decision = Decision(
                        Mode.OFFLOAD, None, "its KV was compressed after its prefill (--vc-compress-when always, "
                        "or the pool binds under --vc-schedule lockstep)")
                w._note_mode(req, decision)
                continue
            track = tracks.get(req.rid)
            at_boundary = track is None or (not track.drafts and track.admission is None) or track.full
            if req.rid in w.modes and w.modes[req.rid].mode is not Mode.OFFLOAD and not at_boundary:
                continue
            if opted_out(req):
                decision = Decision(Mode.FULL, None, "the request opted out of lossy KV (vc_compressor: none)")
            else:
                # the request's own A(x) once it has verifies enough: requests over one
                # document accept very differently (16k: A ~8 and ~1.7), and a pooled curve
                # keeps the slow ones drafting X = 13 after the fast ones finish (0.98x end
                # to end at 1.71x in the steady window)
                curve = w.draft_length.curve_for(w.budget.name, req.rid)
                decision = w.policy.decide_for(req.rid, length, len(batch.reqs), curve)
            w.modes[req.rid] = decision
            w._note_mode(req, decision)

    def count(self, slots) -> None:
        """Request-iterations per mode (``mode_iterations_*`` counters)."""
        counts = {m: 0 for m in Mode}
        for s in slots.slots:
            decision = self.worker.modes.get(s.track.rid)
            mode = decision.mode if decision is not None else Mode.FULL
            if mode is Mode.IN_POOL and (s.track.full or s.role is Role.FULL):
                mode = Mode.FULL
            counts[mode] += 1
        stats.add("vericache", **{f"mode_iterations_{m.value.replace('-', '_')}": n for m, n in counts.items()})

    def in_pool(self, track) -> bool:
        decision = self.worker.modes.get(track.rid)
        return decision is not None and decision.mode is Mode.IN_POOL and not track.full

    def drafter_of(self, row: int, rid: Optional[str] = None) -> str:
        """The drafter a request drafts with: its compressor, the in-pool view's, or none."""
        w = self.worker
        entry = w.runtime.entry_for_row(row)
        if entry is not None:
            return entry.spec.compressor
        decision = w.modes.get(rid)
        return w.budget.name if decision is not None and decision.mode is Mode.IN_POOL else "none"

    def anchor(self, rid: str, batch: int) -> int:
        """ADMIT's anchor X for the request's next cycle."""
        w = self.worker
        track = self.round.schedule.tracks.get(rid)
        decision = w.modes.get(rid)
        if decision is not None and decision.mode is Mode.IN_POOL and decision.draft_len:
            x = decision.draft_len  # the policy chose it with the view's A(x) and the row costs
        else:
            x = w.draft_length.anchor(self.drafter_of(track.row, rid) if track else "none", rid, batch)
        stats.add("vericache", anchors=1, anchor_x_sum=x)  # their ratio: the mean X chosen
        info = w.per_request.get(rid)
        if info is not None:
            info["draft_len"] = x
        return x
