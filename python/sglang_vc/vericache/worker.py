"""The VERICACHE speculative worker (SGLang spec-V2 schema, synchronous).

Two schedules (``--vc-schedule``). **staggered** (the default, VeriCache §4.2 and §5.2,
:mod:`.staggered_schedule`): at each iteration every speculating request drafts one token from
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

import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
from sglang.srt.mem_cache.common import evict_from_tree_cache

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream, get_runtime
from sglang_vc.kvruntime import writes
from sglang_vc.kvruntime.scheduler_side import SchedulerSide
from sglang_vc.overlap import relay, widen
from sglang_vc.spec_worker import ChainSpecWorker

from . import flags
from .draft_length import DraftLength
from .names import DEFAULT_DRAFT_TOKENS, META_INFO_KEY
from .reload import HostKVStore, measure_bandwidth
from .staging import AheadSlots, VerifyHeadroom
from .policy import Decision, Mode, ModePolicy
from .restore import FullKVRestore
from .lockstep import LockstepRound
from .overlapped import LaggedTimer, Overlap, full_only_iteration, overlap_of
from .staggered_round import StaggeredRound
from .view_rows import SharedSelections, ViewRows
from .worker_spec import draft_tokens_of

logger = logging.getLogger(__name__)


def shared_by(prompt, waiting: list) -> int:
    """How many waiting prompts share at least half of ``prompt`` as a prefix (they would
    reuse its rows from the radix tree, which a compressed request's never enter)."""
    half = max(1, len(prompt) // 2)
    head = list(prompt[:half])
    return sum(1 for w in waiting if len(w) >= half and list(w[:half]) == head)


# ----------------------------------------------------------------------------- worker


class VeriCacheWorker(ChainSpecWorker):
    """SGLang's spec worker for VERICACHE: its schedule's iteration (``staggered`` or
    ``lockstep``, composed), the host store, the mode policy and per-request bookkeeping."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        from sglang.srt.runtime_context import get_device, get_spec

        num_drafts = draft_tokens_of(get_spec())  # SGLang's count is the verify width X + 1
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
        self.copy_stream = CopyStream(self.device)  # the copy thread's own stream on an accelerator
        self.copy_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-reload",
                                              initializer=self.copy_stream.bind_thread)
        # the prompt's full KV moves to the host on the same stream its reloads use
        host_bytes = flags.host_kv_bytes(settings)
        self.host = HostKVStore(host_bytes, copy_stream=self.copy_stream)
        logger.info("VERICACHE host store for the full KV compression replaces: %.1f GiB (%s)", host_bytes / 2**30,
                    "--vc-host-kv-gb" if settings and settings.get("host_kv_gb") is not None
                    else f"{flags.DEFAULT_HOST_FRACTION:.0%} of the machine's memory; --vc-host-kv-gb sets it")
        self.per_request: dict[str, dict] = {}
        self._prefill_prompts: dict = {}  # rid -> prompt of the prefill forward running now
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
        self.in_pool_verify = flags.in_pool_verify(settings)
        forced = {flags.InPool.ALWAYS: Mode.IN_POOL, flags.InPool.NEVER: Mode.FULL}.get(in_pool)
        self.policy = ModePolicy(self.budget.rows, num_drafts, self.draft_length.fixed, forced,
                                 default_x=self.draft_length.default)
        self.modes: dict[str, Decision] = {}  # rid -> the mode of its current cycle
        self._runtime = None
        self.headroom: Optional[VerifyHeadroom] = None  # set with the runtime
        # the iteration of its schedule (plan -> forward -> commit)
        self.staggered = StaggeredRound(self) if schedule is flags.Schedule.STAGGERED else None
        self.lockstep = LockstepRound(self) if schedule is flags.Schedule.LOCKSTEP else None
        # the re-selected per-head view's positions, rid -> [layers, Hkv, K], from its last
        # verify (the attention backend writes them through the forward's plan)
        self.selections: dict = {}
        self._bandwidth: Optional[float] = None
        # SGLang's overlap scheduler (:mod:`.overlapped`): how the next decode forward runs
        # under it; the requests whose last decode forward committed nothing
        self._overlapped = Overlap.SYNC
        self.sync_check_s = 0.0  # the last needs_sync call's host time
        self.commits_nothing: set[str] = set()
        self.overlap_timer = LaggedTimer(self.device)
        if schedule is flags.Schedule.STAGGERED:
            # the link is measured once, here rather than in the first decode iteration (the
            # schedule itself is built then: its HBM budget needs the runtime's staging share)
            self._bandwidth = measure_bandwidth(self.device)

    _view_rows: Optional[ViewRows] = None
    _shared_selections: Optional[SharedSelections] = None

    @property
    def shared_selections(self) -> SharedSelections:
        """The shared view's selections, scored by the attention backend in verifies
        (through the forward's plan)."""
        if self._shared_selections is None:
            self._shared_selections = SharedSelections()
        return self._shared_selections

    @property
    def view_rows(self) -> ViewRows:
        """In-pool drafters' view rows of SGLang's ``req_to_token`` (:mod:`.view_rows`)."""
        if self._view_rows is None:
            self._view_rows = ViewRows(self.req_to_token_pool)
        return self._view_rows

    @property
    def runtime(self):
        if self._runtime is None:
            self._runtime = get_runtime(self.model_runner)
            self._runtime.full_kv_sink = self.host.sink
            self._runtime.payload_tail_headroom = 0.0  # its rows stay full: no decode tail is quantized
            self._runtime.full_kv_admit = self._admit_host
            self._runtime.full_kv_kept = self.host.kept
            self.headroom = VerifyHeadroom(self._runtime.allocator,
                                           lambda n: evict_from_tree_cache(self._runtime.tree_cache, n))
            # what SGLang's scheduler asks of this worker (through hooks.py), once
            self._runtime.side = SchedulerSide(
                # SGLang allocates what a staggered iteration writes
                slots_ahead=self.staggered.slots_ahead if self.staggered is not None else None,
                held_back=self.headroom,
                compress_gate=self._full_kv_while_memory_free
                if self.compress_when is flags.CompressWhen.MEMORY_BINDS else None,
                full_kv_for_tree=self._full_kv_for_tree, lossless=True)
            self._runtime.release_listeners.append(self._released)
            self._runtime.host_store = self.host
            self._install_specache_drafter(self._runtime)
            # a reload that fails every retry restores its requests' full KV (:mod:`.restore`)
            self.restore = FullKVRestore(self.host, self._runtime, self.req_to_token_pool.req_to_token)
            writes.watch(type(self.model_runner.attn_backend))  # (SGLANG_VC_WATCH_WRITES)
            self._runtime.reload_ahead = self._ahead_slots()  # (its counts in /server_info)
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

    def _released(self, rid: str) -> None:
        """SGLang released the request (finished, aborted or retracted): its host entry,
        its reload in flight (and the pool slots it lands in) and its place in the
        schedule go now, not at the next forward (a batch that empties has none)."""
        self.host.drop(rid)
        if self.staggered is not None:
            self.staggered.forget(rid)
        self.modes.pop(rid, None)
        self.policy.forget(rid)
        self.commits_nothing.discard(rid)

    def _full_kv_for_tree(self, req, up_to: int):
        """A compressed request finished: its full KV (the host copy of its compressed span,
        the exact KV of its committed tokens in its row) goes back into its row, so the radix
        tree keeps it as a plain server keeps a finished request's; the next request with
        this prefix reuses it. Pool slots come from free ones, else from evicting the tree's
        least recently used nodes, as a plain server's allocation would. Where there are
        none (the running requests hold the pool), a host copy of its own rows below
        ``up_to`` (:class:`~sglang_vc.kvruntime.held_rows.HeldRows`), which the tree takes
        after a release; False where there is nothing to keep."""
        row = req.kv.req_pool_idx
        entry = self.host.get(req.rid, row)
        if entry is None or not entry.num_tokens or self.runtime.entry_for_row(row) is None:
            return False
        k, v = self.restore.full_rows(entry)
        runtime = self.runtime
        if not runtime.restore_full_kv(row, entry.p, k, v):
            evict_from_tree_cache(runtime.tree_cache, entry.num_tokens)
            if not runtime.restore_full_kv(row, entry.p, k, v):
                held = self.restore.held_rows(entry, req.kv.cache_protected_len, up_to, k, v)
                if held is None:
                    stats.add("vericache", finished_kv_not_kept=1)
                    return False
                return held
        self.host.drop(req.rid)
        stats.add("vericache", finished_kv_kept=1, finished_kv_kept_tokens=entry.num_tokens)
        return True

    def _full_kv_while_memory_free(self, rid: str, own_rows: int, spec) -> Optional[str]:
        """``--vc-compress-when memory-binds``: whether a request whose prefill just ended
        is compressed (offload; None) or keeps its full KV (the reason). It keeps it where
        the pool still has room for the waiting requests' prompts (memory does not bind the
        batch: it decodes full KV or drafts in place, by the mode policy) and, under the
        staggered schedule, where offloading does not pay by the mode policy's fitted costs
        (:meth:`.policy.ModePolicy.offload`); the waiting requests then wait, as on a plain
        server."""
        runtime = self.runtime
        queue = runtime.side.waiting
        room, waiting = runtime.free_room(), queue.demand
        prompt = self._prefill_prompts.get(rid)
        if prompt is not None and (sharing := shared_by(prompt, queue.prompts)):
            # compressed, its KV would not enter the tree: they would compute it again
            stats.add("vericache", full_kv_shared_prefix=1)
            return (f"{sharing} waiting request(s) share at least half of its prompt: the radix tree serves them "
                    "from its full KV")
        if room >= waiting:
            stats.add("vericache", full_kv_memory_free=1)
            return (f"the KV pool has room for its full KV ({room} free rows >= {waiting} waiting; "
                    "--vc-compress-when)")
        if self.schedule is not flags.Schedule.STAGGERED:
            return None
        kept = spec.rows_kept(own_rows) if spec.scenario == "token_dropping" else 0
        per_waiting = waiting / max(1, queue.requests)
        # waiting requests the freed rows hold, as a fraction: compressing several requests
        # admits whole ones (appendix B.1's batch grows with the compressed footprint)
        admitted = min(queue.requests, max(0, room + own_rows - kept) / max(1, per_waiting))
        # compressed already, or chosen for it earlier in this prefill forward
        offloaded = len(runtime.compressed_rids() | {r for r, d in self.modes.items() if d.mode is Mode.OFFLOAD})
        held = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        reload_s = own_rows * runtime.bytes_per_slot / (self._bandwidth or measure_bandwidth(self.device))
        decision = self.policy.offload(own_rows, max(1, held - offloaded), offloaded, admitted,
                                       self.draft_length.curves[spec.compressor], reload_s,
                                       self._draft_probe(spec, own_rows))
        if decision.mode is Mode.OFFLOAD:
            self.modes[rid] = decision
            stats.add("vericache", offload_chosen=1)
            return None
        stats.add("vericache", offload_declined=1)
        return decision.reason

    def _draft_probe(self, spec, length: int) -> Optional[tuple[float, float]]:
        """Seconds a full-KV request of about ``length`` tokens spends in attention per
        iteration, and a SpeCache draft step of it, on this machine (:mod:`.draft_probe`,
        every layer; timed once per power of two), where the drafter's step is its torch
        path; None elsewhere (the policy then offloads one request to measure it)."""
        import sgl_kernel_ext as ext

        from .draft_probe import step_seconds

        k_buf = self.runtime.kv_pool.get_key_buffer(self.runtime.start_layer)
        if spec.compressor != "specache" or ext.backend_for(k_buf) is ext.Backend.TRITON or length < 256:
            return None
        n = 1 << (length.bit_length() - 1)
        q_heads = self.model_runner.model_config.num_attention_heads // max(1, self.server_args.tp_size)
        full_s, draft_s = step_seconds(n, q_heads, k_buf.shape[1], k_buf.shape[2], self.drafter.topk,
                                       spec.bits or 2, k_buf.dtype)
        layers = self.runtime.kv_pool.layer_num
        return full_s * layers * length / n, draft_s * layers * length / n

    def _admit_host(self, rid: str, req_pool_idx: int, p: int, n: int) -> bool:
        ok = self.host.admit(rid, req_pool_idx, p, n, (n - p) * self.runtime.bytes_per_slot)
        if not ok:
            stats.add("vericache", fallbacks=1, host_store_full=1)
        else:
            self.host.ensure_copy_buffer(self.device)  # the first compressed request: its buffer now
        return ok

    # ------------------------------------------------------------------ entry point

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None, grammar_barrier=None):
        runtime = self.runtime  # installs the host sink before the first prefill
        for req in batch.reqs:
            self.drafter.set_request(req.rid, getattr(req.sampling_params, "custom_params", None))
        if batch.forward_mode.is_decode():
            self.settle()  # (a drafting iteration SGLang overlapped: before this forward's plan)
        kind, self._overlapped = self._overlapped, Overlap.SYNC
        overlapped = kind is Overlap.FULL_ONLY
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            try:
                if kind is Overlap.DRAFTING:
                    result = self.staggered.run(batch, deferred=True)
                else:
                    result = (full_only_iteration(self, batch, grammar_barrier) if overlapped
                              else self._decode_running(batch))
            except Exception as exc:  # a fault of this batch's forward ends its requests, not the server
                logger.exception("VERICACHE: a decode iteration failed; its %d requests end with an error",
                                 len(batch.reqs))
                for req in batch.reqs:
                    self._fail(req, f"its decode iteration failed ({type(exc).__name__}: {exc})")
                result = self.result(batch, torch.zeros(len(batch.reqs), self.stride, dtype=torch.int64),
                                     torch.zeros(len(batch.reqs), dtype=torch.int64))
            writes.seal()  # start-up is over: what is written from here on is per forward
            for req in batch.reqs:  # read back in order as SGLang processes each result (hooks.py)
                if overlapped:
                    req.vc_verified = False
                if not hasattr(req, "vc_verify_log"):
                    req.vc_verify_log = collections.deque()
                req.vc_verify_log.append(getattr(req, "vc_verified", None))
        else:
            self._prefill_prompts = {req.rid: req.origin_input_ids for req in batch.reqs}  # (the compress gate's)
            result = self.prefill_result(batch, pp_proxy_tensors)
            self._prefill_prompts = {}
            self.host.flush()  # what no compressor selected moves to the host whole
        if overlapped or not batch.forward_mode.is_decode():
            self.commits_nothing.difference_update(r.rid for r in batch.reqs)
        relay(result, batch, on_publish)  # the overlap scheduler's (sglang_vc.overlap)
        self.host.retain(runtime.compressed_rids())
        # pool room for the verify of the longest compressed span (eq. 5: the device budget
        # counts a verifier's full KV), held back from SGLang's admission -- but not the
        # slots SGLang tops every running request up with at its next decode (after a
        # prefill the running batch decodes next, not only this batch; one slot each under
        # the staggered schedule, :mod:`.decode_slots`), unless a verify has waited too long
        rows_held = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        per_decode = 1 if runtime.side.slots_ahead is not None else get_alloc_reserve_per_decode()
        self.headroom.fit(max((e.num_tokens for e in self.host.entries.values()), default=0),
                          keep_free=max(rows_held, len(batch.reqs)) * per_decode,
                          stalled=self.staggered.stalled_verifies if self.staggered is not None else 0)
        live = {r.rid for r in batch.reqs} | set(runtime.plans)
        for rid in [r for r in self.per_request if r not in live]:
            del self.per_request[rid]
        for rid in [r for r in self.modes if r not in live]:
            del self.modes[rid]
        for rid in [r for r in self.selections if r not in live]:
            del self.selections[rid]
        self.shared_selections.forget(live)
        self.drafter.forget(live)
        self.draft_length.forget(live)
        return result

    def needs_sync(self, batch) -> bool:
        """Whether decode ``batch`` runs synchronously under SGLang's overlap scheduler
        (:mod:`.overlapped`); asked once per iteration by the scheduler hook, before the
        batch launches: the drafting iteration launched before it settles first."""
        self.settle()
        started = time.perf_counter()
        self._overlapped = overlap_of(self, batch)
        self.sync_check_s = time.perf_counter() - started  # host work, in the overlapped trace
        sync = self._overlapped is Overlap.SYNC
        stats.add("vericache", **{"overlap_synced" if sync else "overlap_async": 1})
        return sync

    def settle(self, result=None) -> None:
        """The bookkeeping of the drafting iteration SGLang overlapped (:mod:`.deferred`),
        once its tokens are on the host; called before anything reads it: the next
        decode's ``needs_sync`` or forward, or SGLang's processing of ``result`` where
        that is the iteration's own (the result of an earlier one is processed while it
        runs). A fault ends that iteration's requests, not the server."""
        round_ = self.staggered
        if round_ is None or round_.launched is None or (result is not None and result is not round_.launched.result):
            return
        reqs = round_.launched.it.reqs
        try:
            round_.settle()
        except Exception as exc:
            logger.exception("VERICACHE: an overlapped iteration failed to settle; its %d requests end with "
                             "an error", len(reqs))
            for req in reqs:
                self._fail(req, f"its decode iteration failed ({type(exc).__name__}: {exc})")

    def _decode_running(self, batch):
        """The decode iteration of the batch's requests still running: under the overlap
        scheduler a synchronous iteration processed the previous result after the batch
        was built, and the requests it finished are released (:mod:`sglang_vc.overlap`)."""
        live = [i for i, r in enumerate(batch.reqs) if not (r.finished() or r.kv.req_pool_idx is None)]
        if len(live) == len(batch.reqs):
            return self._decode(batch)
        stats.add("vericache", finished_in_batch=len(batch.reqs) - len(live))
        if not live:
            return self.result(batch, torch.zeros(len(batch.reqs), self.stride, dtype=torch.int64),
                               torch.zeros(len(batch.reqs), dtype=torch.int64))
        return widen(self._decode(self.sub_batch(batch, live)), live, batch)

    def _decode(self, batch):
        return (self.staggered or self.lockstep).run(batch)

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

    def _staging_budget(self) -> int:
        """The HBM ring's capacity: the pool slots reloads started ahead of their verify may
        hold at once, ``--vc-staging-fraction`` of the pool's bytes. A cap, not a
        reservation: the slots are taken from SGLang's allocator when a reload starts
        (:class:`.staging.AheadSlots`). (The verify forward itself takes ``n - p`` pool
        slots per verifier, with the verify headroom held back for them: :mod:`.staging`.)"""
        pool_slots = self.runtime.kv_pool.get_key_buffer(self.runtime.start_layer).shape[0]
        return int(flags.staging_fraction(flags.settings_of(self.server_args)) * self.runtime.bytes_per_slot
                   * pool_slots)

    _ahead: Optional[AheadSlots] = None

    def _ahead_slots(self) -> AheadSlots:
        if self._ahead is None:
            stream = self.copy_stream
            join = (lambda: stream.wait(stream.stream.record_event(), ())) if stream.stream is not None else \
                (lambda: None)
            self._ahead = AheadSlots(self.runtime.allocator, self.runtime.bytes_per_slot, self._staging_budget(),
                                     join)
        return self._ahead

    def _layer_ids(self) -> list[int]:
        kv_pool = self.runtime.kv_pool
        return list(range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num))

    def _fail(self, req, message: str) -> None:
        """One request's fault ends that request, not the server: it finishes with an
        error reply (HTTP 500 and the message; nothing after the fault is committed), its
        host entry and its schedule are released, and the batch goes on."""
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        logger.error("VERICACHE: request %s fails: %s", req.rid, message)
        req.to_finish = FINISH_ABORT(f"VERICACHE: {message}", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        stats.add("vericache", request_faults=1)
        self.host.drop(req.rid)
        if self.staggered is not None:
            self.staggered.forget(req.rid)
