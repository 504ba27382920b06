"""VERICACHE's lock-step schedule (``--vc-schedule lockstep``, the comparison mode): one
round per iteration for the whole batch, composed into :class:`~.worker.VeriCacheWorker` (``worker.lockstep``).

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
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.spec_worker import committed_lens

from .forward_plan import ForwardPlan, attach
from .reload import LayerwiseReload
from .sampling import greedy_verify_ids
from .staging import PoolStaging


class LockstepRound:
    """``run(batch)``: draft ``X`` tokens for every request, then verify them all in one
    forward (the worker provides the forwards, the host store and the bookkeeping)."""

    def __init__(self, worker):
        self.worker = worker

    @torch.inference_mode()
    def run(self, batch):
        w = self.worker
        bs, width = len(batch.reqs), w.width
        committed = committed_lens(batch)  # L per request
        rows = torch.tensor([req.kv.req_pool_idx for req in batch.reqs], dtype=torch.int64)  # the host's own
        req_to_token = w.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(width)[None, :]  # [bs, W]
        slots = req_to_token[rows[:, None].to(req_to_token.device), positions.to(req_to_token.device)].to(torch.int64)
        t0 = torch.tensor([req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                           for req in batch.reqs], dtype=torch.int64)

        # The committed tokens' rows must stay full KV (the verifier reads them): a lossy
        # decode-time step that would rewrite or free them (e.g. KIVI tail streaming) must
        # skip entries carrying this mark.
        for row in rows.tolist():
            entry = w.runtime.entry_for_row(row)
            if entry is not None:
                entry.keep_full_rows = True

        # 2. (started first, so that it overlaps drafting) copy the full KV of the
        # compressed requests, layer by layer, into pool slots for the verify forward
        staging = PoolStaging(w.runtime)
        reload = self._start_reload(batch, rows, staging)
        try:  # (from here on, the reload is closed however the iteration ends)
            drafts = self._draft(batch, committed, slots, t0)  # 1.
            res = self._verify(batch, committed, positions, slots, t0, drafts, staging)  # 3.
        finally:
            if reload is not None:
                reload.close()  # (before its slots are freed: see LayerwiseReload.close)
            staging.restore()  # (a no-op once done: the slots of a round that failed before its verify)
        reloaded = reload.nbytes() if reload is not None else 0
        if reload is not None and reload.failures:
            stats.add("vericache", reload_failures=reload.failures)
        return self._commit(batch, committed, positions, t0, drafts, res, reloaded,  # 4.
                            reload.lost if reload is not None else {})

    def _start_reload(self, batch, rows, staging: PoolStaging) -> Optional[LayerwiseReload]:
        """Kick off the reload of every request of the batch that is compressed and has its
        full KV on the host, into pool slots ``staging`` reserves for its verify; None when
        no request needs one (or the pool has no room for any: their verify then fails)."""
        w = self.worker
        entries = {}
        for i, req in enumerate(batch.reqs):
            row = int(rows[i])
            entry = w.host.get(req.rid, row)
            if entry is not None and entry.num_tokens and w.runtime.entry_for_row(row) is not None \
                    and staging.reserve(i, entry):
                entries[i] = entry
        if not entries:
            return None
        reload = LayerwiseReload(w.copy_thread, entries, {i: staging.requests[i].slots for i in entries},
                                 w.runtime.kv_pool, w.req_to_token_pool.req_to_token, w._layer_ids(),
                                 w.device, on_failure=w.restore, copy_stream=w.copy_stream, staging=staging)
        staging.layer_ready = reload.layer
        return reload

    def _draft(self, batch, committed, slots, t0) -> torch.Tensor:
        """``X`` greedy drafts per request from its compressed KV: ``X`` decode forwards."""
        w = self.worker
        bs, dev, seq_dtype = len(batch.reqs), batch.seq_lens.device, batch.seq_lens.dtype
        info = batch.sampling_info
        bias = None if info is None else info.logit_bias  # drafts honour it too: fewer rejections
        constrained = w.constrained(batch.reqs)  # penalties or grammars: per-position logits
        drafts = torch.empty(bs, w.num_drafts, dtype=torch.int64)
        cur = t0
        for j in range(w.num_drafts):
            lens = committed + j + 1
            w.set_batch(batch, ForwardMode.DECODE, cur, lens, slots[:, j], None, seq_dtype, dev)
            res = w.target_worker.forward_batch_generation(batch, is_verify=True)
            draft_logits = res.logits_output.next_token_logits
            if constrained:
                draft_logits = w.penalize(draft_logits, batch.reqs, drafts[:, :j].tolist(), range(bs),
                                          [j] * bs, t0.tolist() if w.draft_grammar else None)
            if bias is not None:
                draft_logits = draft_logits.float() + bias[:, : draft_logits.shape[-1]].to(draft_logits.device)
            cur = draft_logits.argmax(-1).to("cpu", torch.int64)
            drafts[:, j] = cur
        return drafts

    def _verify(self, batch, committed, positions, slots, t0, drafts, staging: PoolStaging):
        """``t0`` and the drafts in one ``TARGET_VERIFY`` forward over the full KV."""
        w = self.worker
        verify_ids = torch.cat([t0[:, None], drafts], dim=1)  # [bs, W]
        dev = batch.seq_lens.device
        spec_info = w.verify_input(verify_ids, positions, committed, dev)
        attach(spec_info, ForwardPlan(staging=staging))
        w.set_batch(batch, ForwardMode.TARGET_VERIFY, verify_ids.flatten(), committed,
                    slots.flatten(), spec_info, batch.seq_lens.dtype, dev)
        staging.point()  # the verifiers' rows at their staged slots, before the metadata is built
        return w.target_worker.forward_batch_generation(batch, is_verify=True)

    def _commit(self, batch, committed, positions, t0, drafts, res, reloaded: int, lost: dict):
        """Accept (a request whose reload was lost inside the forward commits nothing and
        ends) and build SGLang's spec-V2 result."""
        from sglang.srt.managers.utils import GenerationBatchResult

        w = self.worker
        bs, width, x, dev = len(batch.reqs), w.width, w.num_drafts, batch.seq_lens.device
        logits = res.logits_output.next_token_logits
        if w.constrained(batch.reqs):
            logits = w.penalize(logits, batch.reqs, drafts.tolist(), [i for i in range(bs) for _ in range(width)],
                                list(range(width)) * bs, t0.tolist())
        logits = logits.view(bs, width, -1)
        targets = w.targets(logits, batch, positions).to("cpu", torch.int64)
        verdict = greedy_verify_ids(drafts, targets, pad_id=0)
        failed = [req.rid in lost for req in batch.reqs]
        for req in batch.reqs:
            if req.rid in lost:
                w._fail(req, lost[req.rid])
        failed = torch.tensor(failed, dtype=torch.bool)
        accepted = verdict.num_accepted.masked_fill(failed, 0)  # [bs]
        accept_lens = verdict.num_tokens.masked_fill(failed, 0).to(torch.int32)
        accept_tokens = verdict.tokens.to(torch.int32)  # [bs, W]
        new_seq_lens = (committed + accept_lens).to(device=dev, dtype=batch.seq_lens.dtype)
        n_acc = int(accepted.sum())
        stats.add("vericache", verify_rounds=bs, drafted=bs * x, accepted=n_acc,
                  committed=n_acc + bs, bytes_reloaded=reloaded)
        for i, req in enumerate(batch.reqs):
            req.vc_verified = True
            w._record(req, x, int(accepted[i]), int(accept_lens[i]))
        accept_tokens_dev = accept_tokens.to(dev).flatten()
        accept_lens_dev = accept_lens.to(dev)
        logits_output = res.logits_output
        if batch.return_logprob:
            chosen = logits.reshape(bs * width, -1)
            bias = None if batch.sampling_info is None else batch.sampling_info.logit_bias
            if bias is not None:
                chosen = chosen + bias[:, : chosen.shape[-1]].to(chosen.device).repeat_interleave(width, dim=0)
            logits_output = w.committed_logprobs(batch, chosen, [i * width for i in range(bs)], accept_tokens,
                                                 accept_lens)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=accept_tokens_dev,
            can_run_cuda_graph=False,
            accept_lens=accept_lens_dev,
            new_seq_lens=new_seq_lens,
            next_draft_input=w.draft_input(new_seq_lens, accept_tokens_dev, accept_lens_dev),
            speculative_num_draft_tokens=width,
            speculative_output_stride=width,
        )
