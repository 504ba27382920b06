"""A staggered verifier's full KV, from the host store into the pool slots its verify reads.

A reload starts when ADMIT's window for it opens, into slots it takes from SGLang's
allocator then (:class:`.staging.AheadSlots`), and hands them to its verify; one not
started on time reserves slots at its verify (free ones, else the verify headroom's) and
starts then. A verifier that finds no room waits an iteration; one ADMIT gave up on has
its full KV restored on the device and decodes from it (appendix B.1's ``B_g``).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_vc import stats

from .policy import Mode
from .reload import LayerwiseReload
from .reload import faults as reload_faults
from .staggered_schedule import Role, Slot
from .staging import PoolStaging


class VerifierStaging:
    """The reloads and staging of one worker's staggered schedule (``round``)."""

    def __init__(self, worker, round):
        self.worker = worker
        self.round = round

    def reload_bytes(self, rid: str, row: int) -> Optional[int]:
        """Bytes a verify of this request reloads: 0 for an in-pool drafter (it verifies in
        place); None if it decodes from its full device KV."""
        w = self.worker
        entry = w.host.get(rid, row)
        if entry is None or not entry.num_tokens or w.runtime.entry_for_row(row) is None:
            decision = w.modes.get(rid)
            if w.runtime.entry_for_row(row) is None and decision is not None and decision.mode is Mode.IN_POOL:
                return 0
            return None
        return entry.nbytes()  # what it copies over the link

    def reload_slot_bytes(self, rid: str, row: int) -> int:
        """The pool slots a reload of this request lands in, in bytes (held until its verify)."""
        entry = self.worker.host.get(rid, row)
        return 0 if entry is None else entry.num_tokens * self.worker.runtime.bytes_per_slot

    def reload_one(self, track, slots: Optional[torch.Tensor] = None,
                   staging: Optional[PoolStaging] = None) -> Optional[LayerwiseReload]:
        """Copy one request's whole full KV into pool slots for its verify (all layers,
        ``depth`` = every layer: it is consumed iterations later, and must not hold the copy
        thread meanwhile): ``slots`` reserved by the verify's staging, else slots taken now
        (:class:`.staging.AheadSlots`); None where the pool has no room for them yet."""
        w = self.worker
        entry = w.host.get(track.rid, track.row)
        if entry is None or not entry.num_tokens:
            return None
        ahead = None
        if slots is None:
            ahead = w._ahead_slots()
            slots = ahead.take(entry.num_tokens)
            if slots is None:
                return None
        layers = w._layer_ids()
        return LayerwiseReload(w.copy_thread, {0: entry}, {0: slots}, w.runtime.kv_pool,
                               w.req_to_token_pool.req_to_token, layers, w.device, depth=len(layers),
                               on_failure=w.restore, staging=staging, copy_stream=w.copy_stream, release=ahead)

    def stage(self, batch, slots, s: Slot, staging: PoolStaging) -> bool:
        """The verifier's full KV in pool slots for this forward: the slots its reload took
        ahead (handed to ``staging``), else slots reserved now (free ones, else the
        headroom's) and a reload into them started now. False where it does not verify
        this iteration (no room: it waits; no host rows: it fails)."""
        w, track = self.worker, s.track
        compressed = w.runtime.entry_for_row(track.row) is not None
        if reload_faults.take("lose") and compressed:  # testing: the host entry is gone
            w.host.drop(track.rid)
            if track.reload is not None:
                track.reload.close()
                track.reload = None
        entry = w.host.get(track.rid, track.row)
        if not compressed or entry is None or not entry.num_tokens:
            if compressed:
                # never verify against the compressed rows (that would not be lossless): the
                # request ends with an error, the rest of the batch goes on
                w._fail(batch.reqs[s.index], "its full KV is not on the host (host rows missing); it cannot "
                        "be verified exactly")
                slots.slots[slots.slots.index(s)] = Slot(s.index, Role.WAIT, track)
                return False
            return True
        if track.reload is not None:
            staging.hold(s.index, entry, track.reload.hand_over(staging)[0])
            return True
        if not staging.reserve(s.index, entry):
            self._defer(slots, s)
            return False
        track.reload = self.reload_one(track, staging.requests[s.index].slots, staging)  # not started on time: now
        track.reload_started_at = slots.iteration
        stats.add("vericache", reloads_at_verify=1)
        return True

    @staticmethod
    def _defer(slots, slot: Slot) -> None:
        """No pool room to stage the verifier's full KV this iteration (the headroom taken
        by the forward's other verifiers): it commits nothing and waits; its drafts are
        dropped and it is admitted again (a new reload, new drafts) next iteration."""
        track = slot.track
        track.drafts = []
        if track.reload is not None:
            track.reload.close()
        track.reload, track.reload_started_at = None, None
        slots.slots[slots.slots.index(slot)] = Slot(slot.index, Role.WAIT, track)

    def fall_back(self, track) -> bool:
        """ADMIT gave up on this request (deferred too often, or its reload can never
        fit the window): its full KV goes back onto the device and it decodes from it
        (appendix B.1's ``B_g``). False when the pool has no room yet (it waits)."""
        w = self.worker
        entry = w.host.get(track.rid, track.row)
        if entry is not None and w.runtime.entry_for_row(track.row) is not None:
            if not w.runtime.restore_full_kv(entry.req_pool_idx, entry.p, *w.restore.full_rows(entry)):
                return False
            w.host.drop(track.rid)
        self.round.schedule.fall_back(track)
        stats.add("vericache", fallbacks=1, admit_fallbacks=1)
        return True
