"""The VERICACHE speculative worker (SGLang spec-V2 schema, synchronous).

Two schedules (``--vc-schedule``). **staggered** (the default, VeriCache §4.2 and §5.2,
:mod:`.staggered`): at each iteration every speculating request drafts one token from
its compressed KV, while the few whose verify ADMIT reserved for this iteration verify
their drafts against the full KV instead; reloads start at their reserved window and
stage the whole request over the drafting iterations in between. **lockstep** (the
comparison mode) runs one round per iteration for the whole batch, described below.

The lock-step round is :mod:`.lockstep`'s.

Greedy requests get exactly the full-KV tokens: every committed token is the full-KV
argmax given committed tokens only. A sampling request commits drafts while they equal
the verifier's own sample at that position (a lossless rule: each committed token is a
sample of the full-KV distribution), then that sample. The verifier applies a request's
``logit_bias``, temperature, top-k, top-p, min-p and (deterministic inference) seed as
SGLang's sampler does, and the frequency, presence and repetition penalties and
``min_new_tokens`` at each position from the output before it, drafts included
(:mod:`sglang_vc.penalties`), and a grammar's vocabulary mask after the drafts before each
position (:mod:`sglang_vc.grammar_masks`). Logprobs of the committed tokens come from the
same full-KV rows (``ChainSpecWorker.committed_logprobs``). What it cannot apply exactly
(watermarks, custom logit processors, beam search) is refused with HTTP 400
(:mod:`.requests`).

Fallbacks: a request whose full KV does not fit the host store (``--vc-host-kv-gb``) is
not compressed and decodes from its full device KV; a failed staged copy is retried
synchronously, and a copy that fails every retry restores the request's full KV on the
device from the host store (``reload_fallbacks``), from which it verifies and decodes.

A token-dropping drafter's verify reloads only the dropped rows (:class:`.reload.Span`).

Under the staggered schedule an iteration is ONE forward (SGLang's ragged
``TARGET_VERIFY`` layout): each drafting request forwards its one draft token, each
full-KV request its next token, each verifying request its whole drafted run, with
per-request query lengths. An iteration in which every request decodes from full KV is
SGLang's own ``DECODE`` forward instead (its decode kernels; one query per request).

"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream, get_runtime, syncs
from sglang_vc.spec_worker import ChainSpecWorker

from . import flags
from .decode_slots import draft_cap
from .draft_length import DraftLength
from .names import DEFAULT_DRAFT_TOKENS, META_INFO_KEY
from .reload import HostKVStore, LayerwiseReload, measure_bandwidth
from .staging_arena import StagingArena
from .staging import PoolStaging, VerifyHeadroom, staged_layers
from .attention import InPoolDrafts
from .draft_view import View
from .policy import Decision, IterationRows, Mode, ModePolicy
from .sampling import greedy_verify_ids
from .lockstep import LockstepRound
from .scheduler import ReloadScheduler
from .staggered import Outcome, Role, Slot, StaggeredSchedule

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- worker


class VeriCacheWorker(LockstepRound, ChainSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        from sglang.srt.runtime_context import get_device, get_spec

        num_drafts = int(get_spec().speculative_num_draft_tokens)
        settings = flags.settings_of(server_args)
        schedule = flags.schedule(settings)
        # staggered: a request drafts up to 2X - 1 tokens between verifies (ADMIT searches
        # X-1, X+1, ...), all inside the 2X slots SGLang reserves past its committed length
        window = 2 * num_drafts
        super().__init__(target_worker, stride=num_drafts + 1 if schedule is flags.Schedule.LOCKSTEP else window)
        self.server_args = server_args
        self.num_drafts: int = num_drafts
        self.width = self.num_drafts + 1  # verify tokens per request: t0 + X drafts
        self.device = get_device().device
        self.schedule = schedule
        self.window = window
        self.trace_path = flags.trace_path(settings)
        self.copy_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-reload")
        self.copy_stream = CopyStream(self.device)  # the copy thread's own stream on an accelerator
        # the prompt's full KV moves to the host on the same stream its reloads use
        self.host = HostKVStore(flags.host_kv_bytes(settings), copy_stream=self.copy_stream)
        self.per_request: dict[str, dict] = {}
        self.compress_when = flags.compress_when(settings)
        # X fixed by --speculative-num-draft-tokens, or chosen from data up to it
        self.draft_length = DraftLength(None if flags.draft_len_auto(server_args) else num_drafts, num_drafts,
                                        DEFAULT_DRAFT_TOKENS)
        # full KV resident: full-KV decoding or in-pool self-speculation, per request and cycle
        self.budget = flags.draft_budget(settings)
        self.draft_grammar = flags.draft_grammar(settings)  # grammar masks on drafting rows too
        in_pool = flags.in_pool(settings)
        if schedule is flags.Schedule.LOCKSTEP and in_pool is not flags.InPool.NEVER:
            logger.warning("VERICACHE: in-pool drafting runs under the staggered schedule only; under "
                           "--vc-schedule lockstep requests whose full KV fits the pool decode from it")
            in_pool = flags.InPool.NEVER
        forced = {flags.InPool.ALWAYS: Mode.IN_POOL, flags.InPool.NEVER: Mode.FULL}.get(in_pool)
        self.policy = ModePolicy(self.budget.rows, num_drafts, self.draft_length.fixed, forced,
                                 default_x=self.draft_length.default)
        self.modes: dict[str, Decision] = {}  # rid -> the mode of its current cycle
        self._runtime = None
        self.headroom: Optional[VerifyHeadroom] = None  # set with the runtime
        self._staggered: Optional[StaggeredSchedule] = None
        self._stalled_verifies = 0  # verifies that waited for pool room, nothing committed since
        self._bandwidth: Optional[float] = None
        if schedule is flags.Schedule.STAGGERED:
            # the link is measured once, here rather than in the first decode iteration (the
            # schedule itself is built then: its HBM budget needs the runtime's payload store)
            self._bandwidth = measure_bandwidth(self.device)

    @property
    def runtime(self):
        if self._runtime is None:
            self._runtime = get_runtime(self.model_runner)
            self._runtime.full_kv_sink = self.host.sink
            self._runtime.full_kv_admit = self._admit_host
            if self.compress_when is flags.CompressWhen.MEMORY_BINDS:
                self._runtime.compress_gate = self._full_kv_while_memory_free
            self._runtime.full_kv_kept = self.host.kept
            self.headroom = self._runtime.held_back = VerifyHeadroom(
                self._runtime.allocator, lambda n: evict_from_tree_cache(self._runtime.tree_cache, n))
            if self.schedule is flags.Schedule.STAGGERED:  # SGLang allocates what an iteration writes
                self._runtime.slots_ahead = self._slots_ahead
            self._install_specache_drafter(self._runtime)
        return self._runtime

    def _install_specache_drafter(self, runtime) -> None:
        """Requests compressed with ``specache`` (the server's ``--vc-compressor`` or a
        request's own) draft with SpeCache's attention (:mod:`.specache_drafter`) at the
        server's ``--specache-topk`` and ``--specache-residual``."""
        from sglang_vc.compress import SpeCacheCopy
        from sglang_vc.config import get_vc_config
        from sglang_vc.specache import flags as specache_flags

        from .specache_drafter import SpeCacheDrafter

        vc = get_vc_config(self.server_args)
        cfg = specache_flags.drafter_settings(vc.group(specache_flags.GROUP))
        runtime.use_compressor(SpeCacheCopy(group_size=cfg.group_size, residual_length=cfg.residual))
        self.drafter = SpeCacheDrafter(self.host, runtime, cfg.topk)
        self.model_runner.attn_backend.drafter = self.drafter

    def _slots_ahead(self, req) -> int:
        """KV slots past its committed length the request's next staggered iteration
        writes up to (:mod:`.decode_slots`): its next draft's, or its next token's."""
        track = self._staggered.tracks.get(req.rid) if self._staggered is not None else None
        if track is None or track.committed != req.kv.kv_committed_len:
            return 1  # new, or prefilled again: its first token
        return len(track.drafts) + 1

    def _full_kv_while_memory_free(self, rid: str, own_rows: int, spec) -> Optional[str]:
        """``--vc-compress-when memory-binds``: whether a request whose prefill just ended
        is compressed (offload; None) or keeps its full KV (the reason). It keeps it where
        the pool still has room for the waiting requests' prompts (memory does not bind the
        batch: it decodes full KV or drafts in place, by the mode policy) and, under the
        staggered schedule, where offloading does not pay by the mode policy's fitted costs
        (:meth:`.policy.ModePolicy.offload`); the waiting requests then wait, as on a plain
        server."""
        runtime = self.runtime
        room, waiting = runtime.free_room(), runtime.waiting_demand
        if room >= waiting:
            stats.add("vericache", full_kv_memory_free=1)
            return (f"the KV pool has room for its full KV ({room} free rows >= {waiting} waiting; "
                    "--vc-compress-when)")
        if self.schedule is not flags.Schedule.STAGGERED:
            return None
        kept = spec.rows_kept(own_rows) if spec.scenario == "token_dropping" else 0
        per_waiting = waiting / max(1, runtime.waiting_requests)
        admitted = min(runtime.waiting_requests, max(0, room + own_rows - kept) // max(1, per_waiting))
        offloaded = len(runtime.compressed_rids())
        held = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        reload_s = own_rows * runtime.bytes_per_slot / (self._bandwidth or measure_bandwidth(self.device))
        decision = self.policy.offload(own_rows, max(1, held - offloaded), offloaded, admitted,
                                       self.draft_length.curves[spec.compressor], reload_s)
        if decision.mode is Mode.OFFLOAD:
            self.modes[rid] = decision
            stats.add("vericache", offload_chosen=1)
            return None
        stats.add("vericache", offload_declined=1)
        return decision.reason

    def _admit_host(self, rid: str, req_pool_idx: int, p: int, n: int) -> bool:
        ok = self.host.admit(rid, req_pool_idx, p, n, (n - p) * self.runtime.bytes_per_slot)
        if not ok:
            stats.add("vericache", fallbacks=1, host_store_full=1)
        return ok

    # ------------------------------------------------------------------ entry point

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        runtime = self.runtime  # installs the host sink before the first prefill
        for req in batch.reqs:
            self.drafter.set_request(req.rid, getattr(req.sampling_params, "custom_params", None))
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            if self.schedule is flags.Schedule.STAGGERED:
                result = self._staggered_round(batch)
            else:
                result = self._decode_round(batch)
        else:
            result = self.prefill_result(batch, pp_proxy_tensors)
            self.host.flush()  # what no compressor selected moves to the host whole
        self.host.retain(runtime.compressed_rids())
        # pool room for the verify of the longest compressed span (eq. 5: the device budget
        # counts a verifier's full KV), held back from SGLang's admission -- but not the
        # slots SGLang tops every running request up with at its next decode (after a
        # prefill the running batch decodes next, not only this batch; one slot each under
        # the staggered schedule, :mod:`.decode_slots`), unless a verify has waited too long
        rows_held = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        per_decode = 1 if runtime.slots_ahead is not None else get_alloc_reserve_per_decode()
        self.headroom.fit(max((e.num_tokens for e in self.host.entries.values()), default=0),
                          keep_free=max(rows_held, len(batch.reqs)) * per_decode,
                          stalled=self._stalled_verifies)
        live = {r.rid for r in batch.reqs} | set(runtime.plans)
        for rid in [r for r in self.per_request if r not in live]:
            del self.per_request[rid]
        for rid in [r for r in self.modes if r not in live]:
            del self.modes[rid]
        selections = self.model_runner.attn_backend.selections
        for rid in [r for r in (selections or {}) if r not in live]:
            del selections[rid]
        self.drafter.forget(live)
        self.draft_length.forget(live)
        return result

    # ------------------------------------------------------------------ one round

    def _record(self, req, drafted: int, accepted: int, committed: int) -> None:
        """Per-request verify counters, returned in the request's ``meta_info``."""
        info = self._info(req.rid)
        info["verify_rounds"] += 1
        info["drafted"] += drafted
        info["accepted"] += accepted
        info["committed"] += committed
        info["mean_acceptance_length"] = info["committed"] / info["verify_rounds"]
        self._publish(req, info)

    def _info(self, rid: str) -> dict:
        return self.per_request.setdefault(rid, {"verify_rounds": 0, "drafted": 0, "accepted": 0, "committed": 0,
                                                 "draft_tokens": self.num_drafts,
                                                 "draft_len_mode": "auto" if self.draft_length.auto else "fixed"})

    @staticmethod
    def _publish(req, info: dict) -> None:
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [info]

    def _note_mode(self, req, decision: Decision) -> None:
        """The mode serving the request now and why, in its reply (``mode``, ``mode_reason``)."""
        info = self._info(req.rid)
        if info.get("mode") != decision.mode.value or info.get("mode_reason") != decision.reason:
            info["mode"], info["mode_reason"] = decision.mode.value, decision.reason
            if decision.predicted_speedup is not None:
                info["predicted_speedup"] = round(decision.predicted_speedup, 3)
            self._publish(req, info)

    # ------------------------------------------------------------------ staggered

    def _schedule(self) -> StaggeredSchedule:
        if self._staggered is None:
            bandwidth = self._bandwidth if self._bandwidth is not None else measure_bandwidth(self.device)
            staging = self._staging_budget()
            sched = ReloadScheduler(window=self.window, iter_time=0.05, bandwidth=bandwidth,
                                    hbm_bytes=staging, fallback_after=self.window)
            self._staggered = StaggeredSchedule(sched, self.num_drafts, trace_path=self.trace_path)
            self._staggered.anchor = self._anchor
            logger.info("VERICACHE staggered schedule: window %d iterations, anchor X=%s, link %.2f GB/s "
                        "(measured), staging budget %.1f MB", self.window,
                        self.num_drafts if not self.draft_length.auto else
                        f"chosen from data in 1..{self.num_drafts} (from {self.draft_length.default})",
                        bandwidth / 1e9, staging / 1e6)
        return self._staggered

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

    def _staging_budget(self) -> int:
        """The HBM ring's capacity: reloads staged ahead of their verify live beside SGLang's
        KV pool (one buffer, :meth:`_staging_arena`), in the share of SGLang's KV budget set aside for them
        (``--vc-staging-fraction``, ``hooks._payload_store_inside_the_budget``: the pool
        shrank by it). (The verify forward itself takes ``n - p`` pool slots per verifier:
        the pool's, with the verify headroom held back for them, :mod:`.staging`.)"""
        if not self.runtime.staging_budget:  # the budget was not split (a pool sized by hand)
            pool_slots = self.runtime.kv_pool.get_key_buffer(self.runtime.start_layer).shape[0]
            self.runtime.staging_budget = int(flags.staging_fraction(flags.settings_of(self.server_args))
                                              * self.runtime.bytes_per_slot * pool_slots)
        return int(self.runtime.staging_budget)

    def _staging_arena(self) -> StagingArena:
        """The staging share as one buffer, allocated at the first reload (the share is
        known once the runtime is)."""
        runtime = self.runtime
        if runtime.staging_arena is None:
            runtime.staging_arena = StagingArena(self._staging_budget(), self.device, self.copy_stream.fences)
            logger.info("VERICACHE: reloads staged ahead of their verify go into one %.2f GB buffer",
                        runtime.staging_arena.capacity / 1e9)
        return runtime.staging_arena

    def _reload_bytes(self, rid: str, row: int) -> Optional[int]:
        """Bytes a verify of this request reloads: 0 for an in-pool drafter (it verifies in
        place); None if it decodes from its full device KV."""
        entry = self.host.get(rid, row)
        if entry is None or not entry.num_tokens or self.runtime.entry_for_row(row) is None:
            decision = self.modes.get(rid)
            if self.runtime.entry_for_row(row) is None and decision is not None and decision.mode is Mode.IN_POOL:
                return 0
            return None
        return entry.staged_bytes()  # what it takes in the staging arena (the HBM ring's bytes)

    def _layer_ids(self) -> list[int]:
        kv_pool = self.runtime.kv_pool
        return list(range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num))

    def _reload_one(self, track) -> Optional[LayerwiseReload]:
        """Stage one request's whole full KV (all layers, ``depth`` = every layer): it is
        consumed iterations later, and must not hold the copy thread meanwhile."""
        entry = self.host.get(track.rid, track.row)
        if entry is None or not entry.num_tokens:
            return None
        layers = self._layer_ids()
        return LayerwiseReload(self.copy_thread, {0: entry}, layers, self.device, depth=len(layers),
                               on_failure=self._restore_full_kv, copy_stream=self.copy_stream,
                               arena=self._staging_arena())

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
        bs, dev = len(batch.reqs), batch.seq_lens.device
        committed = batch.seq_lens.to("cpu", torch.int64)
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
                          [draft_cap(r.sampling_params.max_new_tokens, len(r.output_ids)) for r in batch.reqs])
        for slot in plan.reloads_due:
            slot.track.reload = self._reload_one(slot.track)
            slot.track.reload_started_at = plan.iteration
        full = []
        for slot in plan.of(Role.FULL):
            if slot.track.full or self._fall_back(slot.track):
                full.append(slot)
        drafters = plan.of(Role.DRAFT)
        # a verifier's full KV goes into pool slots for its verify: free ones, else the headroom's
        staging = PoolStaging(self.runtime, lambda layer_id: {}, self.headroom)
        verifiers, due = [], plan.of(Role.VERIFY)
        for s in due:
            if s.track.reload is None and self.runtime.entry_for_row(s.track.row) is not None:
                s.track.reload = self._reload_one(s.track)  # not started on time: now
                s.track.reload_started_at = plan.iteration
            reload = s.track.reload
            if reload is None:
                if self.runtime.entry_for_row(s.track.row) is not None:
                    # never verify against the compressed rows: that would not be lossless
                    raise RuntimeError(f"VERICACHE: no full KV on the host for compressed request {s.track.rid}")
            elif not staging.reserve(s.index, reload.entries[0]):
                self._defer_verify(plan, s)
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
            in_pool_drafts = self._in_pool_drafts(part, in_pool)
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
            reloads = {k: s.track.reload for k, s in enumerate(part) if s.index in staging}
            staging.rekey({s.index: k for k, s in enumerate(part)})
            staging.layer_spans = staged_layers(reloads)
            ids_t = torch.tensor(ids, dtype=torch.int64)
            sub = self.sub_batch(batch, idx)
            try:
                self._verify_forward_with(staging)
                self.model_runner.attn_backend.in_pool = in_pool_drafts
                if len(full) == len(part):
                    # every request decodes one token from full KV: SGLang's own decode
                    # forward (its decode kernels), not a verify layout with one query each
                    logits = self.forward_sub(sub, ForwardMode.DECODE, ids_t, torch.tensor(starts) + 1,
                                              slots.flatten(), None)
                else:
                    # vc_verify runs the forward as a causal extend: no dense mask to build
                    spec_info = self.ragged_verify_input(ids_t, pos_t, starts, lens, dev, mask=False)
                    logits = self.forward_sub(sub, ForwardMode.TARGET_VERIFY, ids_t, torch.tensor(starts),
                                              slots.flatten(), spec_info)
            finally:
                self.model_runner.attn_backend.in_pool = None
                self._verify_forward_done()
                for r in reloads.values():
                    r.close()
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
            vs = [k for k, s in enumerate(part) if s.role is Role.VERIFY]
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
        stats.add("vericache", iterations=1, forwards=phases["forwards"], draft_steps=len(drafters),
                  waits=len(plan.of(Role.WAIT)) + len(plan.of(Role.FULL)) - len(full), full_kv_steps=len(full))
        return plan, self.result(batch, accept_tokens, accept_lens, logits_output), outcome, reloaded, phases

    def _in_pool_drafts(self, part, in_pool: dict) -> Optional[InPoolDrafts]:
        """What the attention backend needs of this forward's in-pool requests: the
        drafters' budgets and, for the re-selected view, their ids and the verifiers that
        re-select (:mod:`.draft_view`)."""
        if self.budget.view is not View.RESELECT:
            return InPoolDrafts(in_pool) if in_pool else None
        verifiers = {}
        for k, s in enumerate(part):
            if s.role is Role.VERIFY and self._in_pool(s.track):
                count, recent = self.budget.split(s.track.committed)
                verifiers[k] = (s.track.rid, count, recent)
        if not in_pool and not verifiers:
            return None
        return InPoolDrafts(in_pool, View.RESELECT, {k: part[k].track.rid for k in in_pool},
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
            decision = self.policy.decide(length, len(batch.reqs), self.draft_length.curves[self.budget.name])
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

    def _start_reload(self, batch, rows):
        """Kick off the staged reload of every request of the batch that is compressed
        and has its full KV on the host; None when no request needs one."""
        entries = {}
        for i, req in enumerate(batch.reqs):
            row = int(rows[i])
            entry = self.host.get(req.rid, row)
            if entry is not None and entry.num_tokens and self.runtime.entry_for_row(row) is not None:
                entries[i] = entry
        if not entries:
            return None
        return LayerwiseReload(self.copy_thread, entries, self._layer_ids(), self.device,
                               on_failure=self._restore_full_kv, copy_stream=self.copy_stream,
                               arena=self._staging_arena())

    _staging: Optional[PoolStaging] = None  # the verify forward's, while it runs

    def _verify_forward_with(self, staging: PoolStaging) -> None:
        """Point the verifying requests' rows at their staged slots and hand the staging
        to the attention backend (before the forward builds its metadata)."""
        staging.point()
        self._staging = staging
        self.model_runner.attn_backend.staging = staging

    def _verify_forward_done(self) -> None:
        staging, self._staging = self._staging, None
        self.model_runner.attn_backend.staging = None
        if staging is not None:
            staging.restore()

    def _restore_full_kv(self, entries) -> None:
        """A staged reload failed every retry (called from the verify forward, before the
        failed layer is attended): the slower correct path. Each request's full KV goes
        from the host store back into device slots and its compressed index is dropped,
        so it verifies -- from this layer on -- and decodes from its full device KV, like a
        request the host store never admitted. Its output stays the full-KV output."""
        for entry in entries.values():
            if self._staging is not None and self._staging.adopt(entry, self._full_rows):
                pass  # its staged slots now hold its full KV for good
            elif not self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, *self._full_rows(entry)):
                # both the host path and the pool failed: nothing correct is left to serve
                raise RuntimeError(f"VERICACHE: the reload of request {entry.rid} failed and the "
                                   "KV pool has no free slots to restore its full KV")
            self.host.drop(entry.rid)
            logger.warning("VERICACHE: reload of request %s failed every retry; it decodes from its "
                           "full KV, restored on the device", entry.rid)
            stats.add("vericache", reload_fallbacks=1, fallbacks=1)

    def _full_rows(self, entry, span_slots: Optional[torch.Tensor] = None) -> tuple[dict, dict]:
        """The full KV of the entry's span per layer: the host rows, merged with the kept
        rows still in the pool where the host holds only the dropped ones (``span_slots``:
        the request's own slots of ``[p, n)``; by default its row's)."""
        pool = self.runtime.kv_pool
        entry.wait()  # its copies to the host have landed
        if span_slots is None:
            span_slots = self.req_to_token_pool.req_to_token[entry.req_pool_idx, entry.p : entry.n]
        span_slots = span_slots.to(torch.int64)
        k, v = {}, {}
        for layer_id in entry.k:
            k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            k[layer_id], v[layer_id] = entry.span(layer_id).to(k_buf.device).full(k_buf, v_buf, span_slots.to(k_buf.device))
        return k, v

