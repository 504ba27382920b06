"""Attention backend ``vc_verify``: ``vc_torch`` (prefill + compression, decode over
the compressed KV) plus VERICACHE's one forward per iteration (a ragged TARGET_VERIFY
batch): verifying and uncompressed requests attend full KV through SGLang's own backend
as an ordinary causal extend -- a verifying request's row points at its full KV, staged
into pool slots layer by layer (:mod:`.staging`) -- and drafting requests attend their
compressed KV."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import TYPE_CHECKING, Optional

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_vc import stats
from sglang_vc.kvruntime import NULL_SLOT, kernels, payload_table
from sglang_vc.kvruntime.backend import ExtendLists, VCTorchAttnBackend
from sglang_vc.kvruntime.decode_index import DecodeIndex, payload_groups
from sglang_vc.kvruntime.runtime import host_rows

from . import draft_view
from .chain_attention import verify_lens
from .forward_plan import NO_PLAN, ForwardPlan, InPoolDrafts, plan_of  # noqa: F401  (InPoolDrafts: the workers' import)

if TYPE_CHECKING:
    from .specache_drafter import SpeCacheBatch, SpeCacheDrafter


class VeriCacheAttnBackend(VCTorchAttnBackend):
    """``vc_torch`` (prefill + compression, decode over compressed KV) plus the
    TARGET_VERIFY forward: each request's ``W`` queries at positions ``L .. L+W-1``
    attend causally to its row ``[0, L+W)``. Over full KV through SGLang's backend for
    a verifying request (positions ``[p, n)`` staged in the pool by the forward's plan:
    :mod:`.forward_plan`)
    and an uncompressed one; over its compressed KV for a drafting one (``W = 1``).

    Draft (decode) forwards of a request compressed with ``specache`` use SpeCache's
    attention over its low-bit copy with its own top-k rows fetched from the host copy
    (:mod:`.specache_drafter`)."""

    drafter: "Optional[SpeCacheDrafter]" = None  # set by the worker

    def _decodes_own(self, entry) -> bool:
        # a request compressed with SpeCache's device copy drafts with its attention
        return self.drafter is not None and self.runtime.compressor(entry.spec.compressor).needs_full_rows

    def _build_own_decode(self, forward_batch, batch, own: list[int]):
        """A DECODE forward's SpeCache drafters (lock-step drafts) together per layer."""
        own = [i for i in own if batch.entries[i].payload is not None]
        if not own:
            return None
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        seq_lens = seq_lens.tolist()  # (a host tensor; SGLang keeps it beside the device one)
        dev = forward_batch.seq_lens.device
        return [SpeCacheGroup(sb, to_device(torch.tensor([own[j] for j in sb.members]), dev))
                for sb in self.drafter.batch([batch.entries[i] for i in own], [seq_lens[i] for i in own], dev)]

    def _own_decode_layer(self, q_, layer, out) -> None:
        for group in self.own_decode:
            out[group.q_rows] = self.drafter.attend_batch(q_[group.q_rows], group.batch, layer)

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
        """Which requests attend full KV (verifying: staged in the pool; uncompressed)
        and which draft from their compressed KV, read on the host once for all layers
        (a fixed number of synchronisations, whatever the batch); the full-KV requests'
        extend view, whose metadata SGLang's backend builds now."""
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        starts = seq_lens.tolist()
        rows = host_rows(forward_batch)
        lens = verify_lens(forward_batch.spec_info, len(starts))
        plan = plan_of(forward_batch)
        staged = plan.staged
        entries = [None if i in staged else self.runtime.entry_for_row(r) for i, r in enumerate(rows)]
        offsets = [0]
        for w in lens:
            offsets.append(offsets[-1] + w)
        drafting = [i for i, e in enumerate(entries) if e is not None]
        if drafting:  # offload drafters: the project's attention over their compressed rows
            stats.add("attention", project_attention_forwards=1)
        if any(lens[i] > 1 for i in drafting):
            # never verify against the compressed rows: that would not be lossless
            raise RuntimeError("VERICACHE: a compressed request verifies without its full KV staged")
        in_pool = sorted(plan.in_pool.budgets) if plan.in_pool is not None else []
        if any(lens[i] < 2 for i in (plan.in_pool.verifiers if plan.in_pool is not None else ())):
            raise RuntimeError("VERICACHE: an in-pool verify forwards its drafts")
        if any(lens[i] > 1 or entries[i] is not None for i in in_pool):
            raise RuntimeError("VERICACHE: an in-pool draft forwards one token over its own full rows")
        exact = [i for i, e in enumerate(entries) if e is None and i not in plan.in_pool_set]
        req_to_token = self.req_to_token_pool.req_to_token
        d_rows, d_starts = [rows[i] for i in drafting], [entries[i].row_start for i in drafting]
        d_ends = [starts[i] + lens[i] for i in drafting]
        draft_index, slots, positions, indptr, specache = None, None, None, [], []
        if drafting and ext.backend_for(req_to_token) is ext.Backend.TRITON:
            # the Triton path: SpeCache drafters together (a few launches per layer,
            # :meth:`SpeCacheDrafter.attend_batch`), every other drafter's one token in
            # one paged attention launch; index lists built on the device once per forward
            dev = req_to_token.device
            own = [i for i in drafting if self._decodes_own(entries[i]) and entries[i].payload is not None]
            if own:
                specache = [SpeCacheGroup(sb, to_device(torch.tensor([offsets[own[j]] for j in sb.members]), dev))
                            for sb in self.drafter.batch([entries[i] for i in own], [starts[i] + 1 for i in own],
                                                         dev)]
            rest = [i for i in drafting if i not in own]
            if rest:
                up = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), dev)  # noqa: E731
                firsts, ends = [entries[i].row_start for i in rest], [starts[i] + lens[i] for i in rest]
                spans = [e - f for e, f in zip(ends, firsts)]
                kv = ext.build_kv_indices(req_to_token, up([rows[i] for i in rest]), up(firsts), up(ends), NULL_SLOT,
                                          spans=spans, capacity=ext.bucket(sum(spans), payload_table.ROWS_BUCKET))
                draft_index = DraftIndex(DecodeIndex(kv, torch.arange(len(rest), device=dev),
                                                     up([starts[i] for i in rest]),
                                                     payload_groups(self.runtime, [entries[i] for i in rest], dev)),
                                         up([offsets[i] for i in rest]), rest)
        elif drafting:
            slots, positions, indptr = kernels.live_rows_batch(req_to_token, d_rows, d_starts, d_ends)
        view, exact_q = None, None
        if exact:
            view = self._extend_view(forward_batch, exact, starts, lens, offsets)
            self.extend_lists = ExtendLists(view.seq_lens, [rows[i] for i in exact],
                                            [starts[i] + lens[i] for i in exact],
                                            view.extend_seq_lens_cpu, view.extend_prefix_lens_cpu)
            if len(exact) < len(starts):  # drafting requests beside them
                exact_q = to_device(torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in exact]), self.device)
            self._full_kv_backend().init_forward_metadata(view)
            stats.add("attention", full_kv_verify_forwards=1)
        views = self._in_pool_views(forward_batch, plan.in_pool, in_pool, offsets) if in_pool else None
        return VerifyForward(starts, lens, offsets, entries, drafting, view, exact_q, draft_index,
                             slots, positions, indptr, rows, views, specache, plan)

    def _in_pool_views(self, forward_batch, ip: "InPoolDrafts", in_pool: list[int],
                       offsets: list[int]) -> "InPoolViews":
        """The re-selected view's drafters (per layer and KV head: no single row list a
        backend could read; the window view's drafters forward over view rows of
        ``req_to_token`` through SGLang's backend, :mod:`.view_rows`): their positions
        built on the device once for every layer (:mod:`.draft_view`)."""
        dev = forward_batch.seq_lens.device
        idx = to_device(torch.tensor(in_pool, dtype=torch.int64), dev)
        q_rows = to_device(torch.tensor([offsets[i] for i in in_pool], dtype=torch.int64), dev)
        # a draft query sits at position seq_len (its own KV written there first)
        lengths = forward_batch.seq_lens[idx].to(torch.int64) + 1
        rows = forward_batch.req_pool_indices[idx]
        # per request: its last verify's selection, or (none yet) the window view
        sels = [ip.selections.get(ip.rids[i]) for i in in_pool]  # the worker's store
        k_max = max([s.shape[-1] for s in sels if s is not None], default=0)
        layers, heads = self.runtime.kv_pool.layer_num, self.token_to_kv_pool.head_num
        selected = torch.zeros(len(in_pool), layers, heads, k_max, dtype=torch.int64, device=dev)
        n_sel, recent = [], []
        for b, (i, sel) in enumerate(zip(in_pool, sels)):
            if sel is not None:
                selected[b, :, :, : sel.shape[-1]] = sel
            n_sel.append(0 if sel is None else sel.shape[-1])
            recent.append(ip.budgets[i] - draft_view.SINKS if sel is None else ip.recent[i])
        stats.add("vericache", in_pool_draft_rows=sum(draft_view.SINKS + a + b for a, b in zip(n_sel, recent)))
        stats.add("attention", project_attention_forwards=1)
        return InPoolViews(q_rows, lengths, rows, selected, to_device(torch.tensor(n_sel), dev),
                           to_device(torch.tensor(recent), dev), max(recent))

    def _full_kv_backend(self):
        """SGLang's backend for full KV (``torch_native``: this class's own base)."""
        return self.full_kv if self.full_kv is not None else _TorchNative(self)

    def _extend_view(self, forward_batch, exact: list[int], starts, lens, offsets):
        """The requests ``exact`` of this verify forward as an ordinary causal extend
        (prefix = committed tokens, extend = the forwarded window): what every SGLang
        backend runs. A shallow copy of the forward batch, its own KV-read plan."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        dev = forward_batch.seq_lens.device
        pre = [starts[i] for i in exact]
        ext_lens = [lens[i] for i in exact]
        total = [a + b for a, b in zip(pre, ext_lens)]
        view = copy.copy(forward_batch)
        view.forward_mode = ForwardMode.EXTEND
        view.batch_size = len(exact)
        view.spec_info = None
        if len(exact) < len(starts):
            q_rows = to_device(torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in exact]), dev)
            view.req_pool_indices = forward_batch.req_pool_indices[to_device(torch.tensor(exact), dev)]
            view.out_cache_loc = forward_batch.out_cache_loc[q_rows]
            view.positions = forward_batch.positions[q_rows]
        view.seq_lens_cpu = torch.tensor(total, dtype=torch.int64)
        view.seq_lens = to_device(view.seq_lens_cpu.to(forward_batch.seq_lens.dtype), dev)
        view.seq_lens_sum = sum(total)
        view.extend_prefix_lens_cpu, view.extend_seq_lens_cpu = pre, ext_lens
        view.extend_prefix_lens = to_device(torch.tensor(pre, dtype=torch.int32), dev)
        view.extend_seq_lens = to_device(torch.tensor(ext_lens, dtype=torch.int32), dev)
        view.extend_start_loc = to_device(torch.tensor([0, *itertools.accumulate(ext_lens)][:-1], dtype=torch.int32),
                                          dev)
        view.extend_num_tokens = sum(ext_lens)
        view.extend_logprob_start_lens_cpu = ext_lens
        if self.translator is not None and getattr(forward_batch, "kv_loc_plan", None) is not None:
            self.translator.own_plan(view).bind(view, self.translator)
        return view

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        vf = self.verify_forward
        lid = layer.layer_id
        k_buf = self.token_to_kv_pool.get_key_buffer(lid)
        v_buf = self.token_to_kv_pool.get_value_buffer(lid)
        if vf.plan.staging is not None:  # the verifiers' full rows of this layer have landed
            vf.plan.staging.layer_landed(lid)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if vf.view is not None:  # full KV: SGLang's backend
            full = self._full_kv_backend()
            if vf.exact_q is None:
                o = full.forward_extend(q, k, v, layer, vf.view, save_kv_cache=False).reshape(o.shape)
            else:
                q_e, k_e, v_e = (None if t is None else t[vf.exact_q] for t in (q, k, v))
                out = full.forward_extend(q_e, k_e, v_e, layer, vf.view, save_kv_cache=False)
                o[vf.exact_q] = out.reshape(out.shape[0], -1)
        if vf.in_pool is not None:  # in-pool drafters: their sparse views, one call for all
            iv = vf.in_pool
            q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)[iv.q_rows]
            # the re-selected view: this layer's positions per KV head
            pos, valid = draft_view.reselect_positions(
                iv.lengths, iv.selected[:, lid - self.runtime.kv_pool.start_layer], iv.n_selected, iv.recent,
                iv.recent_width)
            slots = self.req_to_token_pool.req_to_token[iv.rows.to(torch.int64)[:, None, None], pos].to(torch.int64)
            out = draft_view.attend_view(q_, k_buf, v_buf, slots, valid, layer.scaling)
            o[iv.q_rows] = out.to(o.dtype).reshape(out.shape[0], -1)
        if vf.plan.in_pool is not None and vf.plan.in_pool.verifiers:
            self._reselect(q, layer, vf, k_buf)
        for group in vf.specache:  # the Triton path: SpeCache drafters, a few launches for all
            q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)[group.q_rows]
            out = self.drafter.attend_batch(q_, group.batch, layer)
            o[group.q_rows] = out.to(o.dtype).reshape(out.shape[0], -1)
        if vf.draft_index is not None:  # the Triton path: one launch for every other drafter
            q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)[vf.draft_index.q_rows]
            out = self.paged_decode(q_, layer, vf.draft_index.index)
            o[vf.draft_index.q_rows] = out.to(o.dtype).reshape(out.shape[0], -1)
        elif vf.slots is not None:  # the torch path: per request
            q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
            o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            gqa = layer.tp_q_head_num != layer.tp_k_head_num
            for b, i in enumerate(vf.drafting):
                lo, hi = vf.q_offsets[i], vf.q_offsets[i + 1]
                live = (vf.slots[vf.indptr[b] : vf.indptr[b + 1]], vf.positions[vf.indptr[b] : vf.indptr[b + 1]])
                o_[lo:hi] = self._draft_attention(q_[lo:hi], vf.entries[i], layer, vf.starts[i], hi - lo, live, gqa)
        if self.runtime.batch is not None:
            self._after_layer(layer)
        return o

    def _reselect(self, q, layer, vf, k_buf) -> None:
        """The re-selected view (SparseSpec's PillarAttn): each in-pool verifier's queries
        score the rows below its recent window (:func:`.draft_view.select_positions`); the
        top ones are its next drafts' view at this layer. Per verifying request (about
        B / (X + 1) of the batch an iteration); on a GPU this belongs in the verify's
        attention kernel (not built)."""
        lid = layer.layer_id
        layer_idx = lid - self.runtime.kv_pool.start_layer
        req_to_token = self.req_to_token_pool.req_to_token
        ip = vf.plan.in_pool  # the worker's selection stores travel on the forward's plan
        shared = ip.view is draft_view.View.SHARED
        for i, (rid, count, recent) in vf.plan.in_pool.verifiers.items():
            first, last = draft_view.SINKS, vf.starts[i] - recent
            if last - first < count:
                continue  # too short to leave anything out: the window view serves it
            lo, hi = vf.q_offsets[i], vf.q_offsets[i + 1]
            k_rows = k_buf[req_to_token[vf.rows[i], first:last].to(torch.int64)]
            q_i = q[lo:hi].reshape(hi - lo, layer.tp_q_head_num, layer.qk_head_dim)
            if shared:  # one selection for every layer and KV head: scores summed over them
                ip.shared.score(i, draft_view.pillar_scores(q_i, k_rows, layer.scaling))
                if lid == self.runtime.last_layer:
                    ip.shared.select(i, rid, vf.rows[i], first, count, req_to_token.shape[0])
                    stats.add("vericache", in_pool_reselections=1)
                continue
            top = draft_view.select_positions(q_i, k_rows, first, count, layer.scaling)
            sel = ip.selections.get(rid)
            if sel is None or sel.shape[-1] != count:
                sel = ip.selections[rid] = torch.zeros(self.runtime.kv_pool.layer_num, *top.shape,
                                                     dtype=torch.int64, device=top.device)
            sel[layer_idx] = top
            if layer_idx == 0:
                stats.add("vericache", in_pool_reselections=1)

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

    starts: list[int]  # committed KV length: the first query's position
    lens: list[int]  # query tokens per request
    q_offsets: list[int]  # request i's queries are rows q_offsets[i] .. q_offsets[i + 1]
    entries: list  # CompressedKVIndex of a drafting request, None for full KV (staged or not)
    drafting: list[int]  # the requests that draft from their compressed KV
    view: object  # ForwardBatch: the full-KV requests as an extend, or None
    exact_q: Optional[torch.Tensor]  # their query rows, None when every request is one
    draft_index: Optional["DraftIndex"]  # the drafters' batched attention (Triton path), or:
    slots: Optional[torch.Tensor]  # drafting request b's live pool rows: slots[indptr[b] : indptr[b + 1]]
    positions: Optional[torch.Tensor]
    indptr: list[int]
    rows: list[int]  # req_pool_idx per request
    in_pool: "Optional[InPoolViews]" = None  # in-pool drafters' sparse views
    specache: list = dataclasses.field(default_factory=list)  # SpeCacheGroup per payload layout (Triton path)
    plan: ForwardPlan = NO_PLAN  # what the worker planned for this forward (staging, in-pool drafts)


@dataclasses.dataclass
class InPoolViews:
    """The re-selected view's drafters, built once per forward on the device (their
    positions differ per layer and KV head)."""

    q_rows: torch.Tensor  # [n] their query rows in the forward
    lengths: torch.Tensor  # [n] attendable positions
    rows: torch.Tensor  # [n] req_pool_idx
    selected: torch.Tensor  # [n, layers, Hkv, K]
    n_selected: torch.Tensor  # [n]
    recent: torch.Tensor  # [n]
    recent_width: int


@dataclasses.dataclass
class DraftIndex:
    """The drafters' one token each, attended in one launch per layer."""

    index: DecodeIndex  # their live pool rows and query positions
    q_rows: torch.Tensor  # their query rows in the forward
    members: list[int]  # their request indices in the forward


@dataclasses.dataclass
class SpeCacheGroup:
    """SpeCache drafters of one payload layout, drafted together in each layer."""

    batch: "SpeCacheBatch"
    q_rows: torch.Tensor  # their query rows in the forward


class _TorchNative:
    """SGLang's ``torch_native`` backend (the base of the project's backends) as the
    full-KV backend object: its extend over the pool, metadata included."""

    def __init__(self, backend):
        self.backend = backend

    def init_forward_metadata(self, forward_batch):
        TorchNativeAttnBackend.init_forward_metadata(self.backend, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return TorchNativeAttnBackend.forward_extend(self.backend, q, k, v, layer, forward_batch, save_kv_cache)
