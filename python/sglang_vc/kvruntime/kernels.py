"""Pure-torch kernels of lossy serving: gather a compressed request's KV, attend over it,
and compact rows after an online eviction.

The layout contract (see :mod:`.index`): a request's keys are a *prefix* of rows every
query sees (compressed or dequantized rows) followed by a *tail* of ordinary rows at
consecutive positions ``tail_start, tail_start + 1, ...``, causal as usual. A GPU version
(FlashInfer/Triton paged attention with a per-request index of prefix slots) implements
the same three functions.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention


def gather_kv(
    k_buf: Tensor,
    v_buf: Tensor,
    slots: Tensor,
    prefix_k: Optional[Tensor] = None,
    prefix_v: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``[prefix] ++ buf[slots]`` for K and V, ``[N, H, D]`` each (a copy)."""
    k, v = k_buf[slots], v_buf[slots]
    if prefix_k is not None and prefix_k.shape[0]:
        k = torch.cat([prefix_k.to(k.dtype), k])
        v = torch.cat([prefix_v.to(v.dtype), v])
    return k, v


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    num_prefix: int,
    tail_start: int,
    q_start: int,
    scale: Optional[float],
    enable_gqa: bool,
) -> Tensor:
    """Softmax attention of one request: ``q [T, Hq, D]`` at positions ``q_start ..``
    over ``k/v [N, Hkv, D]`` whose first ``num_prefix`` rows are visible to every query
    and whose other rows sit at positions ``tail_start ..`` (causal). Returns
    ``[T, Hq, Dv]``. With one query that sees every row (decode) no mask is built, so the
    call is the same as SGLang's torch-native decode on the same rows."""
    t, n = q.shape[0], k.shape[0]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    n_tail = n - num_prefix
    mask = None
    if q_start + t - 1 < tail_start + n_tail - 1 or t > 1:
        q_pos = torch.arange(q_start, q_start + t, device=q.device)
        tail_pos = torch.arange(tail_start, tail_start + n_tail, device=q.device)
        visible = tail_pos.view(1, -1) <= q_pos.view(-1, 1)
        mask = torch.cat([visible.new_ones(t, num_prefix), visible], dim=1)
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0),
        k.movedim(0, 1).unsqueeze(0),
        v.movedim(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=enable_gqa,
        scale=scale,
        is_causal=False,
    )
    return out.squeeze(0).movedim(0, 1)


def keep_rows(rows: Tensor, keep_idx: Tensor) -> Tensor:
    """Per-head row selection: ``rows [m, H, D]``, ``keep_idx [H, m']`` (row indices per
    head) -> ``[m', H, D]`` with ``out[j, h] = rows[keep_idx[h, j], h]``."""
    idx = keep_idx.t().unsqueeze(-1).expand(-1, -1, rows.shape[2])
    return rows.gather(0, idx)


def write_rows(buf: Tensor, slots: Tensor, rows: Tensor) -> None:
    """``buf[slots] = rows`` (pool layout ``[num_slots, H, D]``)."""
    buf.index_copy_(0, slots, rows.to(buf.dtype))
