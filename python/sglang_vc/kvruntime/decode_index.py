"""A decode forward's compressed requests attended together on the Triton path: each
request's live pool rows and each quantized request's packed payload, read through
tables built once per forward (:class:`DecodeIndex`), in one paged attention launch per
layer plus one payload launch per payload layout (:func:`attend`).

``vc_torch``'s batched decode and VERICACHE's drafters (KIVI, token dropping) run these;
no SGLang import here, so the GPU check times the server's own functions on a machine
without SGLang. Where the host knows the lengths, the tables' shapes depend on the batch
size, which requests have payloads of which layout, and buckets of the lengths (four per
doubling, :func:`sgl_kernel_ext.bucket`), so launches over one index replay for another
of its :attr:`DecodeIndex.shape` once :meth:`DecodeIndex.load` copied it in.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext.payload_batch import to_device

from . import payload_table
from .names import NULL_SLOT


@dataclasses.dataclass
class PayloadGroup:
    rows: Optional[torch.Tensor]  # their rows in the batch; None: every row, in order
    table: payload_table.PayloadTable


@dataclasses.dataclass
class DecodeIndex:
    """What every layer of one decode forward reads on the Triton path, built once."""

    kv: ext.KVIndices  # each request's live pool rows
    q_req: torch.Tensor  # [B] the request of each query row (0 .. B-1)
    q_pos: torch.Tensor  # [B] each query's position (seq_len - 1)
    # the requests with a quantized payload, per payload layout: attended in one launch
    # per layer and group
    payloads: list[PayloadGroup] = dataclasses.field(default_factory=list)

    def _tables(self) -> list[torch.Tensor]:
        out = [*self.kv, self.q_req, self.q_pos]
        for g in self.payloads:
            out += [g.table.ptrs, g.table.num_tokens] + ([] if g.rows is None else [g.rows])
        return out

    @property
    def shape(self) -> tuple:
        """What sizes and compiles the launches over this index (the lists' capacity, each
        payload group's bucketed rows and layout): equal shapes, equal grids, constants
        and buffers."""
        return (tuple((g.table.max_tokens, g.table.layout, tuple(g.table.index.items()), g.rows is None)
                      for g in self.payloads),
                *(tuple(t.shape) for t in self._tables()))

    def load(self, other: "DecodeIndex") -> None:
        """Copy ``other``'s device tables into this index's, on the current stream: the
        launches recorded over this index (a CUDA graph) then attend ``other``'s requests.
        The two must have one :attr:`shape`."""
        if other.shape != self.shape:
            raise ValueError(f"DecodeIndex.load: shape {other.shape} is not this index's {self.shape}")
        for dst, src in zip(self._tables(), other._tables()):
            dst.copy_(src, non_blocking=True)


def payload_groups(runtime, entries: list, device) -> list[PayloadGroup]:
    """A :class:`PayloadGroup` per payload layout of the ``entries`` (None: none) that
    have a quantized payload: built once per forward, read by every layer."""
    members = [i for i, e in enumerate(entries) if e is not None and e.num_payload_rows]
    out = []
    for group in payload_table.group_by_layout(runtime, [entries[i] for i in members]):
        rows = [members[j] for j in group]
        out.append(PayloadGroup(None if rows == list(range(len(entries))) else
                                to_device(torch.tensor(rows, dtype=torch.int64), device),
                                payload_table.build(runtime, [entries[i] for i in rows], device)))
    return out


def build(runtime, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
          seq_lens_host: Optional[Sequence[int]], firsts: Sequence[int], entries: list) -> DecodeIndex:
    """Request ``b``'s live pool rows ``[firsts[b], seq_lens[b])`` (``rows``: its
    ``req_to_token`` row; ``seq_lens_host``: the lengths as the host knows them, or None:
    then the lists' size is read from the device) and the payloads of ``entries`` (None:
    none): one index kernel for all layers of the forward."""
    dev = seq_lens.device
    spans = None if seq_lens_host is None else [n - f for n, f in zip(seq_lens_host, firsts)]
    # lists of a bucketed size: the launches depend on the bucket, not the lengths
    capacity = None if spans is None else ext.bucket(sum(spans), payload_table.ROWS_BUCKET)
    kv = ext.build_kv_indices(req_to_token, rows, to_device(torch.tensor(list(firsts)), dev), seq_lens, NULL_SLOT,
                              spans=spans, capacity=capacity)
    return DecodeIndex(kv, torch.arange(seq_lens.numel(), device=dev), seq_lens.to(torch.int64) - 1,
                       payload_groups(runtime, entries, dev))


def attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, idx: DecodeIndex, layer_id: int,
           scale: float) -> torch.Tensor:
    """One query per request (``q [B, Hq, D]``) over its live pool rows (``idx``), one
    paged attention launch, merged by log-sum-exp with the quantized requests' payloads,
    attended from their packed codes in one launch per payload layout. Float32
    ``[B, Hq, Dv]``."""
    out, lse = ext.paged_attention(q, k_buf, v_buf, idx.q_req, idx.q_pos, idx.kv.indptr, idx.kv.indices,
                                   idx.kv.positions, scale)
    for group in idx.payloads:  # the payloads, merged with the rows' states in the same launch
        if group.rows is None:
            out, lse = ext.kivi_attention_batch(q, group.table.layer(layer_id), scale, merge=((out, lse),))
        else:
            r = group.rows
            out[r], lse[r] = ext.kivi_attention_batch(q[r], group.table.layer(layer_id), scale,
                                                      merge=((out[r], lse[r]),))
    return out
