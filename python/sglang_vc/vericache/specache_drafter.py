"""SpeCache as VERICACHE's drafter (``--vc-compressor specache --vc-kv-bits {1,2}``).

The device keeps SpeCache's low-bit KIVI copy of the prompt (the ``specache``
compressor's payload) and VERICACHE keeps the full KV on the host for its verify anyway.
A draft token attends over the low-bit copy, takes its own top-k rows per layer and KV
head, fetches their full-precision values from that host copy and attends again with
them put back (eq. 1 of SpeCache, its non-speculative fetch: a draft forward carries one
token per request, so there is no speculative token to pick the rows one step early).
Rows of a tree-shared prefix (positions ``[0, p)``) are full precision in the device
pool already and are read from there.

The drafter never reads the full KV of a row it did not select: the payload stays
low-bit, and only ``topk`` rows per KV head come back. Its drafts are then verified
against the full KV as any drafter's, so the output is full-KV decoding's whatever the
drafter proposes. A request whose host copy is gone (e.g. it was restored to full KV
after a failed reload) drafts from the plain low-bit copy (counted as
``specache_fetch_misses``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext.dispatch import on_device
from sgl_kernel_ext.payload_batch import to_device

from sglang_vc import stats
from sglang_vc.kvruntime import NULL_SLOT, payload_table
from sglang_vc.specache import core, fused
from sglang_vc.specache.requests import request_topk

from .reload import HostKVStore

STATS = "vericache"
# the smallest buckets of the launch shapes (``sgl_kernel_ext.bucket``): all tails' rows
# together and the top-k width; the payload rows' is ``payload_table.ROWS_BUCKET``
TAIL_BUCKET = 64
TOPK_BUCKET = 8


@dataclasses.dataclass
class SpeCacheBatch:
    """What every layer of one forward reads to draft a group of SpeCache requests (one
    payload layout) together on the Triton path: built once per forward, on the device.

    Its launches are sized by :attr:`shape` only -- the batch size and bucketed sizes
    (payload rows, tail rows, top-k), never the lengths themselves -- so a CUDA graph
    captured over one batch replays any other of the same shape once :meth:`load` has
    copied that batch's tables into this one's."""

    members: list[int]  # the requests' indices in the caller's list
    payloads: payload_table.PayloadTable
    tail: ext.KVIndices  # each request's pool rows [payload rows, seq_len)
    q_req: torch.Tensor  # [B] 0 .. B-1
    q_pos: torch.Tensor  # [B] each draft query's position (seq_len - 1)
    rows: torch.Tensor  # [B] req_pool_idx
    shared: torch.Tensor  # [B] tree-shared prefix length p (its full rows are in the pool)
    topk: torch.Tensor  # [B] int32 rows fetched per KV head (0: no host copy, no fetch)
    host: Optional[torch.Tensor]  # [L, B, 2] int64 addresses of each layer's host K and V (0: none)
    host_like: dict  # layer_id -> one request's host K copy (dtype and strides of them all)
    k_max: int  # the launches' top-k width: the largest top-k, bucketed (0: no request fetches)
    rows_fetched: int  # rows fetched per layer, all requests and KV heads (for the stats)
    host_entries: list  # HostEntry or None per request (the torch path reads their tensors)

    @property
    def misses(self) -> int:
        """Requests without a host copy: they draft from the plain low-bit copy."""
        return sum(h is None for h in self.host_entries)

    def _tables(self) -> list[torch.Tensor]:
        t = [self.payloads.ptrs, self.payloads.num_tokens, *self.tail, self.q_req, self.q_pos, self.rows,
             self.shared, self.topk]
        return t if self.host is None else [*t, self.host]

    @property
    def shape(self) -> tuple:
        """What sizes and compiles this batch's launches: equal shapes, equal grids,
        constants and buffers (the payload layout and the host copies' dtype included)."""
        host = next(iter(self.host_like.values()), None)
        return (self.payloads.max_tokens, self.k_max, tuple(self.payloads.index.items()), self.payloads.layout,
                None if host is None else (host.dtype, host.stride()),
                *(tuple(t.shape) for t in self._tables()))

    def load(self, other: "SpeCacheBatch") -> None:
        """Copy ``other``'s device tables into this batch's, on the current stream (no host
        wait): the launches recorded over this batch (a CUDA graph) then draft ``other``'s
        requests. The two must have one :attr:`shape`."""
        if other.shape != self.shape:
            raise ValueError(f"SpeCacheBatch.load: shape {other.shape} is not this batch's {self.shape}")
        for dst, src in zip(self._tables(), other._tables()):
            dst.copy_(src, non_blocking=True)
        self.members, self.rows_fetched, self.host_entries = other.members, other.rows_fetched, other.host_entries


class SpeCacheDrafter:
    def __init__(self, host: HostKVStore, runtime, topk: int):
        self.host = host
        self.runtime = runtime
        self.topk = topk
        self.topk_of: dict[str, int] = {}  # rid -> the request's own top-k (custom_params)

    def set_request(self, rid: str, custom_params) -> None:
        self.topk_of[rid] = request_topk(custom_params, self.topk)

    def forget(self, live: set[str]) -> None:
        for rid in [r for r in self.topk_of if r not in live]:
            del self.topk_of[rid]

    def attend(self, q: torch.Tensor, entry, layer, seq_len: int) -> Optional[torch.Tensor]:
        """The draft attention of one request in one layer (``q [1, Hq, D]`` at position
        ``seq_len - 1``), or None when this request is not SpeCache-drafted."""
        if entry.payload is None:
            return None
        host_entry = self.host.get(entry.rid, entry.req_pool_idx)
        topk = self.topk_of.get(entry.rid, self.topk)
        lid = layer.layer_id
        k_buf = self.runtime.kv_pool.get_key_buffer(lid)
        v_buf = self.runtime.kv_pool.get_value_buffer(lid)
        row = self.runtime.req_to_token[entry.req_pool_idx]
        tail = row[entry.num_payload_rows : seq_len].to(torch.int64)
        if host_entry is None:
            stats.add(STATS, specache_fetch_misses=1)
        fetching = host_entry is not None and topk > 0

        def fetch(positions: torch.Tensor) -> core.Rows:
            return self._rows(host_entry, lid, positions, row, k_buf, v_buf)

        if ext.backend_for(k_buf) is ext.Backend.TRITON:
            # the fused kernels over the packed payload and the pool (no dequantized copy)
            payload = self.runtime.packed_payload(entry, lid)

            def run(rows):
                return fused.attend(q, payload, k_buf, v_buf, tail, q_start=seq_len - 1, scale=layer.scaling,
                                    rows=rows)

            first = run(None)
            if not fetching:
                return first.out
            rows = fetch(ext.select_topk(first.head_scores(0, k_buf.shape[1]), topk))
            out = run(rows).out
        else:
            kq, vq = self.runtime.payload_kv(entry, lid)
            k_tail, v_tail = k_buf[tail], v_buf[tail]
            if not fetching:
                return core.attend(q, kq, vq, k_tail, v_tail, q_start=seq_len - 1, scale=layer.scaling).out
            res, rows = core.attend_fetching(q, kq, vq, k_tail, v_tail, q_start=seq_len - 1, scale=layer.scaling,
                                             topk=topk, fetch=fetch)
            out = res.out
        stats.add(STATS, specache_rows_fetched=rows.num_rows * rows.positions.shape[0],
                  specache_bytes_fetched=rows.nbytes())
        return out

    def batch(self, entries: Sequence, seq_lens: Sequence[int], device) -> list[SpeCacheBatch]:
        """The Triton path's per-forward state for SpeCache requests ``entries`` (each with
        a payload) drafting one token each, ``seq_lens`` counting that token: one
        :class:`SpeCacheBatch` per payload layout (one for a server's own bits)."""
        out = []
        for members in payload_table.group_by_layout(self.runtime, entries):
            es = [entries[i] for i in members]
            host = [self.host.get(e.rid, e.req_pool_idx) for e in es]
            for h in host:
                if h is not None:
                    h.wait()  # its copies to the host have landed (blocks once per request)
            topk = [0 if h is None else self.topk_of.get(e.rid, self.topk) for e, h in zip(es, host)]
            lens = [seq_lens[i] for i in members]
            rows = [e.req_pool_idx for e in es]
            req_to_token = self.runtime.req_to_token
            up = lambda x, dtype=torch.int64: to_device(torch.tensor(x, dtype=dtype), device)  # noqa: E731
            firsts = [e.num_payload_rows for e in es]
            spans = [n - f for n, f in zip(lens, firsts)]
            tail = ext.build_kv_indices(req_to_token, up(rows), up(firsts), up(lens), NULL_SLOT, spans=spans,
                                        capacity=ext.bucket(sum(spans), TAIL_BUCKET))
            k_max = ext.bucket(max(topk), TOPK_BUCKET)
            host_t, host_like = None, {}
            if k_max > 0:
                layer_ids = sorted(es[0].payload.layers)  # the payload table's layers, in its order
                host_t = to_device(torch.stack([self._host_addresses(h, layer_ids) for h in host], dim=1), device)
                ref = next(h for h in host if h is not None)
                host_like = {lid: ref.k[lid] for lid in layer_ids}
            table = payload_table.build(self.runtime, es, device)
            heads = next(iter(table.like.values())).k_payload.shape[1]
            fetched = sum(min(k, e.num_payload_rows) for k, e in zip(topk, es)) * heads
            out.append(SpeCacheBatch(
                members, table, tail,
                torch.arange(len(es), device=device), up([n - 1 for n in lens]), up(rows),
                up([0 if h is None else h.p for h in host]), up(topk, torch.int32), host_t, host_like, k_max,
                fetched, host))
        return out

    @staticmethod
    def _host_addresses(host_entry, layer_ids: list[int]) -> torch.Tensor:
        """``[L, 2]`` int64: each layer's host K and V addresses (zeros: no host copy)."""
        if host_entry is None:
            return torch.zeros(len(layer_ids), 2, dtype=torch.int64)
        if host_entry.addresses is None:
            host_entry.addresses = torch.tensor([[host_entry.k[lid].data_ptr(), host_entry.v[lid].data_ptr()]
                                                 for lid in layer_ids], dtype=torch.int64)
        return host_entry.addresses

    def attend_batch(self, q: torch.Tensor, sb: SpeCacheBatch, layer) -> torch.Tensor:
        """SpeCache's draft attention of a group of requests in one layer (``q [B, Hq, D]``,
        one query each), in a fixed number of launches whatever ``B`` (issue #46):
        the payloads and the tails attended (the log-sum-exps that score the rows), every
        request's top-k rows per KV head chosen on the device and read from the pool or
        its pinned host copy, then the payloads again without those rows, merged with the
        rows' attention and the tails'. The same result as :meth:`attend` per request."""
        lid = layer.layer_id
        k_buf = self.runtime.kv_pool.get_key_buffer(lid)
        v_buf = self.runtime.kv_pool.get_value_buffer(lid)
        pb = sb.payloads.layer(lid)
        scale = layer.scaling
        if sb.misses:  # counted per request and layer, as the per-request path counts them
            stats.add(STATS, specache_fetch_misses=sb.misses)
        p_out, p_lse = ext.kivi_attention_batch(q, pb, scale)
        t_out, t_lse = ext.paged_attention(q, k_buf, v_buf, sb.q_req, sb.q_pos, sb.tail.indptr, sb.tail.indices,
                                           sb.tail.positions, scale)
        if sb.k_max == 0 or pb.max_tokens == 0:
            return ext.merge_state(p_out, p_lse, t_out, t_lse)[0]
        # the rows' scores need the log-sum-exp over all keys: the payload's and the tail's
        scores = ext.payload_scores_batch(q, p_lse, pb, scale, lse2=t_lse)
        pos = scores.topk(min(sb.k_max, pb.max_tokens), dim=-1).indices
        host_k = host_v = None
        if ext.backend_for(q) is ext.Backend.TORCH:  # the reference reads the host tensors themselves
            host_k = [None if h is None else h.k[lid] for h in sb.host_entries]
            host_v = [None if h is None else h.v[lid] for h in sb.host_entries]
        fetched = ext.fetch_rows(pos, sb.host[sb.payloads.index[lid]], sb.host_like[lid], sb.shared, sb.topk,
                                 pb.num_tokens, sb.rows, self.runtime.req_to_token, k_buf, v_buf, host_k, host_v)
        # the payload without the fetched rows, merged with their attention and the tail's
        out, _ = ext.kivi_attention_batch(q, pb, scale, exclude=fetched.selected,
                                          merge=(ext.rows_attention(q, fetched, scale), (t_out, t_lse)))
        stats.add(STATS, specache_rows_fetched=sb.rows_fetched,
                  specache_bytes_fetched=sb.rows_fetched * (k_buf.shape[2] + v_buf.shape[2])
                  * sb.host_like[lid].element_size())
        return out

    @staticmethod
    def _rows(host_entry, layer_id: int, positions: torch.Tensor, row: torch.Tensor,
              k_buf: torch.Tensor, v_buf: torch.Tensor) -> core.Rows:
        """Full-precision rows ``positions [H, k]``: from the host copy (``[p, n)``), or
        from the pool for a tree-shared prefix ``[0, p)``. On CUDA the GPU reads the
        pinned host copy itself at indices that never leave the device
        (``sgl_kernel_ext.gather_head_rows``): no host round trip per request and layer."""
        host_entry.wait()  # its copies to the host have landed (blocks once per request)
        span = host_entry.span(layer_id)
        p = span.p
        dev = k_buf.device
        rel = (positions - p).clamp(min=0)
        k = on_device(ext.gather_head_rows(span.k, rel), dev).to(k_buf.dtype)
        v = on_device(ext.gather_head_rows(span.v, rel), dev).to(v_buf.dtype)
        if p > 0:  # rows of a tree-shared prefix come from the pool (no host read to test for them)
            shared = positions.clamp(max=p - 1)  # positions, row and the pool: one device
            slots = row[:p].to(torch.int64)
            dev_rows = core.gather_rows(k_buf[slots], v_buf[slots], shared)
            in_pool = (positions < p).t().unsqueeze(-1)  # [k, H, 1]
            k, v = torch.where(in_pool, dev_rows.k, k), torch.where(in_pool, dev_rows.v, v)
        return core.Rows(positions, k, v)
