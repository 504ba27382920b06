"""SpeCache's step attention on the Triton path (CUDA): eq. 1 without dequantizing the
payload into a copy, and the top-k from the low-bit keys on the device.

The same computation as :func:`.core.attend` (which the CPU path runs), split into three
partial attentions merged by their log-sum-exps (``sgl_kernel_ext``):

* the payload's packed KIVI codes, dequantized inside the kernel, leaving out the rows
  that were prefetched (``exclude``);
* the prefetched full-precision rows, per KV head its own;
* the full-precision tail, read from the pool through its slots, causal by position.

A query row's scores over the payload (for the next step's top-k and the prefetch
counters) are computed when asked, from its log-sum-exp: the payload rows' from the
codes, the prefetched rows' from their full keys.
"""

from __future__ import annotations

from typing import Optional

import sgl_kernel_ext as ext
import torch
from torch import Tensor

from .core import Attended, Rows


def _rows_attention(q: Tensor, rows: Rows, scale: float) -> tuple[Tensor, Tensor]:
    """Each KV head's query heads over that head's own full-precision rows (all visible):
    float32 ``(out [T, Hq, Dv], lse [T, Hq])``. A few batched torch ops for every head (the
    rows are few, SpeCache's top-k), nothing sent from the host."""
    t, hq, d = q.shape
    h = rows.positions.shape[0]
    qg = q.float().view(t, h, hq // h, d)
    s = torch.einsum("thgd,khd->thgk", qg, rows.k.float()) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("thgk,khd->thgd", torch.exp(s - lse.unsqueeze(-1)), rows.v.float())
    return out.reshape(t, hq, -1), lse.reshape(t, hq)


def attend(q: Tensor, payload: ext.Payload, k_buf: Tensor, v_buf: Tensor, tail_slots: Tensor, *, q_start: int,
           scale: float, rows: Optional[Rows] = None) -> Attended:
    """Eq. 1 for one request: ``q [T, Hq, D]`` at positions ``q_start ..`` over the payload
    (positions ``0 .. n_q-1``, ``rows`` substituted) and the tail ``k_buf[tail_slots]`` at
    positions ``n_q ..``."""
    t, hq, _ = q.shape
    n_q, h = payload.num_tokens, payload.k_payload.shape[1]
    dev = q.device
    exclude = None
    if rows is not None and rows.num_rows:
        exclude = torch.zeros(h, n_q, dtype=torch.bool, device=dev).scatter_(1, rows.positions.to(dev), True)
    out, lse = ext.kivi_attention(q, payload, scale, exclude=exclude)
    if exclude is not None:
        out, lse = ext.merge_state(out, lse, *_rows_attention(q, rows, scale))
    m = tail_slots.numel()
    indptr = torch.arange(2, device=dev) * m  # [0, m], built on the device
    tail_out, tail_lse = ext.paged_attention(
        q, k_buf, v_buf, torch.zeros(t, dtype=torch.int64, device=dev),
        torch.arange(q_start, q_start + t, device=dev), indptr, tail_slots.to(torch.int64),
        torch.arange(n_q, n_q + m, device=dev), scale)
    out, lse = ext.merge_state(out, lse, tail_out, tail_lse)

    def scores_of(i: int) -> Tensor:
        scores = ext.payload_scores(q[i], lse[i], payload, scale, exclude=exclude)
        if exclude is not None:
            g = hq // h
            qg = q[i].float().view(h, g, -1)
            s = torch.einsum("hgd,khd->hgk", qg, rows.k.float()) * scale
            probs = torch.exp(s - lse[i].view(h, g, 1)).sum(1)  # [H, k]
            scores.scatter_add_(1, rows.positions.to(dev), probs)
        return scores

    return Attended(out.to(q.dtype), None, scores_of)
