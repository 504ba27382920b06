"""The VERICACHE speculative worker (SGLang spec-V2 schema, synchronous).

One scheduler decode round of a batch (``L`` = committed KV length of a request, ``t0`` =
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

Not built: the §5 reload scheduler (every request verifies every round; the
ReloadScheduler/ADMIT core is not driven by the worker yet), logprobs of speculative
tokens, penalties and grammar-constrained requests (refused).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vc import stats
from sglang_vc.kvruntime import get_runtime

from . import flags
from .names import META_INFO_KEY
from .reload import HostKVStore, LayerwiseReload
from .sampling import greedy_verify_ids

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

        self.host = HostKVStore(flags.host_kv_bytes(get_vc_config(server_args).group(flags.GROUP)))
        self.copy_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-reload")
        self.per_request: dict[str, dict] = {}
        self._runtime = None

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
            result = self._decode_round(batch)
        else:
            res = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
            predict = res.next_token_ids
            bs = len(batch.reqs)
            accept_tokens = torch.zeros(bs, self.width, dtype=torch.int32, device=predict.device)
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
                speculative_num_draft_tokens=self.width,
                speculative_output_stride=self.width,
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
        return NgramVerifyInput(draft_token_num=self.width, new_seq_lens=new_seq_lens,
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
            info = self.per_request.setdefault(req.rid, {"verify_rounds": 0, "drafted": 0, "accepted": 0,
                                                        "committed": 0, "draft_tokens": x})
            info["verify_rounds"] += 1
            info["drafted"] += x
            info["accepted"] += int(accepted[i])
            info["committed"] += int(accept_lens[i])
            info["mean_acceptance_length"] = info["committed"] / info["verify_rounds"]
            if req.customized_info is None:
                req.customized_info = {}
            req.customized_info[META_INFO_KEY] = [info]

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
            if not self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, entry.k, entry.v):
                # both the host path and the pool failed: nothing correct is left to serve
                raise RuntimeError(f"VERICACHE: the reload of request {entry.rid} failed and the "
                                   "KV pool has no free slots to restore its full KV")
            self.host.drop(entry.rid)
            logger.warning("VERICACHE: reload of request %s failed every retry; it decodes from its "
                           "full KV, restored on the device", entry.rid)
            stats.add("vericache", reload_fallbacks=1, fallbacks=1)

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
