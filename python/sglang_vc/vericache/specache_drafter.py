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

from typing import Optional

import sgl_kernel_ext as ext
import torch

from sglang_vc import stats
from sglang_vc.specache import core, fused
from sglang_vc.specache.requests import request_topk

from .reload import HostKVStore

STATS = "vericache"


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
        k = ext.gather_head_rows(span.k, rel).to(dev, k_buf.dtype)
        v = ext.gather_head_rows(span.v, rel).to(dev, v_buf.dtype)
        if p > 0:  # rows of a tree-shared prefix come from the pool (no host read to test for them)
            shared = positions.clamp(max=p - 1).to(row.device)
            slots = row[:p].to(torch.int64)
            dev_rows = core.gather_rows(k_buf[slots], v_buf[slots], shared)
            in_pool = (positions < p).t().to(dev).unsqueeze(-1)  # [k, H, 1]
            k, v = torch.where(in_pool, dev_rows.k, k), torch.where(in_pool, dev_rows.v, v)
        return core.Rows(positions, k, v)
