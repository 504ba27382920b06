"""Pure-torch kernels of the compressed-KV runtime: find a request's live rows, gather
them, attend over them, and compact rows after an online eviction.

The layout contract (see :mod:`.index`): a request's keys are an optional *prefix* of rows
every query sees (dequantized payload rows) followed by pool rows at known row positions,
causal by position; row positions whose slot is ``NULL_SLOT`` (dropped tokens) are not
rows at all.

On CUDA (``sgl_kernel_ext.backend_for``) the index lists are built on the device and the
attention runs ``sgl_kernel_ext``'s Triton kernels (:func:`attend_pool` reads the pool
through the index list with no gather, a quantized payload is dequantized inside the
attention); on the CPU the torch code below runs.
"""

from __future__ import annotations

from typing import Optional

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext.dispatch import on_device
from sgl_kernel_ext.payload_batch import to_device
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from .names import NULL_SLOT


def live_rows(row: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    """Slots and row positions of the live (non-null) entries of ``row[start:end]``."""
    if ext.backend_for(row) is ext.Backend.TRITON:
        one = torch.zeros(1, dtype=torch.int64, device=row.device)
        built = ext.build_kv_indices(row.unsqueeze(0), one, one + start, one + end, NULL_SLOT)
        return built.indices, built.positions
    slots = row[start:end].to(torch.int64)
    live = slots != NULL_SLOT
    positions = torch.arange(start, end, device=slots.device)
    if bool(live.all()):
        return slots, positions
    return slots[live], positions[live]


def live_rows_batch(req_to_token: Tensor, rows: list[int], starts: list[int],
                    ends: list[int]) -> tuple[Tensor, Tensor, list[int]]:
    """:func:`live_rows` of many requests at once, ``(slots, positions, indptr)``: request
    ``b``'s live rows of ``req_to_token[rows[b], starts[b]:ends[b]]`` are entries
    ``indptr[b] .. indptr[b + 1]``. One host synchronisation (``indptr``), whatever the
    number of requests; built once per forward, read by every layer."""
    dev = req_to_token.device
    rows_t, starts_t, ends_t = (to_device(torch.tensor(x, dtype=torch.int64), dev) for x in (rows, starts, ends))
    if ext.backend_for(req_to_token) is ext.Backend.TRITON:
        built = ext.build_kv_indices(req_to_token, rows_t, starts_t, ends_t, NULL_SLOT)
        return built.indices, built.positions, built.indptr.tolist()
    width = max(ends, default=0)
    cols = torch.arange(width, device=dev)
    table = req_to_token[rows_t, :width].to(torch.int64)
    live = (cols >= starts_t[:, None]) & (cols < ends_t[:, None]) & (table != NULL_SLOT)
    counts = live.sum(1)
    indptr = [0] + counts.cumsum(0).tolist()
    return table[live], cols.expand_as(table)[live], indptr


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
    key_positions: Tensor,
    q_start: int,
    scale: Optional[float],
    enable_gqa: bool,
    q_positions: Optional[Tensor] = None,
    last_position: Optional[int] = None,
) -> Tensor:
    """Softmax attention of one request: ``q [T, Hq, D]`` at positions ``q_start ..``
    over ``k/v [N, Hkv, D]`` whose first ``num_prefix`` rows are visible to every query
    and whose other rows sit at row positions ``key_positions`` (causal); ``q_positions``
    gives the queries' positions where they are not consecutive (SpecCache's selective
    prefill); ``last_position``, the last key row's position where the caller knows it
    (otherwise read from ``key_positions``: a host synchronisation). Returns
    ``[T, Hq, Dv]``. With one query that sees every row (decode) no mask is built, so the
    call is the same as SGLang's torch-native decode on the same rows."""
    if ext.backend_for(q) is ext.Backend.TRITON:
        return _attend_triton(q, k, v, num_prefix, key_positions, q_start, scale, q_positions)
    return attend_sdpa(q, k, v, num_prefix=num_prefix, key_positions=key_positions, q_start=q_start, scale=scale,
                       enable_gqa=enable_gqa, q_positions=q_positions, last_position=last_position)


def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, *, num_prefix: int, key_positions: Tensor, q_start: int,
                scale: Optional[float], enable_gqa: bool, q_positions: Optional[Tensor] = None,
                last_position: Optional[int] = None) -> Tensor:
    """:func:`attend` by torch's SDPA on any device (the CPU's path)."""
    t = q.shape[0]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    mask, causal = None, False
    if last_position is not None:  # known on the host: no synchronisation
        last = last_position
    else:
        last = int(key_positions[-1]) if key_positions.numel() else -1
    key_positions = on_device(key_positions, q.device)
    if q_positions is None and num_prefix == 0 and q_start == 0 and t == k.shape[0] == last + 1:
        causal = True  # keys at 0 .. t-1 (increasing), queries at 0 .. t-1: no mask to build
    elif q_positions is not None:
        q_pos = q_positions.to(q.device)
        visible = key_positions.view(1, -1) <= q_pos.view(-1, 1)
        mask = torch.cat([visible.new_ones(t, num_prefix), visible], dim=1)
    elif t > 1 or last > q_start:
        q_pos = torch.arange(q_start, q_start + t, device=q.device)
        visible = key_positions.view(1, -1) <= q_pos.view(-1, 1)
        mask = torch.cat([visible.new_ones(t, num_prefix), visible], dim=1)
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0),
        k.movedim(0, 1).unsqueeze(0),
        v.movedim(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=enable_gqa,
        scale=scale,
        is_causal=causal,
    )
    return out.squeeze(0).movedim(0, 1)


def _attend_triton(q, k, v, num_prefix, key_positions, q_start, scale, q_positions) -> Tensor:
    """:func:`attend` by the paged attention kernel over the rows as given (index list
    ``0..N-1``); the causal mask by position is applied inside the kernel."""
    n, t, dev = k.shape[0], q.shape[0], q.device
    kv_pos = torch.cat([torch.full((num_prefix,), -1, dtype=torch.int64, device=dev), key_positions.to(dev, torch.int64)])
    q_pos = (q_positions.to(dev, torch.int64) if q_positions is not None
             else torch.arange(q_start, q_start + t, device=dev))
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out, _ = ext.paged_attention(q, k, v, torch.zeros(t, dtype=torch.int64, device=dev), q_pos,
                                 torch.tensor([0, n], device=dev), torch.arange(n, device=dev), kv_pos, scale)
    return out.to(q.dtype)


def attend_pool(q: Tensor, k_buf: Tensor, v_buf: Tensor, slots: Tensor, positions: Tensor, *, q_start: int,
                scale: float, payload=None) -> Tensor:
    """Decode/extend attention of one request on the Triton path, reading the pool through
    its index list (``slots`` at row ``positions``, causal) without gathering it, and a
    quantized ``payload`` (``sgl_kernel_ext.Payload``, visible to every query) dequantized
    inside the attention; the two partial states are merged."""
    t, dev = q.shape[0], q.device
    q_pos = torch.arange(q_start, q_start + t, device=dev)
    out, lse = ext.paged_attention(q, k_buf, v_buf, torch.zeros(t, dtype=torch.int64, device=dev), q_pos,
                                   torch.arange(2, device=dev) * slots.numel(), slots, positions, scale)
    if payload is not None and payload.num_tokens:
        p_out, p_lse = ext.kivi_attention(q, payload, scale)
        out, lse = ext.merge_state(p_out, p_lse, out, lse)
    return out.to(q.dtype)


def keep_rows(rows: Tensor, keep_idx: Tensor) -> Tensor:
    """Per-head row selection: ``rows [m, H, D]``, ``keep_idx [H, m']`` (row indices per
    head) -> ``[m', H, D]`` with ``out[j, h] = rows[keep_idx[h, j], h]``."""
    idx = keep_idx.t().unsqueeze(-1).expand(-1, -1, rows.shape[2])
    return rows.gather(0, idx)


def write_rows(buf: Tensor, slots: Tensor, rows: Tensor) -> None:
    """``buf[slots] = rows`` (pool layout ``[num_slots, H, D]``)."""
    buf.index_copy_(0, slots, rows.to(buf.dtype))
