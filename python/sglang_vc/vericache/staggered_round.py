"""VERICACHE's staggered schedule (``--vc-schedule staggered``, the default), a mixin of
:class:`~.worker.VeriCacheWorker`: one forward per SGLang decode iteration.

Each iteration (:meth:`StaggeredRound._staggered_iteration`): the mode of every request
whose cycle ends is decided (:class:`.policy.ModePolicy`: full, in-pool or offload), ADMIT
plans who drafts, verifies, waits or decodes full KV (:class:`.staggered.StaggeredSchedule`),
the reloads due are kicked off and the verifiers' full KV is staged into pool slots
(:mod:`.staging`); then ONE forward (SGLang's ragged ``TARGET_VERIFY`` layout, or its own
``DECODE`` when every request decodes full KV) drafts one token per drafter, decodes one
per full-KV request and verifies each verifier's run; the verifiers commit their accepted
drafts and the correction or bonus token (:func:`.sampling.greedy_verify_ids`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.kvruntime import syncs
from sglang_vc.kvruntime.plan import NO_COMPRESSION
from sglang_vc.spec_worker import committed_lens

from .attention import InPoolDrafts
from .decode_graphs import mark_replayable, verify_graphs_captured, verify_graphs_of
from .decode_slots import draft_cap
from .flags import InPoolVerify
from .forward_plan import ForwardPlan, attach
from .draft_view import View
from .policy import Decision, IterationRows, Mode
from .reload import LayerwiseReload, measure_bandwidth
from .reload import faults as reload_faults
from .sampling import greedy_verify_ids
from .scheduler import ReloadScheduler
from .staggered import Outcome, Role, Slot, StaggeredSchedule
from .staging import PoolStaging, staged_layers

logger = logging.getLogger(__name__)


def opted_out(req) -> bool:
    """``{"vc_compressor": "none"}`` in the request's ``custom_params``: full KV, no drafts
    over a view of it either."""
    params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(params, dict) and "vc_compressor" in params and \
        str(params["vc_compressor"]).lower() in NO_COMPRESSION


class StaggeredRound:
    """The staggered iteration (the worker provides the forwards, the reloads, the policy
    and the bookkeeping)."""

    def _slots_ahead(self, req) -> int:
        """KV slots past its committed length the request's next staggered iteration
        writes up to (:mod:`.decode_slots`): its next draft's, or its next token's."""
        track = self._staggered.tracks.get(req.rid) if self._staggered is not None else None
        if track is None or track.row != req.kv.req_pool_idx or track.committed < req.kv.kv_committed_len:
            return 1  # new, or prefilled again: its first token
        # under the overlap scheduler SGLang allocates before it processes the queued
        # result: its committed length lags the worker's by what that result commits
        return track.committed - req.kv.kv_committed_len + len(track.drafts) + 1

    def _schedule(self) -> StaggeredSchedule:
        if self._staggered is None:
            bandwidth = self._bandwidth if self._bandwidth is not None else measure_bandwidth(self.device)
            staging = self._staging_budget()
            sched = ReloadScheduler(window=self.window, iter_time=0.05, bandwidth=bandwidth,
                                    hbm_bytes=staging, fallback_after=self.window)
            self._staggered = StaggeredSchedule(sched, self.num_drafts, trace_path=self.trace_path)
            self._staggered.anchor = self._anchor
            self._staggered.uniform_in_pool = self._uniform_in_pool()
            graphs = verify_graphs_of(self.model_runner)
            self._staggered.uniform_max_drafts = graphs.max_drafts if graphs is not None else None
            logger.info("VERICACHE staggered schedule: window %d iterations, anchor X=%s, link %.2f GB/s "
                        "(measured), staging budget %.1f MB", self.window,
                        self.num_drafts if not self.draft_length.auto else
                        f"chosen from data in 1..{self.num_drafts} (from {self.draft_length.default})",
                        bandwidth / 1e9, staging / 1e6)
        return self._staggered

    def _uniform_in_pool(self) -> bool:
        """``--vc-in-pool-verify``: in-pool drafters verify together (one forward at one
        width), by default where SGLang captured the verify graphs that replay it."""
        choice = self.in_pool_verify
        graphs = verify_graphs_captured(self.model_runner)
        uniform = choice is InPoolVerify.UNIFORM or (choice is InPoolVerify.AUTO and graphs)
        logger.info("VERICACHE in-pool verifies: %s (--vc-in-pool-verify %s; verify CUDA graphs %s)",
                    "uniform, in one forward at one width" if uniform else "staggered over the iterations",
                    choice.value, "captured" if graphs else "not captured")
        return uniform

    def _drafter_of(self, row: int, rid: Optional[str] = None) -> str:
        entry = self.runtime.entry_for_row(row)
        if entry is not None:
            return entry.spec.compressor
        decision = self.modes.get(rid)
        return self.budget.name if decision is not None and decision.mode is Mode.IN_POOL else "none"

    def _anchor(self, rid: str, batch: int) -> int:
        track = self._staggered.tracks.get(rid)
        decision = self.modes.get(rid)
        if decision is not None and decision.mode is Mode.IN_POOL and decision.draft_len:
            x = decision.draft_len  # the policy chose it with the view's A(x) and the row costs
        else:
            x = self.draft_length.anchor(self._drafter_of(track.row, rid) if track else "none", rid, batch)
        stats.add("vericache", anchors=1, anchor_x_sum=x)  # their ratio: the mean X chosen
        info = self.per_request.get(rid)
        if info is not None:
            info["draft_len"] = x
        return x

    @staticmethod
    def _defer_verify(plan, slot) -> None:
        """No pool room to stage the verifier's full KV this iteration (the headroom taken
        by the forward's other verifiers): it commits nothing and waits; its drafts are
        dropped and it is admitted again (a new reload, new drafts) next iteration."""
        track = slot.track
        track.drafts = []
        if track.reload is not None:
            track.reload.close()
        track.reload, track.reload_started_at = None, None
        plan.slots[plan.slots.index(slot)] = Slot(slot.index, Role.WAIT, track)

    def _reload_bytes(self, rid: str, row: int) -> Optional[int]:
        """Bytes a verify of this request reloads: 0 for an in-pool drafter (it verifies in
        place); None if it decodes from its full device KV."""
        entry = self.host.get(rid, row)
        if entry is None or not entry.num_tokens or self.runtime.entry_for_row(row) is None:
            decision = self.modes.get(rid)
            if self.runtime.entry_for_row(row) is None and decision is not None and decision.mode is Mode.IN_POOL:
                return 0
            return None
        return entry.nbytes()  # what it copies over the link

    def _reload_slot_bytes(self, rid: str, row: int) -> int:
        """The pool slots a reload of this request lands in, in bytes (held until its verify)."""
        entry = self.host.get(rid, row)
        return 0 if entry is None else entry.num_tokens * self.runtime.bytes_per_slot

    def _reload_one(self, track, slots: Optional[torch.Tensor] = None) -> Optional[LayerwiseReload]:
        """Copy one request's whole full KV into pool slots for its verify (all layers,
        ``depth`` = every layer: it is consumed iterations later, and must not hold the copy
        thread meanwhile): ``slots`` reserved by the verify's staging, else slots taken now
        (:class:`.staging.AheadSlots`); None where the pool has no room for them yet."""
        entry = self.host.get(track.rid, track.row)
        if entry is None or not entry.num_tokens:
            return None
        ahead = None
        if slots is None:
            ahead = self._ahead_slots()
            slots = ahead.take(entry.num_tokens)
            if slots is None:
                return None
        layers = self._layer_ids()
        return LayerwiseReload(self.copy_thread, {0: entry}, {0: slots}, self.runtime.kv_pool,
                               self.req_to_token_pool.req_to_token, layers, self.device, depth=len(layers),
                               on_failure=self._restore_full_kv, copy_stream=self.copy_stream, release=ahead)

    def _stage_verifier(self, batch, plan, s, staging: PoolStaging) -> bool:
        """The verifier's full KV in pool slots for this forward: the slots its reload took
        ahead (handed to ``staging``), else slots reserved now (free ones, else the
        headroom's) and a reload into them started now. False where it does not verify
        this iteration (no room: it waits; no host rows: it fails)."""
        track = s.track
        compressed = self.runtime.entry_for_row(track.row) is not None
        if reload_faults.take("lose") and compressed:  # testing: the host entry is gone
            self.host.drop(track.rid)
            if track.reload is not None:
                track.reload.close()
                track.reload = None
        entry = self.host.get(track.rid, track.row)
        if not compressed or entry is None or not entry.num_tokens:
            if compressed:
                # never verify against the compressed rows (that would not be lossless): the
                # request ends with an error, the rest of the batch goes on
                self._fail(batch.reqs[s.index], "its full KV is not on the host (host rows missing); it cannot "
                           "be verified exactly")
                plan.slots[plan.slots.index(s)] = Slot(s.index, Role.WAIT, track)
                return False
            return True
        if track.reload is not None:
            staging.hold(s.index, entry, track.reload.hand_over()[0])
            return True
        if not staging.reserve(s.index, entry):
            self._defer_verify(plan, s)
            return False
        track.reload = self._reload_one(track, staging.requests[s.index].slots)  # not started on time: now
        track.reload_started_at = plan.iteration
        stats.add("vericache", reloads_at_verify=1)
        return True

    @torch.inference_mode()
    def _staggered_round(self, batch):
        """One staggered iteration; with ``SGLANG_VC_COUNT_SYNCS`` set, the host
        synchronisations it made go into the trace (:mod:`sglang_vc.kvruntime.syncs`)."""
        started = time.perf_counter()
        counter = syncs.SyncCounter() if syncs.enabled() else None
        with counter if counter is not None else contextlib.nullcontext():
            plan, result, outcome, reloaded, phases = self._staggered_iteration(batch, started)
        if counter is not None:
            phases["host_syncs"] = counter.total
            phases.update({f"host_syncs_{k.strip('_')}": n for k, n in counter.by_kind.items()})
            if syncs.with_sites():
                phases["host_sync_sites"] = dict(counter.by_site)
        self._staggered.finish(plan, time.perf_counter() - started, outcome, reloaded, phases)
        return result

    def _staggered_iteration(self, batch, started: float):
        sched = self._schedule()
        # the HBM ring holds --vc-staging-fraction of the pool, and never less than the
        # longest compressed span (the headroom's: a reload of any length can be placed)
        sched.sched.hbm_ring.hbm_bytes = max(self._ahead_slots().cap_bytes,
                                             self.headroom.need * self.runtime.bytes_per_slot)
        bs, dev = len(batch.reqs), batch.seq_lens.device
        committed = committed_lens(batch)
        row_list = [req.kv.req_pool_idx for req in batch.reqs]  # the host's own (req_pool_indices is built from them)
        rows = torch.tensor(row_list, dtype=torch.int64)
        t0 = [req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1] for req in batch.reqs]
        for row in row_list:
            entry = self.runtime.entry_for_row(row)
            if entry is not None:
                entry.keep_full_rows = True  # see _decode_round

        committed_list = committed.tolist()  # a host tensor already (read once above): no device sync
        for req in batch.reqs:
            req.vc_verified = False  # SGLang's spec_* counts take only verifies (hooks.py)
        self._decide_modes(batch, row_list, committed_list)
        plan = sched.plan([r.rid for r in batch.reqs], row_list, committed_list,
                          lambda i: self._reload_bytes(batch.reqs[i].rid, row_list[i]),
                          [draft_cap(r.sampling_params.max_new_tokens, len(r.output_ids)) for r in batch.reqs],
                          # the HBM ring's: the pool slots a reload lands in, held until its verify
                          lambda i: self._reload_slot_bytes(batch.reqs[i].rid, row_list[i]))
        for slot in plan.reloads_due:
            slot.track.reload = self._reload_one(slot.track)
            slot.track.reload_started_at = plan.iteration
        full = []
        for slot in plan.of(Role.FULL):
            if slot.track.full or self._fall_back(slot.track):
                full.append(slot)
        drafters = plan.of(Role.DRAFT)
        # a verifier's full KV goes into pool slots for its verify: free ones, else the headroom's
        staging = PoolStaging(self.runtime, headroom=self.headroom)
        verifiers, due = [], plan.of(Role.VERIFY)
        for s in due:
            if not self._stage_verifier(batch, plan, s, staging):
                continue
            verifiers.append(s)
        waits = len(due) - len(verifiers)
        # verifies that waited with nothing committed in between (every request holding a
        # slot may be waiting to verify: then none would ever be freed; see VerifyHeadroom.fit)
        self._stalled_verifies = 0 if verifiers or full else self._stalled_verifies + waits

        phases = {"plan_s": time.perf_counter() - started}
        logits_output = None  # SGLang's logprob outputs, where the batch asks for them
        accept_tokens = torch.zeros(bs, self.stride, dtype=torch.int64)
        accept_lens = torch.zeros(bs, dtype=torch.int64)
        outcome: dict[str, Outcome] = {}
        reloaded: dict[str, int] = {}

        # ONE forward (SGLang's ragged TARGET_VERIFY): a draft token from the compressed
        # KV for each drafting request, the next exact token from the full device KV for
        # each full-KV request, and the whole drafted run of each verifying request over
        # its full KV (reloaded); in batch order (see sub_batch)
        part = sorted(drafters + full + verifiers, key=lambda s: s.index)
        mark, forwards = time.perf_counter(), self.forwards
        if part:
            ids, positions, starts, lens = [], [], [], []
            runs, row_drafts = [], []  # per request its drafts, per row the drafts before it
            for s in part:
                tr = s.track
                if s.role is Role.VERIFY:
                    toks, start = [t0[s.index], *tr.drafts], tr.committed
                    row_drafts += range(len(toks))
                elif s.role is Role.DRAFT:
                    toks, start = [tr.drafts[-1] if tr.drafts else t0[s.index]], tr.committed + len(tr.drafts)
                    row_drafts.append(len(tr.drafts))
                else:
                    toks, start = [t0[s.index]], tr.committed
                    row_drafts.append(0)
                runs.append(tr.drafts if s.role is not Role.FULL else ())
                ids += toks
                positions += range(start, start + len(toks))
                starts.append(start)
                lens.append(len(toks))
            idx = [s.index for s in part]
            verify_tokens = sum(n for s, n in zip(part, lens) if s.role is Role.VERIFY)
            # in-pool drafters attend a sparse view of their own rows (:mod:`.draft_view`)
            in_pool = {k: self.budget.rows(s.track.committed) for k, s in enumerate(part)
                       if s.role is Role.DRAFT and self._in_pool(s.track)}
            # the window view: each drafter forwards over a view row of req_to_token, read by
            # SGLang's backend (:mod:`.view_rows`); the re-selected one is the project's attention
            views, native = None, self.budget.view is not View.RESELECT
            if in_pool and native:
                shared = None
                if self.budget.view is View.SHARED:
                    shared = (self.shared_selections,
                              {k: (part[k].track.rid, self.budget.split(part[k].track.committed)[1]) for k in in_pool})
                views = self.view_rows.write(in_pool, [row_list[s.index] for s in part], [st + 1 for st in starts],
                                             shared)
            in_pool_drafts = self._in_pool_drafts(part, {} if native else in_pool)
            fwd_rows, fwd_starts = [row_list[s.index] for s in part], list(starts)
            for k, view_row in (views.rows.items() if views is not None else ()):
                fwd_rows[k], fwd_starts[k] = view_row, views.lengths[k] - 1
            # full rows read: in-pool drafters' views, full-KV requests' and every verifier's rows
            # (an offloaded one's staged ones too); offload drafters have a term of their own
            full_rows = [k in in_pool or s.role is Role.VERIFY or self.runtime.entry_for_row(s.track.row) is None
                         for k, s in enumerate(part)]
            rows_read = sum(min(in_pool[k], st + 1) if k in in_pool else st + n
                            for k, (st, n) in enumerate(zip(starts, lens)) if full_rows[k])
            # query x row products: a verify's queries each score every row (on this CPU the
            # extend path's compute grows with them)
            query_rows = sum(min(in_pool[k], st + 1) if k in in_pool else n * (st + n)
                             for k, (st, n) in enumerate(zip(starts, lens)) if full_rows[k])
            offload_drafts = sum(1 for k, s in enumerate(part) if s.role is Role.DRAFT and k not in in_pool)
            q_req = torch.arange(len(part)).repeat_interleave(torch.tensor(lens))
            pos_t = torch.tensor(positions, dtype=torch.int64)
            req_to_token = self.req_to_token_pool.req_to_token
            slots = req_to_token[to_device(rows[idx][q_req], req_to_token.device), to_device(pos_t, req_to_token.device)]
            # staging keyed by the request's index in this forward
            reloads = {k: s.track.reload for k, s in enumerate(part)
                       if s.index in staging and s.track.reload is not None}
            staging.rekey({s.index: k for k, s in enumerate(part)})
            staging.layer_ready = staged_layers(reloads.values())
            ids_t = torch.tensor(ids, dtype=torch.int64)
            sub = self.sub_batch(batch, idx)
            try:
                self._verify_forward_with(staging)
                forward_plan = ForwardPlan(staging=staging, in_pool=in_pool_drafts)  # what its attention reads
                viewed = views.rows if views is not None else {}
                if all(s.role is Role.FULL or k in viewed for k, s in enumerate(part)):
                    # every request decodes one token from full KV or drafts one over its view
                    # row: SGLang's own decode forward (its decode kernels), not a verify
                    # layout with one query each
                    logits = self.forward_sub(sub, ForwardMode.DECODE, ids_t, torch.tensor(fwd_starts) + 1,
                                              slots.flatten(), None, rows=fwd_rows if viewed else None,
                                              positions=pos_t if viewed else None)
                    stats.add("vericache", decode_forwards=1, view_decode_forwards=1 if viewed else 0)
                elif self._uniform_verify(part, lens, staging, in_pool_drafts):
                    # every request verifies its W tokens over its resident full KV: SGLang's
                    # uniform verify layout, which its verify graph replays (:mod:`.decode_graphs`)
                    # with its full-KV backend (which reads the chain mask; vc_verify does not)
                    n, w = len(part), lens[0]
                    spec_info = self.verify_input(ids_t.view(n, w), pos_t.view(n, w), torch.tensor(fwd_starts), dev,
                                                  mask=verify_graphs_captured(self.model_runner))
                    mark_replayable(spec_info)
                    attach(spec_info, forward_plan)
                    logits = self.forward_sub(sub, ForwardMode.TARGET_VERIFY, ids_t, torch.tensor(fwd_starts),
                                              slots.flatten(), spec_info)
                    stats.add("vericache", verify_forwards=1, uniform_verify_forwards=1,
                              verify_graph_forwards=1 if self.replayed else 0)
                else:
                    # vc_verify runs the forward as a causal extend: no dense mask to build
                    spec_info = self.ragged_verify_input(ids_t, pos_t, fwd_starts, lens, dev, mask=False)
                    attach(spec_info, forward_plan)
                    logits = self.forward_sub(sub, ForwardMode.TARGET_VERIFY, ids_t, torch.tensor(fwd_starts),
                                              slots.flatten(), spec_info, rows=fwd_rows if viewed else None)
                    stats.add("vericache", verify_forwards=1)
            finally:
                self.view_rows.give_back()
                self.shared_selections.end_forward()
                for r in reloads.values():  # (before their slots are freed: see LayerwiseReload.close)
                    r.close()
                self._verify_forward_done()
            # penalties and grammar masks at each row's own position: verified rows and drafts alike
            if self.constrained(sub.reqs):
                masked = None if self.draft_grammar else [s.role is not Role.DRAFT for s, n in zip(part, lens)
                                                          for _ in range(n)]
                logits = self.penalize(logits, sub.reqs, runs, q_req.tolist(), row_drafts,
                                       [t0[s.index] for s in part], masked)
            exact = self.targets_flat(logits, sub, q_req, pos_t)
            bias = None if sub.sampling_info is None else sub.sampling_info.logit_bias
            # drafts are greedy (with the request's logit_bias: fewer rejections)
            drafted = (logits.float() if bias is None else
                       logits.float() + bias[:, : logits.shape[-1]].to(logits.device)[to_device(q_req, logits.device)])
            # the verifier's tokens and the drafts read back together: one copy to the host
            both = torch.stack([exact.to(torch.int64), drafted.argmax(-1)]).to("cpu")
            exact, draft_ids = both[0], both[1].tolist()
            offsets = [0]
            for n in lens:
                offsets.append(offsets[-1] + n)
            exact_ids = exact.tolist()
            for k, s in enumerate(part):
                if s.role is Role.DRAFT:
                    s.track.drafts.append(draft_ids[offsets[k]])
                elif s.role is Role.FULL:
                    accept_tokens[s.index, 0] = exact_ids[offsets[k]]
                    accept_lens[s.index] = 1
                    sched.verified(s.track, 1)
                    outcome[s.track.rid] = Outcome(drafts=0, tokens=1)
            vs = [k for k, s in enumerate(part) if s.role is Role.VERIFY and not self._failed(batch.reqs[s.index])]
            if vs:
                self._accept(batch, [part[k] for k in vs], [exact[offsets[k] : offsets[k + 1]] for k in vs],
                             {j: reloads[k] for j, k in enumerate(vs) if k in reloads},
                             accept_tokens, accept_lens, outcome, reloaded)
            if batch.return_logprob:  # from the rows that chose the committed tokens
                first_row = [None] * bs
                for k, s in enumerate(part):
                    if s.role is not Role.DRAFT:
                        first_row[s.index] = offsets[k]
                logits_output = self.committed_logprobs(batch, drafted, first_row, accept_tokens, accept_lens)
        else:
            staging.restore()  # nothing forwarded: the reserved slots go back
        phases["forward_s"] = time.perf_counter() - mark
        phases["forwards"] = self.forwards - forwards
        if part:  # the mode policy's regressors (bench.throughput refits them from the trace)
            phases.update(tokens=len(ids), rows=rows_read, query_rows=query_rows, offload_drafts=offload_drafts)
        if part:
            self.draft_length.record_iteration(phases["forward_s"], len(drafters), len(full), verify_tokens,
                                               len(verifiers))
            self.policy.record(phases["forward_s"], IterationRows(len(ids), rows_read, query_rows, offload_drafts),
                               batch=bs, full_only=len(full) == len(part) == bs)
        self._count_modes(plan)
        for req, n in zip(batch.reqs, accept_lens.tolist()):  # (SGLang's finishing check: hooks.py)
            (self.commits_nothing.discard if n else self.commits_nothing.add)(req.rid)
        stats.add("vericache", iterations=1, forwards=phases["forwards"], draft_steps=len(drafters),
                  waits=len(plan.of(Role.WAIT)) + len(plan.of(Role.FULL)) - len(full), full_kv_steps=len(full))
        return (plan, self.result(batch, accept_tokens, accept_lens, logits_output,
                                   can_run_cuda_graph=self.replayed and phases["forwards"] > 0),
                outcome, reloaded, phases)

    def _uniform_verify(self, part, lens: list[int], staging, in_pool_drafts) -> bool:
        """Whether this forward is a uniform verify no project attention takes part in:
        every request verifies the same number of tokens over its full KV resident in the
        pool (in-pool drafters: nothing staged, nothing compressed, no re-selection)."""
        return (len(set(lens)) == 1 and lens[0] > 1 and not staging.requests and in_pool_drafts is None
                and all(s.role is Role.VERIFY and self._in_pool(s.track)
                        and self.runtime.entry_for_row(s.track.row) is None for s in part))

    def _in_pool_drafts(self, part, in_pool: dict) -> Optional[InPoolDrafts]:
        """What the attention backend needs of this forward's in-pool requests: the
        per-head re-selected view's drafters (``in_pool``: budgets; the other views'
        drafters forward over view rows) and, for a re-selected view (per head or shared),
        the verifiers that re-select (:mod:`.draft_view`)."""
        if self.budget.view is View.WINDOW:
            return None
        verifiers = {}
        for k, s in enumerate(part):
            if s.role is Role.VERIFY and self._in_pool(s.track):
                count, recent = self.budget.split(s.track.committed)
                verifiers[k] = (s.track.rid, count, recent)
        if not in_pool and not verifiers:
            return None
        return InPoolDrafts(in_pool, self.budget.view, {k: part[k].track.rid for k in in_pool},
                            {k: self.budget.split(part[k].track.committed)[1] for k in in_pool}, verifiers)

    def _in_pool(self, track) -> bool:
        decision = self.modes.get(track.rid)
        return decision is not None and decision.mode is Mode.IN_POOL and not track.full

    def _decide_modes(self, batch, rows: list[int], committed: list[int]) -> None:
        """Each request whose full KV is resident gets full-KV decoding or in-pool drafting
        for its next cycle (:class:`.policy.ModePolicy`), decided at a cycle boundary only
        (no drafts outstanding); a compressed one is offload."""
        tracks = self._staggered.tracks
        for req, row, length in zip(batch.reqs, rows, committed):
            if self.runtime.entry_for_row(row) is not None:
                decision = self.modes.get(req.rid)
                if decision is None or decision.mode is not Mode.OFFLOAD:  # not the policy's choice
                    self.modes[req.rid] = decision = Decision(
                        Mode.OFFLOAD, None, "its KV was compressed after its prefill (--vc-compress-when always, "
                        "or the pool binds under --vc-schedule lockstep)")
                self._note_mode(req, decision)
                continue
            track = tracks.get(req.rid)
            at_boundary = track is None or (not track.drafts and track.admission is None) or track.full
            if req.rid in self.modes and self.modes[req.rid].mode is not Mode.OFFLOAD and not at_boundary:
                continue
            if opted_out(req):
                decision = Decision(Mode.FULL, None, "the request opted out of lossy KV (vc_compressor: none)")
            else:
                # the request's own A(x) once it has verifies enough: requests over one
                # document accept very differently (16k: A ~8 and ~1.7), and a pooled curve
                # keeps the slow ones drafting X = 13 after the fast ones finish (0.98x end
                # to end at 1.71x in the steady window)
                curve = self.draft_length.curve_for(self.budget.name, req.rid)
                decision = self.policy.decide_for(req.rid, length, len(batch.reqs), curve)
            self.modes[req.rid] = decision
            self._note_mode(req, decision)

    def _count_modes(self, plan) -> None:
        """Request-iterations per mode (``mode_iterations_*`` counters)."""
        counts = {m: 0 for m in Mode}
        for s in plan.slots:
            decision = self.modes.get(s.track.rid)
            mode = decision.mode if decision is not None else Mode.FULL
            if mode is Mode.IN_POOL and (s.track.full or s.role is Role.FULL):
                mode = Mode.FULL
            counts[mode] += 1
        stats.add("vericache", **{f"mode_iterations_{m.value.replace('-', '_')}": n for m, n in counts.items()})

    def _accept(self, batch, verifiers, targets, reloads, accept_tokens, accept_lens, outcome, reloaded) -> None:
        """Commit each verifier's accepted drafts and the verifier's correction or bonus
        token (the greedy rule of :func:`greedy_verify_ids` on the verifier's tokens,
        ``targets[j]`` at its ``len(drafts) + 1`` positions)."""
        sched = self._staggered
        n_drafts = [len(s.track.drafts) for s in verifiers]
        lens = torch.tensor(n_drafts)
        w = max(n_drafts) + 1
        drafts = torch.full((len(verifiers), w - 1), -1, dtype=torch.int64)
        padded = torch.zeros(len(verifiers), w, dtype=torch.int64)
        for j, s in enumerate(verifiers):
            drafts[j, : len(s.track.drafts)] = torch.tensor(s.track.drafts, dtype=torch.int64)
            padded[j, : targets[j].numel()] = targets[j]
        verdict = greedy_verify_ids(drafts, padded, draft_lens=lens, pad_id=0)
        n_tokens, n_accepted = verdict.num_tokens.tolist(), verdict.num_accepted.tolist()
        failures = 0
        for j, s in enumerate(verifiers):
            n = n_tokens[j]
            accept_tokens[s.index, :n] = verdict.tokens[j, :n]
            accept_lens[s.index] = n
            outcome[s.track.rid] = Outcome(drafts=n_drafts[j], tokens=n)
            if j in reloads:
                reloaded[s.track.rid] = reloads[j].nbytes()
                failures += reloads[j].failures
            batch.reqs[s.index].vc_verified = True
            self._record(batch.reqs[s.index], n_drafts[j], n_accepted[j], n)
            self.draft_length.record_verify(self._drafter_of(s.track.row, s.track.rid), s.track.rid, n_drafts[j],
                                            n_accepted[j])
            sched.verified(s.track, n)
        stats.add("vericache", verify_rounds=len(verifiers), drafted=sum(n_drafts), accepted=sum(n_accepted),
                  committed=sum(n_accepted) + len(verifiers), bytes_reloaded=sum(reloaded.values()))
        if failures:
            stats.add("vericache", reload_failures=failures)

    def _fall_back(self, track) -> bool:
        """ADMIT gave up on this request (deferred too often, or its reload can never
        fit the window): its full KV goes back onto the device and it decodes from it
        (appendix B.1's ``B_g``). False when the pool has no room yet (it waits)."""
        entry = self.host.get(track.rid, track.row)
        if entry is not None and self.runtime.entry_for_row(track.row) is not None:
            if not self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, *self._full_rows(entry)):
                return False
            self.host.drop(track.rid)
        self._staggered.fall_back(track)
        stats.add("vericache", fallbacks=1, admit_fallbacks=1)
        return True
