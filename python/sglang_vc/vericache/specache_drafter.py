"""SpeCache as VERICACHE's drafter (``--vc-compressor specache --vc-kv-bits {1,2}``).

The device keeps SpeCache's low-bit KIVI copy of the prompt (the ``specache``
compressor's payload) and VERICACHE keeps the full KV on the host for its verify anyway.
A draft token attends over the low-bit copy with full-precision rows put back (eq. 1 of
SpeCache) and picks the rows the next draft step of that layer will want: its own
top-k rows per KV head (SpeCache's speculative fetch: the choice is made one step early
and the rows are copied while later layers and steps compute). After the forward's last
layer one job on a copy thread copies every pick of every drafting request and layer
from VERICACHE's host copy (pinned, asynchronous, on the copy stream after an event of
the forward), and the next forward's first draft attention takes them all (its stream
waits on the copy's event; nothing on the scheduler thread reads a device value). A
request with nothing prefetched yet (its first draft step) fetches its own top-k
synchronously, the non-speculative mode (``specache_sync_fetches``).
Rows of a tree-shared prefix (positions ``[0, p)``) are full precision in the device
pool already and are read from there.

The drafter never reads the full KV of a row it did not select: the payload stays
low-bit, and only ``topk`` rows per KV head come back. Its drafts are then verified
against the full KV as any drafter's, so the output is full-KV decoding's whatever the
drafter proposes. A request whose host copy is gone (e.g. it was restored to full KV
after a failed reload) drafts from the plain low-bit copy (counted as
``specache_fetch_misses``); a prefetch that failed is redone synchronously.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream
from sglang_vc.specache import core
from sglang_vc.specache.requests import request_topk

from .reload import HostEntry, HostKVStore

logger = logging.getLogger(__name__)

STATS = "vericache"


@dataclasses.dataclass
class _Pick:
    """The rows one request chose for its next draft step of one layer."""

    positions: torch.Tensor  # [H, k] on the device
    host_entry: "HostEntry"
    layer_id: int


class SpeCacheDrafter:
    def __init__(self, host: HostKVStore, runtime, topk: int, copy_stream: Optional[CopyStream] = None):
        self.host = host
        self.runtime = runtime
        self.topk = topk
        self.topk_of: dict[str, int] = {}  # rid -> the request's own top-k (custom_params)
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream("cpu")
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-specache-prefetch")
        self._picks: dict[tuple[str, int], _Pick] = {}  # this forward's choices
        self._copying: Optional[Future] = None  # the last forward's choices, being copied
        self._ready: dict[tuple[str, int], core.Rows] = {}  # landed, waiting for their step

    def set_request(self, rid: str, custom_params) -> None:
        self.topk_of[rid] = request_topk(custom_params, self.topk)

    def forget(self, live: set[str]) -> None:
        for rid in [r for r in self.topk_of if r not in live]:
            del self.topk_of[rid]
        for key in [k for k in self._ready if k[0] not in live]:
            del self._ready[key]

    def attend(self, q: torch.Tensor, entry, layer, seq_len: int) -> Optional[torch.Tensor]:
        """The draft attention of one request in one layer (``q [1, Hq, D]`` at position
        ``seq_len - 1``), or None when this request is not SpeCache-drafted."""
        if entry.payload is None:
            return None
        host_entry = self.host.get(entry.rid, entry.req_pool_idx)
        topk = self.topk_of.get(entry.rid, self.topk)
        lid = layer.layer_id
        kq, vq = self.runtime.payload_kv(entry, lid)
        k_buf = self.runtime.kv_pool.get_key_buffer(lid)
        v_buf = self.runtime.kv_pool.get_value_buffer(lid)
        row = self.runtime.req_to_token[entry.req_pool_idx]
        tail = row[entry.num_payload_rows : seq_len].to(torch.int64)
        k_tail, v_tail = k_buf[tail], v_buf[tail]
        if host_entry is None or topk == 0:
            if host_entry is None:
                stats.add(STATS, specache_fetch_misses=1)
            return core.attend(q, kq, vq, k_tail, v_tail, q_start=seq_len - 1, scale=layer.scaling).out
        rows = self._take(entry.rid, lid)
        if rows is None:  # nothing prefetched (its first draft step): fetch its own top-k now
            res, _ = core.attend_fetching(
                q, kq, vq, k_tail, v_tail, q_start=seq_len - 1, scale=layer.scaling, topk=topk,
                fetch=lambda positions: self._rows(host_entry, lid, positions, row, k_buf, v_buf))
            stats.add(STATS, specache_sync_fetches=1)
        else:
            rows = self._with_tree_prefix(rows, host_entry.p, row, k_buf, v_buf)
            res = core.attend(q, kq, vq, k_tail, v_tail, q_start=seq_len - 1, scale=layer.scaling, rows=rows)
        # the rows this layer's next draft step will want, copied while later work computes
        self._picks[(entry.rid, lid)] = _Pick(core.select_topk(res.probs[0], kq.shape[1], topk), host_entry, lid)
        return res.out

    # ------------------------------------------------------------------ prefetch

    def end_forward(self) -> None:
        """After the forward's last layer: one copy job for every pick of the forward."""
        if not self._picks:
            return
        picks, self._picks = self._picks, {}
        self._collect()  # an older job's rows first (a forward without draft steps between)
        self._copying = self.thread.submit(self.copy_stream.copy, lambda: self._fetch_all(picks),
                                           self.copy_stream.mark())

    def _fetch_all(self, picks: dict) -> dict:
        """On the copy thread: each pick's full-precision rows from the host copy."""
        out, rows_fetched, nbytes = {}, 0, 0
        for key, pick in picks.items():
            pick.host_entry.wait()  # its copies to the host have landed
            span = pick.host_entry.span(pick.layer_id)
            host = core.gather_rows(span.k, span.v, (pick.positions.to("cpu") - span.p).clamp(min=0))
            k, v = host.k, host.v
            if self.copy_stream.stream is not None:
                k, v = k.pin_memory(), v.pin_memory()
            nb = self.copy_stream.stream is not None
            dev = pick.positions.device
            out[key] = core.Rows(pick.positions, k.to(dev, non_blocking=nb), v.to(dev, non_blocking=nb))
            rows_fetched += pick.positions.numel()
            nbytes += out[key].nbytes()
        stats.add(STATS, specache_rows_fetched=rows_fetched, specache_bytes_fetched=nbytes)  # the job at once
        return out

    def _collect(self) -> None:
        """The last copy job's rows, landed (the current stream waits on its event)."""
        job, self._copying = self._copying, None
        if job is None:
            return
        try:
            rows, event = job.result()
        except Exception as exc:  # the slower correct path: the next steps fetch synchronously
            logger.warning("VERICACHE: SpeCache drafter prefetch failed (%s); fetching synchronously", exc)
            stats.add(STATS, specache_prefetch_failures=1)
            return
        self.copy_stream.wait(event, (t for r in rows.values() for t in (r.k, r.v)))
        self._ready.update(rows)

    def _take(self, rid: str, layer_id: int) -> Optional[core.Rows]:
        self._collect()
        return self._ready.pop((rid, layer_id), None)

    @staticmethod
    def _with_tree_prefix(rows: core.Rows, p: int, row: torch.Tensor, k_buf: torch.Tensor,
                          v_buf: torch.Tensor) -> core.Rows:
        """Positions below a tree-shared prefix ``p`` read from the pool (the host copy
        holds ``[p, n)`` only); device work, no host read."""
        if p == 0:
            return core.Rows(rows.positions, rows.k.to(k_buf.dtype), rows.v.to(v_buf.dtype))
        slots = row[:p].to(torch.int64)
        dev_rows = core.gather_rows(k_buf[slots], v_buf[slots], rows.positions.clamp(max=p - 1).to(row.device))
        in_pool = (rows.positions < p).t().to(k_buf.device).unsqueeze(-1)  # [k, H, 1]
        return core.Rows(rows.positions, torch.where(in_pool, dev_rows.k, rows.k.to(k_buf.dtype)),
                         torch.where(in_pool, dev_rows.v, rows.v.to(v_buf.dtype)))

    @staticmethod
    def _rows(host_entry, layer_id: int, positions: torch.Tensor, row: torch.Tensor,
              k_buf: torch.Tensor, v_buf: torch.Tensor) -> core.Rows:
        """Full-precision rows ``positions [H, k]`` fetched now: from the host copy
        (``[p, n)``), or from the pool for a tree-shared prefix ``[0, p)``."""
        host_entry.wait()  # its copies to the host have landed
        span = host_entry.span(layer_id)
        host = core.gather_rows(span.k, span.v, (positions.to("cpu") - span.p).clamp(min=0))
        rows = core.Rows(positions, host.k.to(k_buf.device), host.v.to(k_buf.device))
        stats.add(STATS, specache_rows_fetched=positions.numel(), specache_bytes_fetched=rows.nbytes())
        return SpeCacheDrafter._with_tree_prefix(rows, span.p, row, k_buf, v_buf)
