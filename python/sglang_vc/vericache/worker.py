"""The VERICACHE speculative worker (SGLang spec-V2 schema, synchronous).

One scheduler decode round of a batch (``L`` = committed KV length of a request, ``t0`` =
its last output token, whose KV is not computed yet):

1. **Draft** ``X`` tokens greedily with ``X`` decode forwards of the target model whose
   attention reads the request's *compressed* KV (the lossy runtime's
   :class:`~sglang_vc.lossy.index.CompressedKVIndex`: compressed prompt rows ++ the full
   KV of tokens committed since). Draft KV goes to the request's reserved slots
   ``row[L .. L+X-1]``.
2. **Reload**: the full prompt KV the compression replaced, kept in a host store since
   the prefill (:class:`HostKVStore`), is copied into *transient* device slots, and the
   request's row positions ``[p, n)`` point at them for the verify forward only.
3. **Verify** ``[t0, d1 .. dX]`` at positions ``L .. L+X`` in ONE ``TARGET_VERIFY``
   forward with a causal chain mask over the full KV (:class:`VeriCacheAttnBackend`);
   its KV overwrites the draft KV in ``row[L .. L+X]`` (the committed tokens' KV is thus
   full-KV, and serves both the drafter, as tail rows after the compressed prefix, and
   later verifies).
4. **Accept** (core :func:`~sglang_vc.vericache.sampling.greedy_verify_ids`): the
   matching prefix ``d1..da`` plus the verifier's correction, or all ``X`` plus the
   bonus token. The row is restored, the transient slots are freed.

Greedy requests get exactly the full-KV tokens: every committed token is the full-KV
argmax given committed tokens only. A sampling request commits drafts while they equal
the verifier's own sample at that position (a lossless rule: each committed token is a
sample of the full-KV distribution), then that sample.

Not built (see the package report): the §5 reload scheduler (every request verifies every
round; the ReloadScheduler/ADMIT core is not driven by the worker yet), asynchronous
host->device reloads, logprobs of speculative tokens, grammar-constrained requests.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vc import stats
from sglang_vc.lossy import kernels
from sglang_vc.lossy.backend import VCTorchAttnBackend
from sglang_vc.lossy.runtime import get_runtime

from .sampling import greedy_verify_ids
from .worker_spec import META_INFO_KEY

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- host store


@dataclasses.dataclass
class HostEntry:
    """Full KV of prompt positions ``[p, n)`` of one request, per layer, in host memory."""

    rid: str
    req_pool_idx: int
    p: int
    n: int
    k: dict = dataclasses.field(default_factory=dict)  # layer_id -> [n - p, H, D] (cpu)
    v: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.n - self.p

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class HostKVStore:
    """Full KV of the prompt positions whose device rows were replaced by compressed
    ones. Filled by the lossy runtime right before it compresses each layer."""

    def __init__(self):
        self.entries: dict[str, HostEntry] = {}

    def sink(self, rid: str, req_pool_idx: int, layer_id: int, p: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
        n = k.shape[0]
        entry = self.entries.get(rid)
        if entry is None or entry.req_pool_idx != req_pool_idx or entry.n != n or entry.p != p:
            entry = self.entries[rid] = HostEntry(rid, req_pool_idx, p, n)
        entry.k[layer_id] = k[p:].to("cpu", copy=True)
        entry.v[layer_id] = v[p:].to("cpu", copy=True)

    def get(self, rid: str, req_pool_idx: int) -> Optional[HostEntry]:
        entry = self.entries.get(rid)
        if entry is None or entry.req_pool_idx != req_pool_idx:
            return None
        return entry

    def retain(self, live_rids: set[str]) -> None:
        for rid in [r for r in self.entries if r not in live_rids]:
            del self.entries[rid]

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())


# ----------------------------------------------------------------------------- attention


class VeriCacheAttnBackend(VCTorchAttnBackend):
    """``vc_torch`` (prefill + compression, decode over compressed KV) plus the
    TARGET_VERIFY forward: each request's ``W`` verify queries at positions
    ``L .. L+W-1`` attend causally to its row ``[0, L+W)`` (full KV; the worker has
    remapped the compressed prompt positions to reloaded full rows)."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        w = forward_batch.spec_info.draft_token_num
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        for i, (row, committed) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens.tolist())):
            slots = req_to_token[row, : committed + w].to(torch.int64)
            k_r, v_r = kernels.gather_kv(k_buf, v_buf, slots)
            o_[i * w : (i + 1) * w] = kernels.attend(
                q_[i * w : (i + 1) * w], k_r, v_r, num_prefix=0, tail_start=0, q_start=committed,
                scale=layer.scaling, enable_gqa=gqa,
            )
        if self.runtime.batch is not None:
            self._after_layer(layer)
        return o


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
        self.host = HostKVStore()
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
        return self._runtime

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
        self.host.retain({e.rid for e in runtime.index.values()})
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
            entry = self.runtime.index.get(row)
            if entry is not None:
                entry.keep_full_rows = True

        # 1. draft X tokens greedily from the compressed KV
        drafts = torch.empty(bs, x, dtype=torch.int64)
        cur = t0
        for j in range(x):
            lens = committed + j + 1
            self._set_batch(batch, ForwardMode.DECODE, cur, lens, slots[:, j], None, seq_dtype, dev)
            res = self.target_worker.forward_batch_generation(batch, is_verify=True)
            cur = res.logits_output.next_token_logits.argmax(-1).to("cpu", torch.int64)
            drafts[:, j] = cur

        # 2-3. reload the full KV into transient slots, verify t0 + drafts in one forward
        verify_ids = torch.cat([t0[:, None], drafts], dim=1)  # [bs, W]
        mapping, transient, reloaded = self._reload(batch, rows)
        try:
            spec_info = self._verify_input(verify_ids, positions, committed, dev)
            self._set_batch(batch, ForwardMode.TARGET_VERIFY, verify_ids.flatten(), committed,
                            slots.flatten(), spec_info, seq_dtype, dev)
            res = self.target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            for row, p, n, saved in mapping:
                req_to_token[row, p:n] = saved
            if transient is not None:
                self.token_to_kv_pool_allocator.free(transient)
        logits = res.logits_output.next_token_logits.view(bs, w, -1)

        # 4. accept
        targets = self._targets(logits, batch).to("cpu", torch.int64)
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

    def _reload(self, batch, rows):
        """Copy each compressed request's full prompt KV from the host store into fresh
        device slots and point its row positions ``[p, n)`` at them. Returns the row
        mapping to restore, the transient slots to free and the bytes copied."""
        entries = []
        for i, req in enumerate(batch.reqs):
            entry = self.host.get(req.rid, int(rows[i]))
            if entry is not None and entry.num_tokens and self.runtime.index.get(int(rows[i])) is not None:
                entries.append((int(rows[i]), entry))
        if not entries:
            return [], None, 0
        total = sum(e.num_tokens for _, e in entries)
        transient = self.token_to_kv_pool_allocator.alloc(total)
        if transient is None:
            tree_cache = getattr(batch, "tree_cache", None)
            if tree_cache is not None:
                from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                tree_cache.evict(EvictParams(num_tokens=total))
                transient = self.token_to_kv_pool_allocator.alloc(total)
        if transient is None:
            raise RuntimeError(
                f"VERICACHE: no room in the device KV pool for the {total} transient slots of "
                "a verify reload; raise --max-total-tokens or lower --max-running-requests"
            )
        transient = transient.to(torch.int64)
        kv_pool = self.runtime.kv_pool
        req_to_token = self.req_to_token_pool.req_to_token
        mapping, off, nbytes = [], 0, 0
        for row, entry in entries:
            dest = transient[off : off + entry.num_tokens]
            off += entry.num_tokens
            for layer_id, k in entry.k.items():
                kernels.write_rows(kv_pool.get_key_buffer(layer_id), dest, k.to(dest.device, non_blocking=True))
                kernels.write_rows(kv_pool.get_value_buffer(layer_id), dest, entry.v[layer_id].to(dest.device, non_blocking=True))
            nbytes += entry.nbytes()
            mapping.append((row, entry.p, entry.n, req_to_token[row, entry.p : entry.n].clone()))
            req_to_token[row, entry.p : entry.n] = dest.to(req_to_token.dtype)
        return mapping, transient, nbytes

    def _targets(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """The verifier's token at each of the W positions: argmax for greedy requests,
        a sample of the full-KV distribution (temperature, top-k, top-p) otherwise."""
        targets = logits.argmax(-1)
        info = batch.sampling_info
        if info is None or info.is_all_greedy:
            return targets
        temps = info.temperatures.view(-1).float()
        top_ks = info.top_ks.view(-1)
        top_ps = info.top_ps.view(-1).float()
        for i in range(logits.shape[0]):
            if top_ks[i] <= 1 or temps[i] <= 0:
                continue
            scores = logits[i].float() / temps[i]
            k = int(min(int(top_ks[i]), scores.shape[-1]))
            vals, idx = scores.topk(k, dim=-1)
            probs = vals.softmax(-1)
            if top_ps[i] < 1:
                cum = probs.cumsum(-1)
                probs = probs.masked_fill(cum - probs > top_ps[i], 0)
                probs = probs / probs.sum(-1, keepdim=True)
            pick = torch.multinomial(probs, 1).squeeze(-1)
            targets[i] = idx.gather(-1, pick[:, None]).squeeze(-1)
        return targets
