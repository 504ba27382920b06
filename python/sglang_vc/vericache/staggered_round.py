"""VERICACHE's staggered iteration (``--vc-schedule staggered``, the default): one forward
per SGLang decode iteration, as ``plan -> forward -> commit``.

- :meth:`StaggeredRound.plan`: the mode of every request whose cycle ends is decided
  (:class:`.request_modes.RequestModes`: full, in-pool or offload), ADMIT assigns who
  drafts, verifies, waits or decodes full KV (:class:`.staggered.StaggeredSchedule`), the
  reloads due start and the verifiers' full KV is staged into pool slots
  (:class:`.verifier_staging.VerifierStaging`); the forward's layout is laid out as a
  :class:`.forward_plan.ForwardPlan` (:mod:`.forward_layout`).
- :meth:`StaggeredRound.forward`: ONE forward (SGLang's ragged ``TARGET_VERIFY`` layout,
  its uniform one where every request verifies in place, or its own ``DECODE`` where
  every request decodes one token) drafts one token per drafter, decodes one per full-KV
  request and verifies each verifier's run. The plan reaches the attention backend on the
  forward's verify input; nothing is set on the backend.
- :meth:`StaggeredRound.commit`: the verifiers commit their accepted drafts and the
  correction or bonus token (:func:`.sampling.greedy_verify_ids`), the drafters keep their
  draft, the full-KV requests their token; a fault inside the forward is one of its
  results (the reloads' :attr:`~.reload.LayerwiseReload.lost`), not a call into the worker.

The round is composed into the worker (``worker.staggered``), which provides SGLang's
model runner, the host store and the per-request bookkeeping.
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
from sglang_vc.spec_worker import committed_lens

from .decode_graphs import mark_replayable, verify_graphs_captured, verify_graphs_of
from .decode_slots import draft_cap
from .deferred import Launched, accept_on_device, copy_to_host, mark, seconds_between
from .flags import InPoolVerify
from .forward_layout import lay_out
from .forward_plan import Shape, attach
from .iteration import Committed, Iteration
from .policy import IterationRows
from .reload import measure_bandwidth
from .request_modes import RequestModes
from .sampling import greedy_verify_ids
from .reload_planner import ReloadPlanner
from .staggered_schedule import Outcome, Role, StaggeredSchedule
from .staging import PoolStaging, staged_layers
from .verifier_staging import VerifierStaging

logger = logging.getLogger(__name__)


class StaggeredRound:
    """The staggered iteration of one worker: ``run(batch)`` plans, forwards and commits."""

    def __init__(self, worker):
        self.worker = worker
        self._schedule: Optional[StaggeredSchedule] = None
        self.modes = RequestModes(worker, self)
        self.staging = VerifierStaging(worker, self)
        self.stalled_verifies = 0  # verifies that waited for pool room, nothing committed since
        self.launched: Optional[Launched] = None  # a drafting iteration SGLang overlapped, not settled yet
        # rid -> last token committed by the last settled iteration, which SGLang may not have processed
        self.unprocessed: dict[str, int] = {}

    # ------------------------------------------------------------------ the schedule

    @property
    def schedule(self) -> StaggeredSchedule:
        """The schedule, built at the first decode iteration (its HBM budget needs the
        runtime's pool)."""
        if self._schedule is None:
            w = self.worker
            bandwidth = w._bandwidth if w._bandwidth is not None else measure_bandwidth(w.device)
            staging = w._staging_budget()
            sched = ReloadPlanner(window=w.window, iter_time=0.05, bandwidth=bandwidth, hbm_bytes=staging,
                                    fallback_after=w.window)
            self._schedule = StaggeredSchedule(sched, w.num_drafts, trace_path=w.trace_path)
            self._schedule.anchor = self.modes.anchor
            self._schedule.uniform_in_pool = self._uniform_in_pool()
            graphs = verify_graphs_of(w.model_runner)
            self._schedule.uniform_max_drafts = graphs.max_drafts if graphs is not None else None
            logger.info("VERICACHE staggered schedule: window %d iterations, anchor X=%s, link %.2f GB/s "
                        "(measured), staging budget %.1f MB", w.window,
                        w.num_drafts if not w.draft_length.auto else
                        f"chosen from data in 1..{w.num_drafts} (from {w.draft_length.default})",
                        bandwidth / 1e9, staging / 1e6)
        return self._schedule

    def _uniform_in_pool(self) -> bool:
        """``--vc-in-pool-verify``: in-pool drafters verify together (one forward at one
        width), by default where SGLang captured the verify graphs that replay it."""
        choice = self.worker.in_pool_verify
        graphs = verify_graphs_captured(self.worker.model_runner)
        uniform = choice is InPoolVerify.UNIFORM or (choice is InPoolVerify.AUTO and graphs)
        logger.info("VERICACHE in-pool verifies: %s (--vc-in-pool-verify %s; verify CUDA graphs %s)",
                    "uniform, in one forward at one width" if uniform else "staggered over the iterations",
                    choice.value, "captured" if graphs else "not captured")
        return uniform

    def slots_ahead(self, req) -> int:
        """KV slots past its committed length the request's next staggered iteration
        writes up to (:mod:`.decode_slots`): its next draft's, or its next token's."""
        track = self._schedule.tracks.get(req.rid) if self._schedule is not None else None
        if track is None or track.row != req.kv.req_pool_idx or track.committed < req.kv.kv_committed_len:
            return 1  # new, or prefilled again: its first token
        # under the overlap scheduler SGLang allocates before it processes the queued
        # result: its committed length lags the worker's by what that result commits
        # an iteration launched and not settled writes one more position of its requests
        pending = self.launched is not None and req.rid in self.launched.rids
        return track.committed - req.kv.kv_committed_len + len(track.drafts) + 1 + pending

    def forget(self, rid: str) -> None:
        if self._schedule is not None:
            self._schedule.forget(rid)

    # ------------------------------------------------------------------ one iteration

    @torch.inference_mode()
    def run(self, batch, deferred: bool = False):
        """One staggered iteration; ``deferred`` (a drafting batch SGLang's overlap loop
        runs, :mod:`.deferred`): launched now, settled later (:meth:`settle`). With
        ``SGLANG_VC_COUNT_SYNCS`` set, the host synchronisations it made go into the
        trace (:mod:`sglang_vc.kvruntime.syncs`)."""
        w = self.worker
        started = time.perf_counter()
        counter = syncs.SyncCounter() if syncs.enabled() else None
        with counter if counter is not None else contextlib.nullcontext():
            it = self.plan(batch)
            phases = {"plan_s": time.perf_counter() - started}
            if deferred and it.forward is not None:
                done, result = None, self._launch(it, phases)
            else:
                done = self._now(it, phases)
                result = w.result(batch, done.tokens, done.lens, done.logits_output,
                                  can_run_cuda_graph=w.replayed and phases["forwards"] > 0)
        _count_syncs(phases, counter, "launch_" if done is None else "")
        if done is not None:
            self.schedule.finish(it.slots, time.perf_counter() - started, done.outcome, done.reloaded, phases)
        return result

    def _now(self, it: Iteration, phases: dict) -> Committed:
        """The forward and its commit, read back at once (a synchronous iteration)."""
        w = self.worker
        mark_s, forwards = time.perf_counter(), w.forwards
        if it.forward is not None:
            done = self.commit(it, self.forward(it))
        else:
            it.staging.restore()  # nothing forwarded: the reserved slots go back
            done = Committed.nothing(len(it.reqs), w.stride)
        phases["forward_s"] = time.perf_counter() - mark_s
        phases["forwards"] = w.forwards - forwards
        self._account(it, done, phases)
        return done

    def _launch(self, it: Iteration, phases: dict):
        """The forward and its accept rule queued on the device, SGLang's result built
        from their tensors; what SGLang reads before the iteration settles is set now:
        which requests verify, which commit nothing."""
        w, reqs = self.worker, it.reqs
        forwards, start = w.forwards, mark(w.device)
        accepted, n_drafts = accept_on_device(w, it, self.forward(it))
        host, ready = copy_to_host(accepted)
        end = mark(w.device)
        phases.update(forwards=w.forwards - forwards, deferred=True)
        committing = {s.index for s in it.full + it.verifiers}
        for i, req in enumerate(reqs):
            (w.commits_nothing.discard if i in committing else w.commits_nothing.add)(req.rid)
        for s in it.verifiers:
            reqs[s.index].vc_verified = True
        result = w.result(it.batch, accepted.tokens, accepted.lens, None,
                          can_run_cuda_graph=w.replayed and phases["forwards"] > 0)
        self.launched = Launched(it, host, ready, n_drafts, phases, (start, end),
                                 frozenset(s.track.rid for s in it.slots.slots), result)
        stats.add("vericache", overlapped_draft_iterations=1)
        return result

    def settle(self) -> None:
        """The launched iteration's commit, once its tokens are on the host: the
        drafters keep their drafts, full-KV requests and verifiers commit, and the
        schedule, the policy and the trace record it, as :meth:`commit` and :meth:`run`
        do for a synchronous iteration."""
        launched, self.launched = self.launched, None
        if launched is None:
            return
        it, phases = launched.it, launched.phases
        counter = syncs.SyncCounter() if syncs.enabled() else None
        with counter if counter is not None else contextlib.nullcontext():
            tokens, lens, token_rows, n_tokens, drafts, accepted = launched.unpack(self.worker.stride)
            done = Committed(tokens, lens)
            part, new_drafts = it.part, iter(drafts)
            for s in part:
                if s.role is Role.DRAFT:
                    s.track.drafts.append(next(new_drafts))
                elif s.role is Role.FULL:
                    self.schedule.verified(s.track, 1)
                    done.outcome[s.track.rid] = Outcome(drafts=0, tokens=1)
            vs = [k for k, s in enumerate(part) if s.role is Role.VERIFY]
            if vs:
                self._verified(it, vs, launched.n_drafts, accepted, [n_tokens[part[k].index] for k in vs], done)
            self.unprocessed = {s.track.rid: token_rows[s.index][n_tokens[s.index] - 1] for s in part
                                if n_tokens[s.index]}
            phases["forward_s"] = seconds_between(*launched.forward_marks)
            self._account(it, done, phases)
        _count_syncs(phases, counter, "settle_")
        self.schedule.finish(it.slots, phases["plan_s"] + phases["forward_s"], done.outcome, done.reloaded, phases)

    def plan(self, batch) -> Iteration:
        """Roles, reloads, staging and the forward's layout of this iteration."""
        w, sched = self.worker, self.schedule
        # the HBM ring holds --vc-staging-fraction of the pool, and never less than the
        # longest compressed span (the headroom's: a reload of any length can be placed)
        sched.sched.hbm_ring.hbm_bytes = max(w._ahead_slots().cap_bytes,
                                             w.headroom.need * w.runtime.bytes_per_slot)
        committed = committed_lens(batch).tolist()  # a host tensor already: no device sync
        rows = [req.kv.req_pool_idx for req in batch.reqs]  # the host's own (req_pool_indices is built from them)
        t0 = [self._last_token(req, n) for req, n in zip(batch.reqs, committed)]
        self.unprocessed = {}  # (SGLang has processed every result older than this iteration)
        for row in rows:
            entry = w.runtime.entry_for_row(row)
            if entry is not None:
                entry.keep_full_rows = True  # the verifier reads the committed rows: never rewritten lossy
        for req in batch.reqs:
            req.vc_verified = False  # SGLang's spec_* counts take only verifies (hooks.py)
        self.modes.decide(batch, rows, committed)
        slots = sched.plan([r.rid for r in batch.reqs], rows, committed,
                           lambda i: self.staging.reload_bytes(batch.reqs[i].rid, rows[i]),
                           # (its output so far: the committed tokens and the one after them)
                           [draft_cap(r.sampling_params.max_new_tokens, n + 1 - len(r.origin_input_ids))
                            for r, n in zip(batch.reqs, committed)],
                           # the HBM ring's: the pool slots a reload lands in, held until its verify
                           lambda i: self.staging.reload_slot_bytes(batch.reqs[i].rid, rows[i]))
        for slot in slots.reloads_due:
            slot.track.reload = self.staging.reload_one(slot.track)
            slot.track.reload_started_at = slots.iteration
        full = [s for s in slots.of(Role.FULL) if s.track.full or self.staging.fall_back(s.track)]
        # a verifier's full KV goes into pool slots for its verify: free ones, else the headroom's
        staging = PoolStaging(w.runtime, headroom=w.headroom)
        due = slots.of(Role.VERIFY)
        verifiers = [s for s in due if self.staging.stage(batch, slots, s, staging)]
        # verifies that waited with nothing committed in between (every request holding a
        # slot may be waiting to verify: then none would ever be freed; see VerifyHeadroom.fit)
        self.stalled_verifies = 0 if verifiers or full else self.stalled_verifies + len(due) - len(verifiers)
        it = Iteration(batch, slots, rows, t0, slots.of(Role.DRAFT), full, verifiers, staging)
        if it.part:
            lay_out(w, self.modes, it)
        return it

    def _last_token(self, req, committed: int) -> int:
        """The request's last committed token (its KV not computed yet): SGLang's
        ``output_ids`` show it unless the result of a settled overlapped iteration is not
        processed yet (then the settle kept it; ``overlap_of`` overlaps nothing else)."""
        if committed + 1 > len(req.origin_input_ids) + len(req.output_ids):
            return self.unprocessed[req.rid]
        return req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]

    def forward(self, it: Iteration) -> torch.Tensor:
        """The iteration's one forward; its logits, a row per query token."""
        w, fp = self.worker, it.forward
        req_to_token = w.req_to_token_pool.req_to_token
        own_rows = torch.tensor(it.rows, dtype=torch.int64)[list(fp.index)]
        out_slots = req_to_token[to_device(own_rows[it.query_owner()], req_to_token.device),
                                 to_device(fp.positions, req_to_token.device)].flatten()
        # staging keyed by the request's index in this forward
        it.reloads = {k: s.track.reload for k, s in enumerate(it.part)
                      if s.index in it.staging and s.track.reload is not None}
        it.staging.rekey({s.index: k for k, s in enumerate(it.part)})
        it.staging.layer_ready = staged_layers(it.reloads.values())
        it.sub = sub = w.sub_batch(it.batch, list(fp.index))
        viewed = list(fp.rows) if fp.views is not None else None
        try:
            it.staging.point()  # the verifiers' rows at their staged slots, before the metadata is built
            if fp.shape is Shape.DECODE:
                # every request decodes one token from full KV or drafts one over its view row:
                # SGLang's own decode forward (its decode kernels)
                logits = w.forward_sub(sub, ForwardMode.DECODE, fp.ids, torch.tensor(fp.row_starts) + 1, out_slots,
                                       None, rows=viewed, positions=fp.positions if viewed else None)
                stats.add("vericache", decode_forwards=1, view_decode_forwards=1 if viewed else 0)
            elif fp.shape is Shape.UNIFORM_VERIFY:
                # SGLang's uniform verify layout, which its verify graph replays (:mod:`.decode_graphs`)
                # with its full-KV backend (which reads the chain mask; vc_verify does not)
                n, width = len(fp.lens), fp.lens[0]
                spec_info = w.verify_input(fp.ids.view(n, width), fp.positions.view(n, width),
                                           torch.tensor(fp.row_starts), it.batch.seq_lens.device,
                                           mask=verify_graphs_captured(w.model_runner))
                mark_replayable(spec_info)
                attach(spec_info, fp)
                logits = w.forward_sub(sub, ForwardMode.TARGET_VERIFY, fp.ids, torch.tensor(fp.row_starts), out_slots,
                                       spec_info)
                stats.add("vericache", verify_forwards=1, uniform_verify_forwards=1,
                          verify_graph_forwards=1 if w.replayed else 0)
            else:
                # vc_verify runs the forward as a causal extend: no dense mask to build
                spec_info = w.ragged_verify_input(fp.ids, fp.positions, list(fp.row_starts), list(fp.lens),
                                                  it.batch.seq_lens.device, mask=False)
                attach(spec_info, fp)
                logits = w.forward_sub(sub, ForwardMode.TARGET_VERIFY, fp.ids, torch.tensor(fp.row_starts), out_slots,
                                       spec_info, rows=viewed)
                stats.add("vericache", verify_forwards=1)
        finally:
            w.view_rows.give_back()
            w.shared_selections.end_forward()
            for r in it.reloads.values():  # (before their slots are freed: see LayerwiseReload.close)
                r.close()
            it.staging.restore()
        return logits

    def commit(self, it: Iteration, logits: torch.Tensor) -> Committed:
        """Each request's tokens from the forward's logits: drafters keep their draft,
        full-KV requests commit their token, verifiers their accepted run."""
        w, fp, part, batch = self.worker, it.forward, it.part, it.batch
        done = Committed.nothing(len(it.reqs), w.stride)
        q_req = it.query_owner()
        # penalties and grammar masks at each row's own position: verified rows and drafts alike
        if w.constrained(it.sub.reqs):
            runs, before = it.runs()
            masked = None if w.draft_grammar else [s.role is not Role.DRAFT for s, n in zip(part, fp.lens)
                                                   for _ in range(n)]
            logits = w.penalize(logits, it.sub.reqs, runs, q_req.tolist(), before, [it.t0[s.index] for s in part],
                                masked)
        exact = w.targets_flat(logits, it.sub, q_req, fp.positions)
        bias = None if it.sub.sampling_info is None else it.sub.sampling_info.logit_bias
        # drafts are greedy (with the request's logit_bias: fewer rejections)
        drafted = (logits.float() if bias is None else
                   logits.float() + bias[:, : logits.shape[-1]].to(logits.device)[to_device(q_req, logits.device)])
        # the verifier's tokens and the drafts read back together: one copy to the host
        both = torch.stack([exact.to(torch.int64), drafted.argmax(-1)]).to("cpu")
        exact, draft_ids, exact_ids, offsets = both[0], both[1].tolist(), both[0].tolist(), fp.offsets
        for k, s in enumerate(part):
            if s.role is Role.DRAFT:
                s.track.drafts.append(draft_ids[offsets[k]])
            elif s.role is Role.FULL:
                done.tokens[s.index, 0] = exact_ids[offsets[k]]
                done.lens[s.index] = 1
                self.schedule.verified(s.track, 1)
                done.outcome[s.track.rid] = Outcome(drafts=0, tokens=1)
        lost = {rid: why for r in it.reloads.values() for rid, why in r.lost.items()}
        vs = [k for k, s in enumerate(part) if s.role is Role.VERIFY and not self._lost(it.reqs[s.index], lost)]
        if vs:
            self._accept(it, vs, [exact[offsets[k]: offsets[k + 1]] for k in vs], done)
        if batch.return_logprob:  # from the rows that chose the committed tokens
            first_row = [None] * len(it.reqs)
            for k, s in enumerate(part):
                if s.role is not Role.DRAFT:
                    first_row[s.index] = offsets[k]
            done.logits_output = w.committed_logprobs(batch, drafted, first_row, done.tokens, done.lens)
        return done

    def _lost(self, req, lost: dict) -> bool:
        """A request whose reload failed inside the forward with nowhere to restore its
        full KV: it fails now (:meth:`~.worker.VeriCacheWorker._fail`) and commits nothing."""
        message = lost.get(req.rid)
        if message is not None:
            self.worker._fail(req, message)
        return message is not None

    def _accept(self, it: Iteration, vs: list[int], targets: list[torch.Tensor], done: Committed) -> None:
        """Commit each verifier's accepted drafts and the verifier's correction or bonus
        token (the greedy rule of :func:`greedy_verify_ids` on the verifier's tokens,
        ``targets[j]`` at its ``len(drafts) + 1`` positions)."""
        verifiers = [it.part[k] for k in vs]
        n_drafts = [len(s.track.drafts) for s in verifiers]
        width = max(n_drafts) + 1
        drafts = torch.full((len(verifiers), width - 1), -1, dtype=torch.int64)
        padded = torch.zeros(len(verifiers), width, dtype=torch.int64)
        for j, s in enumerate(verifiers):
            drafts[j, : len(s.track.drafts)] = torch.tensor(s.track.drafts, dtype=torch.int64)
            padded[j, : targets[j].numel()] = targets[j]
        verdict = greedy_verify_ids(drafts, padded, draft_lens=torch.tensor(n_drafts), pad_id=0)
        n_tokens, n_accepted = verdict.num_tokens.tolist(), verdict.num_accepted.tolist()
        for j, s in enumerate(verifiers):
            done.tokens[s.index, : n_tokens[j]] = verdict.tokens[j, : n_tokens[j]]
            done.lens[s.index] = n_tokens[j]
        self._verified(it, vs, n_drafts, n_accepted, n_tokens, done)

    def _verified(self, it: Iteration, vs: list[int], n_drafts: list[int], n_accepted: list[int],
                  n_tokens: list[int], done: Committed) -> None:
        """The verifiers ``vs`` (indices into ``it.part``) committed ``n_tokens`` each,
        ``n_accepted`` of their ``n_drafts`` drafts: the schedule, the per-request and
        draft-length counts, and the reloads' bytes."""
        w, reqs, part = self.worker, it.reqs, it.part
        failures = 0
        for j, k in enumerate(vs):
            s, n = part[k], n_tokens[j]
            done.outcome[s.track.rid] = Outcome(drafts=n_drafts[j], tokens=n)
            if k in it.reloads:
                done.reloaded[s.track.rid] = it.reloads[k].nbytes()
                failures += it.reloads[k].failures
            reqs[s.index].vc_verified = True
            w._record(reqs[s.index], n_drafts[j], n_accepted[j], n)
            w.draft_length.record_verify(self.modes.drafter_of(s.track.row, s.track.rid), s.track.rid, n_drafts[j],
                                         n_accepted[j])
            self.schedule.verified(s.track, n)
        stats.add("vericache", verify_rounds=len(vs), drafted=sum(n_drafts), accepted=sum(n_accepted),
                  committed=sum(n_accepted) + len(vs), bytes_reloaded=sum(done.reloaded.values()))
        if failures:
            stats.add("vericache", reload_failures=failures)

    def _account(self, it: Iteration, done: Committed, phases: dict) -> None:
        """The iteration's counters, and the costs the mode policy and ``DraftLength`` fit."""
        w = self.worker
        if it.forward is not None:  # the mode policy's regressors (bench.throughput refits them from the trace)
            terms = it.terms
            phases.update(tokens=terms.tokens, rows=terms.rows, query_rows=terms.query_rows,
                          offload_drafts=terms.offload_drafts)
            w.draft_length.record_iteration(phases["forward_s"], len(it.drafters), len(it.full), it.verify_tokens,
                                            len(it.verifiers))
            w.policy.record(phases["forward_s"], terms, batch=len(it.reqs),
                            full_only=len(it.full) == len(it.part) == len(it.reqs))
        self.modes.count(it.slots)
        for req, n in zip(it.reqs, done.lens.tolist()):  # (SGLang's finishing check: hooks.py)
            (w.commits_nothing.discard if n else w.commits_nothing.add)(req.rid)
        stats.add("vericache", iterations=1, forwards=phases["forwards"], draft_steps=len(it.drafters),
                  waits=len(it.slots.of(Role.WAIT)) + len(it.slots.of(Role.FULL)) - len(it.full),
                  full_kv_steps=len(it.full))


__all__ = ["StaggeredRound", "IterationRows"]


def _count_syncs(phases: dict, counter, prefix: str) -> None:
    """The host synchronisations ``counter`` saw, into the trace's ``phases``: a
    synchronous iteration's as ``host_syncs``; a deferred one's launch and settle apart
    (``launch_``, ``settle_``) and together."""
    if counter is None:
        return
    phases[f"{prefix}host_syncs"] = counter.total
    phases.update({f"{prefix}host_syncs_{k.strip('_')}": n for k, n in counter.by_kind.items()})
    if syncs.with_sites():
        phases[f"{prefix}host_sync_sites"] = dict(counter.by_site)
    if prefix == "settle_":
        phases["host_syncs"] = phases.get("launch_host_syncs", 0) + counter.total
