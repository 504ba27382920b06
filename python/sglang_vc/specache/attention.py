"""Attention backend ``specache``: ``vc_torch`` (prefill, then KIVI quantization of the
prompt with the runtime's payload store) plus SpeCache's decode step.

In a SpeCache step (the worker sets :attr:`SpeCacheAttnBackend.step`) a compressed
request attends, in each layer, by :func:`.core.attend` over its dequantized payload
with the rows prefetched for this layer put back in full precision (eq. 1), then its
full-precision tail from the pool; the selecting query row's attention picks the next
step's rows, whose prefetch starts at once on the copy thread. Requests without a
payload attend over their pool rows. ``TARGET_VERIFY`` forwards carry the output and the
speculative token; ``DECODE`` forwards (the non-speculative mode) carry the output token
alone, which attends, fetches its own top-k rows and attends again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import sgl_kernel_ext as ext
import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_vc.config import get_vc_config
from sglang_vc.kvruntime import kernels, make_spec
from sglang_vc.kvruntime.backend import VCTorchAttnBackend

from . import core, flags, fused
from .config import SUPPORTED_BITS
from .step import Phase, StepPlan


class SpeCacheAttnBackend(VCTorchAttnBackend):
    step: Optional[StepPlan] = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.config = flags.config_of(get_vc_config(model_runner.server_args).group(flags.GROUP))
        # the payload is KIVI at SpeCache's residual; a request whose payload finds no pool
        # slots to lease keeps its full KV (never lossy rows SpeCache does not know are lossy)
        for bits in SUPPORTED_BITS:  # a request may choose the other width (requests.py)
            self.runtime.use_compressor(dataclasses.replace(self.config, bits=bits).quantizer())
        self.runtime.in_place_fallback = False
        self.runtime.default_spec = make_spec(self.config.compressor_name, bits=self.config.bits)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.step is None or not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._step_forward(q, k, v, layer, forward_batch, save_kv_cache,
                                  forward_batch.spec_info.draft_token_num)

    def _step_forward(self, q, k, v, layer, forward_batch, save_kv_cache, width: int):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        lid = layer.layer_id
        k_buf = self.token_to_kv_pool.get_key_buffer(lid)
        v_buf = self.token_to_kv_pool.get_value_buffer(lid)
        req_to_token = self.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        committed = seq_lens.tolist()
        step, cfg = self.step, self.step.config
        for i, row in enumerate(forward_batch.req_pool_indices.tolist()):
            q_i = q_[i * width : (i + 1) * width]
            end = committed[i] + width
            slots = req_to_token[row, :end].to(torch.int64)
            req = step.requests[i]
            entry = self.runtime.entry_for_row(row)
            if req.phase is Phase.FULL or entry is None or entry.payload is None:
                k_r, v_r = kernels.gather_kv(k_buf, v_buf, slots)
                o_[i * width : (i + 1) * width] = kernels.attend(
                    q_i, k_r, v_r, num_prefix=0, key_positions=torch.arange(end, device=k_r.device),
                    q_start=committed[i], scale=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
                continue
            n_q = entry.num_payload_rows
            tail = slots[n_q:]
            heads = layer.tp_k_head_num
            attend = self._attention_of(entry, lid, k_buf, v_buf, tail, committed[i], layer.scaling)
            if not cfg.speculative and req.topk > 0:
                first = attend(q_i, None)  # the output token's own top-k, fetched, then again
                rows = step.host.gather(req.rid, lid, ext.select_topk(first.head_scores(0, heads), req.topk),
                                        k_buf.device)
                res = attend(q_i, rows)
            else:
                rows = step.prefetcher.take(req.rid, lid)
                res = attend(q_i, rows)
                sel = req.select_row
                if cfg.speculative and sel is not None and req.topk > 0 and n_q > 0:
                    step.prefetcher.start(req.rid, lid, ext.select_topk(res.head_scores(sel, heads), req.topk))
            if rows is not None:
                step.counters.add(rows, res.head_scores(0, heads), req.topk)
            o_[i * width : (i + 1) * width] = res.out
        if self.runtime.batch is not None:
            self._after_layer(layer)
        return o

    def _attention_of(self, entry, lid: int, k_buf, v_buf, tail, q_start: int, scale: float):
        """Eq. 1 for one request and layer, as ``attend(q, rows) -> core.Attended``: on CUDA
        the fused Triton path over the packed payload and the pool (:mod:`.fused`), on the
        CPU the torch one over the dequantized payload (:func:`.core.attend`)."""
        if ext.backend_for(k_buf) is ext.Backend.TRITON:
            payload = self.runtime.packed_payload(entry, lid)
            return lambda q, rows: fused.attend(q, payload, k_buf, v_buf, tail, q_start=q_start, scale=scale,
                                                rows=rows)
        kq, vq = self.runtime.payload_kv(entry, lid)
        k_tail, v_tail = k_buf[tail], v_buf[tail]
        return lambda q, rows: core.attend(q, kq, vq, k_tail, v_tail, q_start=q_start, scale=scale, rows=rows)
