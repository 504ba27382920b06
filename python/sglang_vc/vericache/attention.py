"""Attention backend ``vc_verify``: ``vc_torch`` (prefill + compression, decode over
the compressed KV) plus VERICACHE's TARGET_VERIFY forward over the full KV, whose
compressed positions come from the layer the worker staged from the host store (the
full rows, or the dropped rows merged with the kept ones still in the pool)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_vc.kvruntime import kernels
from sglang_vc.kvruntime.backend import VCTorchAttnBackend

if TYPE_CHECKING:
    from .reload import LayerwiseReload
    from .specache_drafter import SpeCacheDrafter


class VeriCacheAttnBackend(VCTorchAttnBackend):
    """``vc_torch`` (prefill + compression, decode over compressed KV) plus the
    TARGET_VERIFY forward: each request's ``W`` verify queries at positions
    ``L .. L+W-1`` attend causally to its row ``[0, L+W)`` over the full KV: positions
    ``[p, n)`` of a compressed request come from ``self.reload`` (staged by the worker),
    the others from the pool.

    Draft (decode) forwards of a request compressed with ``specache`` use SpeCache's
    attention over its low-bit copy with its own top-k rows fetched from the host copy
    (:mod:`.specache_drafter`)."""

    reload: "Optional[LayerwiseReload]" = None
    drafter: "Optional[SpeCacheDrafter]" = None  # set by the worker

    def _decodes_own(self, entry) -> bool:
        # a request compressed with SpeCache's device copy drafts with its attention
        return self.drafter is not None and self.runtime.compressor(entry.spec.compressor).needs_full_rows

    def _attend_compressed(self, q, entry, layer, seq_len: int):
        if self._decodes_own(entry):
            return self.drafter.attend(q, entry, layer, seq_len)
        return super()._attend_compressed(q, entry, layer, seq_len)

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
        staged = self.reload.layer(layer.layer_id) if self.reload is not None else {}
        for i, (row, committed) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens.tolist())):
            slots = req_to_token[row, : committed + w].to(torch.int64)
            if i in staged:
                span = staged[i]
                p, n = span.p, span.n
                k_full, v_full = span.full(k_buf, v_buf, slots)
                k_r = torch.cat([k_buf[slots[:p]], k_full.to(k_buf.dtype), k_buf[slots[n:]]])
                v_r = torch.cat([v_buf[slots[:p]], v_full.to(v_buf.dtype), v_buf[slots[n:]]])
            elif self.runtime.entry_for_row(row) is not None:
                # never verify against the compressed rows: that would not be lossless
                raise RuntimeError(f"VERICACHE: no full KV staged for compressed row {row}")
            else:
                k_r, v_r = kernels.gather_kv(k_buf, v_buf, slots)
            o_[i * w : (i + 1) * w] = kernels.attend(
                q_[i * w : (i + 1) * w], k_r, v_r, num_prefix=0,
                key_positions=torch.arange(committed + w, device=k_r.device), q_start=committed,
                scale=layer.scaling, enable_gqa=gqa,
            )
        if self.runtime.batch is not None:
            self._after_layer(layer)
        return o
