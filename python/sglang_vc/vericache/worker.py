"""The VERICACHE speculative worker (SGLang spec-V2 schema, synchronous).

Two schedules (``--vc-schedule``). **staggered** (the default, VeriCache §4.2 and §5.2,
:mod:`.staggered`): at each iteration every speculating request drafts one token from
its compressed KV, while the few whose verify ADMIT reserved for this iteration verify
their drafts against the full KV instead; reloads start at their reserved window and
stage the whole request over the drafting iterations in between. **lockstep** (the
comparison mode) runs one round per iteration for the whole batch, described below.

One lock-step decode round of a batch (``L`` = committed KV length of a request, ``t0`` =
its last output token, whose KV is not computed yet):

1. **Draft** ``X`` tokens greedily with ``X`` decode forwards of the target model whose
   attention reads the request's *compressed* KV (the compressed-KV runtime's
   :class:`~sglang_vc.kvruntime.CompressedKVIndex`: compressed prompt rows ++ the full
   KV of tokens committed since). Draft KV goes to the request's reserved slots
   ``row[L .. L+X-1]``.
2. **Reload**: the full prompt KV the compression replaced, kept in a host store since
   the prefill (:class:`~.reload.HostKVStore`), is staged layer by layer on a copy
   thread (:class:`~.reload.LayerwiseReload`), started before drafting so that it
   overlaps the draft forwards and then each verify layer.
3. **Verify** ``[t0, d1 .. dX]`` at positions ``L .. L+X`` in ONE ``TARGET_VERIFY``
   forward with a causal chain mask over the full KV (:class:`VeriCacheAttnBackend`
   reads row positions ``[p, n)`` from the staged layer, the rest from the pool);
   its KV overwrites the draft KV in ``row[L .. L+X]`` (the committed tokens' KV is thus
   full-KV, and serves both the drafter, as tail rows after the compressed prefix, and
   later verifies).
4. **Accept** (core :func:`~sglang_vc.vericache.sampling.greedy_verify_ids`): the
   matching prefix ``d1..da`` plus the verifier's correction, or all ``X`` plus the
   bonus token.

Greedy requests get exactly the full-KV tokens: every committed token is the full-KV
argmax given committed tokens only. A sampling request commits drafts while they equal
the verifier's own sample at that position (a lossless rule: each committed token is a
sample of the full-KV distribution), then that sample. The verifier applies a request's
``logit_bias``, temperature, top-k, top-p, min-p and (deterministic inference) seed as
SGLang's sampler does; what it cannot apply exactly (penalties, grammars, logprobs) is
refused with HTTP 400 (:mod:`.requests`).

Fallbacks: a request whose full KV does not fit the host store (``--vc-host-kv-gb``) is
not compressed and decodes from its full device KV; a failed staged copy is retried
synchronously, and a copy that fails every retry restores the request's full KV on the
device from the host store (``reload_fallbacks``), from which it verifies and decodes.

A token-dropping drafter's verify reloads only the dropped rows (:class:`.reload.Span`).

Not built: logprobs of speculative tokens, penalties and grammar-constrained requests
(refused); one fused forward per staggered iteration (drafts and verifies run as two).
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vc import stats
from sglang_vc.kvruntime import get_runtime

from . import flags
from .names import META_INFO_KEY
from .reload import HostKVStore, LayerwiseReload, measure_bandwidth
from .sampling import greedy_verify_ids
from .scheduler import ReloadScheduler
from .staggered import Outcome, Role, StaggeredSchedule

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- worker


class VeriCacheWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        from sglang.srt.runtime_context import get_device, get_spec

        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.num_drafts: int = int(get_spec().speculative_num_draft_tokens)
        self.width = self.num_drafts + 1  # verify tokens per request: t0 + X drafts
        self.device = get_device().device
        from sglang_vc.config import get_vc_config

        settings = get_vc_config(server_args).group(flags.GROUP)
        self.host = HostKVStore(flags.host_kv_bytes(settings))
        self.schedule = flags.schedule(settings)
        # staggered: a request drafts up to 2X - 1 tokens between verifies (ADMIT searches
        # X-1, X+1, ...), all inside the 2X slots SGLang reserves past its committed length
        self.window = 2 * self.num_drafts
        self.stride = self.width if self.schedule is flags.Schedule.LOCKSTEP else self.window
        self.trace_path = flags.trace_path(settings)
        self.copy_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-reload")
        self.per_request: dict[str, dict] = {}
        self._runtime = None
        self._staggered: Optional[StaggeredSchedule] = None

    # ------------------------------------------------------------------ SGLang plumbing

    @property
    def draft_worker(self):
        return None  # the drafter is the target model on the compressed KV

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        pass

    @property
    def runtime(self):
        if self._runtime is None:
            self._runtime = get_runtime(self.model_runner)
            self._runtime.full_kv_sink = self.host.sink
            self._runtime.full_kv_admit = self._admit_host
            self._runtime.full_kv_kept = self.host.kept
        return self._runtime

    def _admit_host(self, rid: str, req_pool_idx: int, p: int, n: int) -> bool:
        ok = self.host.admit(rid, req_pool_idx, p, n, (n - p) * self.runtime.bytes_per_slot)
        if not ok:
            stats.add("vericache", fallbacks=1, host_store_full=1)
        return ok

    # ------------------------------------------------------------------ entry point

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        from sglang.srt.managers.utils import GenerationBatchResult

        runtime = self.runtime  # installs the host sink before the first prefill
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            if self.schedule is flags.Schedule.STAGGERED:
                result = self._staggered_round(batch)
            else:
                result = self._decode_round(batch)
        else:
            res = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
            predict = res.next_token_ids
            bs = len(batch.reqs)
            accept_tokens = torch.zeros(bs, self.stride, dtype=torch.int32, device=predict.device)
            if bs:
                accept_tokens[:, 0] = predict
            accept_lens = torch.ones(bs, dtype=torch.int32, device=predict.device)
            result = GenerationBatchResult(
                logits_output=res.logits_output,
                next_token_ids=predict,
                can_run_cuda_graph=res.can_run_cuda_graph,
                accept_lens=accept_lens,
                new_seq_lens=batch.seq_lens,
                next_draft_input=self._draft_input(batch.seq_lens.clone(), accept_tokens.flatten(), accept_lens),
                speculative_num_draft_tokens=self.stride,
                speculative_output_stride=self.stride,
            )
        self.host.retain(runtime.compressed_rids())
        live = {r.rid for r in batch.reqs} | set(runtime.plans)
        for rid in [r for r in self.per_request if r not in live]:
            del self.per_request[rid]
        return result

    def _draft_input(self, new_seq_lens, accept_tokens, accept_lens):
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        # SGLang's chain/tree verify input carries the per-request accept state between
        # rounds (filter/merge on batch changes); VeriCache keeps nothing else there.
        return NgramVerifyInput(draft_token_num=self.stride, new_seq_lens=new_seq_lens,
                                accept_tokens=accept_tokens, accept_lens=accept_lens)

    # ------------------------------------------------------------------ one round

    @torch.inference_mode()
    def _decode_round(self, batch):
        from sglang.srt.managers.utils import GenerationBatchResult

        bs, x, w = len(batch.reqs), self.num_drafts, self.width
        dev = batch.seq_lens.device
        seq_dtype = batch.seq_lens.dtype
        committed = batch.seq_lens.to("cpu", torch.int64)  # L per request
        rows = batch.req_pool_indices.to("cpu", torch.int64)
        req_to_token = self.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(w)[None, :]  # [bs, W]
        slots = req_to_token[rows[:, None].to(req_to_token.device), positions.to(req_to_token.device)].to(torch.int64)
        t0 = torch.tensor([req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                           for req in batch.reqs], dtype=torch.int64)

        # The committed tokens' rows must stay full KV (the verifier reads them): a lossy
        # decode-time step that would rewrite or free them (e.g. KIVI tail streaming) must
        # skip entries carrying this mark.
        for row in rows.tolist():
            entry = self.runtime.entry_for_row(row)
            if entry is not None:
                entry.keep_full_rows = True

        # 2. (started first, so that it overlaps drafting) stage the full KV of the
        # compressed requests, layer by layer, for the verify forward
        reload = self._start_reload(batch, rows)

        # 1. draft X tokens greedily from the compressed KV
        attn = self.model_runner.attn_backend
        info = batch.sampling_info
        bias = None if info is None else info.logit_bias  # drafts honour it too: fewer rejections
        try:
            drafts = torch.empty(bs, x, dtype=torch.int64)
            cur = t0
            for j in range(x):
                lens = committed + j + 1
                self._set_batch(batch, ForwardMode.DECODE, cur, lens, slots[:, j], None, seq_dtype, dev)
                res = self.target_worker.forward_batch_generation(batch, is_verify=True)
                draft_logits = res.logits_output.next_token_logits
                if bias is not None:
                    draft_logits = draft_logits.float() + bias[:, : draft_logits.shape[-1]].to(draft_logits.device)
                cur = draft_logits.argmax(-1).to("cpu", torch.int64)
                drafts[:, j] = cur

            # 3. verify t0 + drafts in one forward over the full KV
            verify_ids = torch.cat([t0[:, None], drafts], dim=1)  # [bs, W]
            spec_info = self._verify_input(verify_ids, positions, committed, dev)
            self._set_batch(batch, ForwardMode.TARGET_VERIFY, verify_ids.flatten(), committed,
                            slots.flatten(), spec_info, seq_dtype, dev)
            attn.reload = reload
            res = self.target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            attn.reload = None
            if reload is not None:
                reload.close()
        reloaded = reload.nbytes() if reload is not None else 0
        if reload is not None and reload.failures:
            stats.add("vericache", reload_failures=reload.failures)
        logits = res.logits_output.next_token_logits.view(bs, w, -1)

        # 4. accept
        targets = self._targets(logits, batch, positions).to("cpu", torch.int64)
        verdict = greedy_verify_ids(drafts, targets, pad_id=0)
        accepted = verdict.num_accepted  # [bs]
        accept_lens = verdict.num_tokens.to(torch.int32)
        accept_tokens = verdict.tokens.to(torch.int32)  # [bs, W]
        new_seq_lens = (committed + accept_lens).to(device=dev, dtype=seq_dtype)

        n_acc = int(accepted.sum())
        stats.add("vericache", verify_rounds=bs, drafted=bs * x, accepted=n_acc,
                  committed=n_acc + bs, bytes_reloaded=reloaded)
        for i, req in enumerate(batch.reqs):
            self._record(req, x, int(accepted[i]), int(accept_lens[i]))

        accept_tokens_dev = accept_tokens.to(dev).flatten()
        accept_lens_dev = accept_lens.to(dev)
        return GenerationBatchResult(
            logits_output=res.logits_output,
            next_token_ids=accept_tokens_dev,
            can_run_cuda_graph=False,
            accept_lens=accept_lens_dev,
            new_seq_lens=new_seq_lens,
            next_draft_input=self._draft_input(new_seq_lens, accept_tokens_dev, accept_lens_dev),
            speculative_num_draft_tokens=w,
            speculative_output_stride=w,
        )

    def _record(self, req, drafted: int, accepted: int, committed: int) -> None:
        """Per-request verify counters, returned in the request's ``meta_info``."""
        info = self.per_request.setdefault(req.rid, {"verify_rounds": 0, "drafted": 0, "accepted": 0,
                                                    "committed": 0, "draft_tokens": self.num_drafts})
        info["verify_rounds"] += 1
        info["drafted"] += drafted
        info["accepted"] += accepted
        info["committed"] += committed
        info["mean_acceptance_length"] = info["committed"] / info["verify_rounds"]
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [info]

    # ------------------------------------------------------------------ staggered

    def _schedule(self) -> StaggeredSchedule:
        if self._staggered is None:
            bandwidth = measure_bandwidth(self.device)
            staging = self._staging_budget()
            sched = ReloadScheduler(window=self.window, iter_time=0.05, bandwidth=bandwidth,
                                    hbm_bytes=staging, fallback_after=self.window)
            self._staggered = StaggeredSchedule(sched, self.num_drafts, trace_path=self.trace_path)
            logger.info("VERICACHE staggered schedule: window %d iterations, anchor X=%d, link %.2f GB/s "
                        "(measured), staging budget %.1f MB", self.window, self.num_drafts,
                        bandwidth / 1e9, staging / 1e6)
        return self._staggered

    def _staging_budget(self) -> int:
        """The HBM ring's capacity: staged reloads are tensors outside SGLang's KV pool
        (which already holds its share of the device), so they may use half of the
        device memory free when the schedule starts -- after the weights and the pool
        took theirs; the other half is left to activations."""
        dev = torch.device(self.device)
        mem_get_info = getattr(getattr(torch, dev.type, None), "mem_get_info", None)
        if dev.type != "cpu" and mem_get_info is not None:
            free = mem_get_info(dev)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        return int(free // 2)

    def _reload_bytes(self, rid: str, row: int) -> Optional[int]:
        """Bytes a verify of this request reloads; None if its KV is not compressed (it
        decodes from its full device KV)."""
        entry = self.host.get(rid, row)
        if entry is None or not entry.num_tokens or self.runtime.entry_for_row(row) is None:
            return None
        return entry.nbytes()

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
                               on_failure=self._restore_full_kv)

    @torch.inference_mode()
    def _staggered_round(self, batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        started = time.perf_counter()
        sched = self._schedule()
        bs, dev = len(batch.reqs), batch.seq_lens.device
        committed = batch.seq_lens.to("cpu", torch.int64)
        rows = batch.req_pool_indices.to("cpu", torch.int64)
        req_to_token = self.req_to_token_pool.req_to_token
        t0 = [req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1] for req in batch.reqs]
        for row in rows.tolist():
            entry = self.runtime.entry_for_row(row)
            if entry is not None:
                entry.keep_full_rows = True  # see _decode_round

        plan = sched.plan([r.rid for r in batch.reqs], rows.tolist(), committed.tolist(),
                          lambda i: self._reload_bytes(batch.reqs[i].rid, int(rows[i])))
        for slot in plan.reloads_due:
            slot.track.reload = self._reload_one(slot.track)
            slot.track.reload_started_at = plan.iteration
        full = []
        for slot in plan.of(Role.FULL):
            if slot.track.full or self._fall_back(slot.track):
                full.append(slot)
        drafters = plan.of(Role.DRAFT)
        verifiers = plan.of(Role.VERIFY)

        phases = {"plan_s": time.perf_counter() - started}
        accept_tokens = torch.zeros(bs, self.stride, dtype=torch.int64)
        accept_lens = torch.zeros(bs, dtype=torch.int64)
        outcome: dict[str, Outcome] = {}
        reloaded: dict[str, int] = {}

        # 1. one decode forward: a draft token for the speculating requests, the next
        # (exact) token for those decoding from their full device KV
        one = drafters + full
        mark = time.perf_counter()
        if one:
            idx = [s.index for s in one]
            tokens = torch.tensor([s.track.drafts[-1] if s.track.drafts else t0[s.index] for s in one])
            pos = torch.tensor([s.track.committed + len(s.track.drafts) for s in one])
            slots = req_to_token[rows[idx].to(req_to_token.device), pos.to(req_to_token.device)]
            sub = self._sub_batch(batch, idx)
            logits = self._forward(sub, ForwardMode.DECODE, tokens, pos + 1, slots, None)
            bias = None if sub.sampling_info is None else sub.sampling_info.logit_bias
            biased = logits.float() if bias is None else logits.float() + bias[:, : logits.shape[-1]].to(logits.device)
            draft_ids = biased.argmax(-1).to("cpu", torch.int64)
            exact = self._targets(logits[:, None, :], sub, pos[:, None]).to("cpu", torch.int64)[:, 0] if full else None
            for k, s in enumerate(one):
                if s.role is Role.DRAFT:
                    s.track.drafts.append(int(draft_ids[k]))
                else:
                    accept_tokens[s.index, 0] = exact[k]
                    accept_lens[s.index] = 1
                    sched.verified(s.track, 1)
                    outcome[s.track.rid] = Outcome(drafts=0, tokens=1)

        phases["draft_s"] = time.perf_counter() - mark
        mark = time.perf_counter()

        # 2. one verify forward (TARGET_VERIFY over the full KV) for the requests whose
        # reserved verify is this iteration; shorter draft runs are padded (causal mask)
        if verifiers:
            idx = [s.index for s in verifiers]
            lens = torch.tensor([len(s.track.drafts) for s in verifiers])
            w = int(lens.max()) + 1
            drafts = torch.full((len(verifiers), w - 1), -1, dtype=torch.int64)
            for k, s in enumerate(verifiers):
                drafts[k, : len(s.track.drafts)] = torch.tensor(s.track.drafts, dtype=torch.int64)
            ids = torch.cat([torch.tensor([t0[i] for i in idx])[:, None], drafts.clamp(min=0)], 1)
            base = torch.tensor([s.track.committed for s in verifiers])
            positions = base[:, None] + torch.arange(w)[None, :]
            slots = req_to_token[rows[idx][:, None].to(req_to_token.device), positions.to(req_to_token.device)]
            reloads = {}
            for k, s in enumerate(verifiers):
                if s.track.reload is None and self.runtime.entry_for_row(s.track.row) is not None:
                    s.track.reload = self._reload_one(s.track)  # not started on time: now
                    s.track.reload_started_at = plan.iteration
                if s.track.reload is not None:
                    reloads[k] = s.track.reload
            staging = _Staging(reloads) if reloads else None
            sub = self._sub_batch(batch, idx)
            attn = self.model_runner.attn_backend
            try:
                attn.reload = staging
                logits = self._forward(sub, ForwardMode.TARGET_VERIFY, ids.flatten(), base,
                                       slots.flatten(), self._verify_input(ids, positions, base, dev))
            finally:
                attn.reload = None
                for r in reloads.values():
                    r.close()
            targets = self._targets(logits.view(len(idx), w, -1), sub, positions).to("cpu", torch.int64)
            verdict = greedy_verify_ids(drafts, targets, draft_lens=lens, pad_id=0)
            failures = 0
            for k, s in enumerate(verifiers):
                n = int(verdict.num_tokens[k])
                accept_tokens[s.index, :n] = verdict.tokens[k, :n]
                accept_lens[s.index] = n
                outcome[s.track.rid] = Outcome(drafts=int(lens[k]), tokens=n)
                if k in reloads:
                    reloaded[s.track.rid] = reloads[k].nbytes()
                    failures += reloads[k].failures
                self._record(batch.reqs[s.index], int(lens[k]), int(verdict.num_accepted[k]), n)
                sched.verified(s.track, n)
            n_acc = int(verdict.num_accepted.sum())
            stats.add("vericache", verify_rounds=len(idx), drafted=int(lens.sum()), accepted=n_acc,
                      committed=n_acc + len(idx), bytes_reloaded=sum(reloaded.values()))
            if failures:
                stats.add("vericache", reload_failures=failures)
        phases["verify_s"] = time.perf_counter() - mark
        stats.add("vericache", iterations=1, draft_steps=len(drafters), waits=len(plan.of(Role.WAIT)) +
                  len(plan.of(Role.FULL)) - len(full), full_kv_steps=len(full))
        sched.finish(plan, time.perf_counter() - started, outcome, reloaded, phases)

        new_seq_lens = (committed + accept_lens).to(device=dev, dtype=batch.seq_lens.dtype)
        accept_tokens_dev = accept_tokens.to(device=dev, dtype=torch.int32).flatten()
        accept_lens_dev = accept_lens.to(device=dev, dtype=torch.int32)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=accept_tokens_dev,
            can_run_cuda_graph=False,
            accept_lens=accept_lens_dev,
            new_seq_lens=new_seq_lens,
            next_draft_input=self._draft_input(new_seq_lens, accept_tokens_dev, accept_lens_dev),
            speculative_num_draft_tokens=self.stride,
            speculative_output_stride=self.stride,
        )

    def _fall_back(self, track) -> bool:
        """ADMIT gave up on this request (deferred too often, or its reload can never
        fit the window): its full KV goes back onto the device and it decodes from it
        (appendix B.1's ``B_g``). False when the pool has no room yet (it waits)."""
        entry = self.host.get(track.rid, track.row)
        if entry is not None and self.runtime.entry_for_row(track.row) is not None:
            k, v = self._full_rows(entry)
            if not self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, k, v):
                return False
            self.host.drop(track.rid)
        self._staggered.fall_back(track)
        stats.add("vericache", fallbacks=1, admit_fallbacks=1)
        return True

    def _sub_batch(self, batch, indices: list[int]):
        """The requests ``indices`` of the batch, as a batch of their own (SGLang's
        ``filter_batch`` on a shallow copy; the sampling info is copied, not shared)."""
        sub = copy.copy(batch)
        sub.sampling_info = copy.copy(batch.sampling_info)
        if sub.sampling_info is not None and sub.sampling_info.penalizer_orchestrator is None:
            # the forward's copy of the batch carries no penalizers (VERICACHE refuses
            # penalties at the API), so there is nothing to filter there
            sub.sampling_info.penalizer_orchestrator = _NoPenalties()
        sub.spec_info = None
        sub.filter_batch(keep_indices=list(indices))
        return sub

    def _forward(self, sub, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info) -> torch.Tensor:
        self._set_batch(sub, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info,
                        sub.seq_lens.dtype, sub.seq_lens.device)
        res = self.target_worker.forward_batch_generation(sub, is_verify=True)
        return res.logits_output.next_token_logits

    def _set_batch(self, batch, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info, seq_dtype, dev):
        """Point the (isolated) schedule batch at one forward of the round."""
        batch.forward_mode = mode
        batch.input_ids = input_ids.to(device=dev, dtype=torch.int64)
        batch.seq_lens = seq_lens_cpu.to(device=dev, dtype=seq_dtype)
        batch.seq_lens_cpu = seq_lens_cpu.to(torch.int64)
        batch.seq_lens_sum = int(seq_lens_cpu.sum())
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.out_cache_loc = out_cache_loc.to(device=dev, dtype=torch.int64)
        batch.spec_info = spec_info

    def _verify_input(self, verify_ids, positions, committed, dev):
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        bs, w = verify_ids.shape
        # A causal chain (NGRAM's tree with topk=1): query k sees the committed prefix and
        # verify tokens 0..k. Flattened per request as [W, L + W], as SGLang's verify
        # attention backends read it (the vc_verify backend builds the same mask itself).
        chain = torch.tril(torch.ones(w, w, dtype=torch.bool))
        mask = torch.cat([torch.cat([torch.ones(w, int(l), dtype=torch.bool), chain], 1).flatten()
                          for l in committed.tolist()]).to(dev)
        spec_info = NgramVerifyInput(
            draft_token=verify_ids.flatten().to(dev),
            custom_mask=mask,
            positions=positions.flatten().to(dev),
            retrieve_index=torch.arange(bs * w, device=dev).view(bs, w),
            retrieve_next_token=None,
            retrieve_next_sibling=None,
            draft_token_num=w,
        )
        spec_info.capture_hidden_mode = CaptureHiddenMode.NULL
        return spec_info

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
        kv_pool = self.runtime.kv_pool
        layers = list(range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num))
        return LayerwiseReload(self.copy_thread, entries, layers, self.device, on_failure=self._restore_full_kv)

    def _restore_full_kv(self, entries) -> None:
        """A staged reload failed every retry (called from the verify forward, before the
        failed layer is attended): the slower correct path. Each request's full KV goes
        from the host store back into device slots and its compressed index is dropped,
        so it verifies -- from this layer on -- and decodes from its full device KV, like a
        request the host store never admitted. Its output stays the full-KV output."""
        for entry in entries.values():
            k, v = self._full_rows(entry)
            if not self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, k, v):
                # both the host path and the pool failed: nothing correct is left to serve
                raise RuntimeError(f"VERICACHE: the reload of request {entry.rid} failed and the "
                                   "KV pool has no free slots to restore its full KV")
            self.host.drop(entry.rid)
            logger.warning("VERICACHE: reload of request %s failed every retry; it decodes from its "
                           "full KV, restored on the device", entry.rid)
            stats.add("vericache", reload_fallbacks=1, fallbacks=1)

    def _full_rows(self, entry) -> tuple[dict, dict]:
        """The full KV of the entry's span per layer: the host rows, merged with the kept
        rows still in the pool where the host holds only the dropped ones."""
        pool = self.runtime.kv_pool
        slots = self.req_to_token_pool.req_to_token[entry.req_pool_idx, : entry.n].to(torch.int64)
        k, v = {}, {}
        for layer_id in entry.k:
            k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            k[layer_id], v[layer_id] = entry.span(layer_id).to(k_buf.device).full(k_buf, v_buf, slots.to(k_buf.device))
        return k, v

    def _targets(self, logits: torch.Tensor, batch, positions: torch.Tensor) -> torch.Tensor:
        """The verifier's token at each of the W positions ``[bs, W]``, chosen from the
        full-KV logits as SGLang's sampler chooses in full-KV decoding: ``logit_bias``
        added; argmax for greedy requests; otherwise softmax at the request's temperature,
        then SGLang's own top-k / top-p / min-p sampling, seeded per request and position
        under deterministic inference. Penalties and grammars are refused at the API
        (:mod:`.requests`)."""
        from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

        bs, w, vocab = logits.shape
        info = batch.sampling_info
        logits = logits.float()
        if info is not None and info.logit_bias is not None:
            logits = logits + info.logit_bias[:, None, : vocab].to(logits.device)
        if info is None or info.is_all_greedy:
            return logits.argmax(-1)

        def per_position(t):  # [bs] -> [bs * W]
            return t.view(-1).repeat_interleave(w)

        flat = logits.view(bs * w, vocab)
        probs = torch.softmax(flat / per_position(info.temperatures.float())[:, None], dim=-1)
        seed = info.sampling_seed
        ids = top_k_top_p_min_p_sampling_from_probs_torch(
            probs,
            per_position(info.top_ks),
            per_position(info.top_ps.float()),
            per_position(info.min_ps.float()),
            bool(info.need_min_p_sampling),
            None if seed is None else per_position(seed),
            positions.reshape(-1).to(probs.device),
        )
        targets = ids.view(bs, w).to(torch.int64)
        # greedy requests of a mixed batch (SGLang gives them top_k = 1): exact argmax
        greedy = (info.top_ks.view(-1) <= 1).to(targets.device)
        return torch.where(greedy[:, None], logits.argmax(-1), targets)


class _NoPenalties:
    def filter(self, keep_indices) -> None:
        pass


class _Staging:
    """The staged reloads of one verify forward, each started for one request at its
    reserved window, seen by the attention backend as one reload (request index in the
    verify batch -> its staged rows)."""

    def __init__(self, reloads: dict[int, LayerwiseReload]):
        self.reloads = reloads

    def layer(self, layer_id: int) -> dict:
        out = {}
        for k, reload in self.reloads.items():
            for staged in reload.layer(layer_id).values():
                out[k] = staged
        return out
