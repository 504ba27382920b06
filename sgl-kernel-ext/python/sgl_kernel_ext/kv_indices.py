"""Paged KV index lists built on the device: the live (non-null) slots of each request's
``req_to_token`` row range, compacted, with their row positions.

This is what FlashInfer's paged attention takes (``kv_indptr``/``kv_indices``, page size
1); the row positions let :mod:`.paged_attention` keep the causal mask of a compressed
row (dropped tokens point at the null slot and are not rows at all).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch, on_device


class KVIndices(NamedTuple):
    indptr: Tensor  # [B + 1] int64: request b's entries are [indptr[b], indptr[b+1])
    indices: Tensor  # [N] int64 pool slots
    positions: Tensor  # [N] int64 row positions


def reference(req_to_token: Tensor, rows: Tensor, starts: Tensor, ends: Tensor, null_slot: int) -> KVIndices:
    slots, positions, counts = [], [], []
    for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        s = req_to_token[row, start:end].to(torch.int64)
        live = s != null_slot
        slots.append(s[live])
        positions.append(torch.arange(start, end, device=s.device)[live])
        counts.append(int(live.sum()))
    device = req_to_token.device
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int64, device=device)
    indptr[1:] = torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return KVIndices(indptr, torch.cat(slots) if slots else empty, torch.cat(positions) if positions else empty)


@triton.jit
def _count_kernel(req_to_token, stride_row, rows, starts, ends, counts, null_slot, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    start = tl.load(starts + b)
    end = tl.load(ends + b)
    # per-lane int64 counts, summed once (a loop-carried scalar must keep one type: an
    # int32 ``0`` plus an int64 sum does not compile)
    live = tl.zeros([BLOCK], dtype=tl.int64)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        mask = offs < end
        slot = tl.load(req_to_token + row * stride_row + offs, mask=mask, other=null_slot)
        live += (slot != null_slot).to(tl.int64)
    tl.store(counts + b, tl.sum(live, axis=0))


@triton.jit
def _write_kernel(req_to_token, stride_row, rows, starts, ends, indptr, out_slots, out_pos, null_slot,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    start = tl.load(starts + b)
    end = tl.load(ends + b)
    base = tl.load(indptr + b)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        mask = offs < end
        slot = tl.load(req_to_token + row * stride_row + offs, mask=mask, other=null_slot)
        live = (slot != null_slot).to(tl.int64)
        dst = base + tl.cumsum(live, axis=0) - live  # exclusive prefix sum within the block
        keep = mask & (live > 0)
        tl.store(out_slots + dst, slot.to(tl.int64), mask=keep)
        tl.store(out_pos + dst, offs.to(tl.int64), mask=keep)
        base += tl.sum(live, axis=0)


def build_kv_indices(req_to_token: Tensor, rows: Tensor, starts: Tensor, ends: Tensor, null_slot: int = 0,
                     spans: Optional[Sequence[int]] = None, capacity: Optional[int] = None) -> KVIndices:
    """Live slots of ``req_to_token[rows[b], starts[b]:ends[b]]`` for each request ``b``.

    ``spans``: each request's ``ends - starts`` as the host knows them. With them no host
    synchronisation is made: the index lists get room for every row of the spans, and
    the entries past ``indptr[-1]`` (rows that were not live) are left unused. Without
    them, two reads of device values size the launch and the lists.

    ``capacity``: the lists' room, at least ``sum(spans)`` (e.g. :func:`.dispatch.bucket`
    of it): then the lists' shapes and the launches depend on the batch size and the
    capacity only, not on the lengths (one CUDA graph per bucket); a kernel that splits
    the lists by their size (:func:`.paged_attention.paged_attention`) splits them alike."""
    if backend_for(req_to_token) is Backend.TORCH:
        return reference(req_to_token, rows, starts, ends, null_slot)
    device = req_to_token.device
    bsz = rows.numel()
    rows, starts, ends = (on_device(t, device).to(torch.int64).contiguous() for t in (rows, starts, ends))
    counts = torch.empty(bsz, dtype=torch.int64, device=device)
    if capacity is not None:
        if spans is None or sum(spans) > capacity:
            raise ValueError(f"build_kv_indices: a capacity ({capacity}) needs the spans, at most it in all")
        longest = capacity  # the block too is fixed by the capacity, not the lengths
    else:
        longest = max(spans, default=1) if spans is not None else int((ends - starts).max()) if bsz else 1
    blk = block(longest, least=16)
    blk = min(blk, 1024)
    launch("build_kv_indices", _count_kernel, (bsz,), req_to_token, req_to_token.stride(0), rows, starts, ends,
           counts, null_slot, BLOCK=blk)
    indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=device)
    indptr[1:] = counts.cumsum(0)
    if capacity is not None:
        total = capacity
    else:
        total = sum(spans) if spans is not None else int(indptr[-1])  # without spans: a sync, the output's size
    slots = torch.empty(total, dtype=torch.int64, device=device)
    positions = torch.empty(total, dtype=torch.int64, device=device)
    launch("build_kv_indices", _write_kernel, (bsz,), req_to_token, req_to_token.stride(0), rows, starts, ends,
           indptr, slots, positions, null_slot, BLOCK=blk)
    return KVIndices(indptr, slots, positions)
