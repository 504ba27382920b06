"""Attention backend ``vc_verify``: ``vc_torch`` (prefill + compression, decode over
the compressed KV) plus VERICACHE's TARGET_VERIFY forward over the full KV, whose
compressed positions come from the layer the worker staged from the host store (the
full rows, or the dropped rows merged with the kept ones still in the pool)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import sgl_kernel_ext as ext
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

    verify_forward: "Optional[VerifyForward]" = None  # this TARGET_VERIFY forward's metadata

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.verify_forward = None
        if forward_batch.forward_mode.is_target_verify():
            self.verify_forward = self._build_verify_forward(forward_batch)

    def _build_verify_forward(self, forward_batch) -> "VerifyForward":
        """Every request's rows, query lengths and live pool rows, read on the host once
        for all layers (a fixed number of synchronisations, whatever the batch)."""
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        starts = seq_lens.tolist()
        rows = forward_batch.req_pool_indices.tolist()
        lens = _verify_lens(forward_batch.spec_info, len(starts))
        entries = [self.runtime.entry_for_row(r) for r in rows]
        ends = [s + w for s, w in zip(starts, lens)]
        firsts = [0 if e is None else e.row_start for e in entries]
        slots, positions, indptr = kernels.live_rows_batch(self.req_to_token_pool.req_to_token, rows, firsts, ends)
        offsets = [0]
        for w in lens:
            offsets.append(offsets[-1] + w)
        return VerifyForward(rows, starts, lens, offsets, entries, slots, positions, indptr)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        vf = self.verify_forward
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        verifying = self.reload.requests if self.reload is not None else ()
        staged = self.reload.layer(layer.layer_id) if self.reload is not None else {}
        for i, (row, committed, w, entry) in enumerate(zip(vf.rows, vf.starts, vf.lens, vf.entries)):
            lo, hi = vf.q_offsets[i], vf.q_offsets[i + 1]
            live = (vf.slots[vf.indptr[i] : vf.indptr[i + 1]], vf.positions[vf.indptr[i] : vf.indptr[i + 1]])
            if i in staged:  # verifying: the full KV, its compressed span staged from the host
                slots = req_to_token[row, : committed + w].to(torch.int64)
                span = staged[i]
                p, n = span.p, span.n
                k_full, v_full = span.full(k_buf, v_buf, slots)
                k_r = torch.cat([k_buf[slots[:p]], k_full.to(k_buf.dtype), k_buf[slots[n:]]])
                v_r = torch.cat([v_buf[slots[:p]], v_full.to(v_buf.dtype), v_buf[slots[n:]]])
                positions = torch.arange(committed + w, device=k_r.device)
            elif i in verifying:  # its reload failed every retry: its full KV is back on the device
                if self.runtime.entry_for_row(row) is not None:
                    # never verify against the compressed rows: that would not be lossless
                    raise RuntimeError(f"VERICACHE: no full KV staged for compressed row {row}")
                k_r, v_r = kernels.gather_kv(k_buf, v_buf, req_to_token[row, : committed + w].to(torch.int64))
                positions = torch.arange(committed + w, device=k_r.device)
            elif entry is not None:  # drafting from the compressed KV
                o_[lo:hi] = self._draft_attention(q_[lo:hi], entry, layer, committed, w, live, gqa)
                continue
            else:  # full KV on the device
                k_r, v_r = kernels.gather_kv(k_buf, v_buf, live[0])
                positions = live[1]
            o_[lo:hi] = kernels.attend(q_[lo:hi], k_r, v_r, num_prefix=0, key_positions=positions,
                                       q_start=committed, scale=layer.scaling, enable_gqa=gqa,
                                       last_position=committed + w - 1)
        if self.runtime.batch is not None:
            self._after_layer(layer)
        return o

    def _draft_attention(self, q, entry, layer, start: int, w: int, live, gqa: bool):
        """A compressed request's queries at positions ``start .. start + w - 1`` over its
        compressed KV (``live``: its pool rows): the SpeCache drafter's attention where it
        drafts, the Triton kernels on CUDA, the runtime's rows with SDPA otherwise."""
        if w == 1 and self._decodes_own(entry) and (out := self.drafter.attend(q, entry, layer, start + 1)) is not None:
            return out
        lid = layer.layer_id
        if ext.backend_for(q) is ext.Backend.TRITON:
            return kernels.attend_pool(q, self.token_to_kv_pool.get_key_buffer(lid),
                                       self.token_to_kv_pool.get_value_buffer(lid), live[0], live[1],
                                       q_start=start, scale=layer.scaling,
                                       payload=self.runtime.packed_payload(entry, lid))
        k_r, v_r, num_prefix, positions = self.runtime.request_kv(entry, lid, start + w, live=live)
        return kernels.attend(q, k_r, v_r, num_prefix=num_prefix, key_positions=positions, q_start=start,
                              scale=layer.scaling, enable_gqa=gqa, last_position=start + w - 1)


@dataclasses.dataclass
class VerifyForward:
    """What every layer of one (ragged) TARGET_VERIFY forward reads, built once."""

    rows: list[int]  # req_pool_idx per request
    starts: list[int]  # committed KV length: the first query's position
    lens: list[int]  # query tokens per request
    q_offsets: list[int]  # request i's queries are rows q_offsets[i] .. q_offsets[i + 1]
    entries: list  # CompressedKVIndex or None per request
    slots: torch.Tensor  # live pool rows: of a compressed request from its row_start
    positions: torch.Tensor
    indptr: list[int]  # request i's live rows are slots[indptr[i] : indptr[i + 1]]


def _verify_lens(spec_info, bs: int) -> list[int]:
    """Tokens each request forwards in this verify: SGLang's ragged layout, or the
    uniform draft width."""
    layout = getattr(spec_info, "ragged_verify_layout", None)
    if layout is not None and layout.verify_lens_cpu is not None:
        return list(layout.verify_lens_cpu)
    return [spec_info.draft_token_num] * bs
