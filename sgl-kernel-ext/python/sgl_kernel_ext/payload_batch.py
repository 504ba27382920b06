"""Many requests' KIVI payloads in one launch, through a table of their addresses.

Each request keeps its own payload tensors (they grow as its tail is quantized and go
when it finishes). What the members of a batch share is the layout: bits, groups, heads,
head dims, dtypes and, the tensors being contiguous, the strides of a row. A
:class:`PayloadBatch` carries one row of six addresses per request (``[B, 6]`` int64 on
the device, :data:`FIELDS` in order) and each request's number of rows; the kernels load
their request's row and cast it to pointers. One launch then covers the batch whatever
its size, where a kernel per request launched B (issue #46: drafting in a few launches
per layer). The torch references loop over the members, as the CPU path does.

* :func:`kivi_attention_batch` -- one query row per request over its payload (split
  flash-decoding, the splits merged by :func:`.paged_attention.merge_splits`);
* :func:`payload_scores_batch` -- SpeCache's per-KV-head attention mass on every payload
  row of every request, padded to the longest with -1 so that a top-k takes real rows
  first.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch, on_device
from .kivi_attention import KIVI_MAX_SPLITS, Payload, attend_split, check, launch_constants
from .kivi_attention import reference as kivi_reference
from .specache_topk import reference as scores_row_reference
from .specache_topk import score_block
from .merge_state import reference as merge_reference
from .paged_attention import merge_splits, num_splits

FIELDS = ("k_payload", "k_scales", "k_zeros", "v_payload", "v_scales", "v_zeros")
PAD_SCORE = -1.0  # a score below any attention mass (the padding past a request's rows)


class PayloadBatch(NamedTuple):
    members: tuple  # each request's Payload: the torch path reads them, and they keep the tensors alive
    ptrs: Tensor  # [B, 6] int64: the addresses of each member's FIELDS, on the device
    num_tokens: Tensor  # [B] int32 payload rows per member, on the device
    max_tokens: int  # the longest member's rows (host-known: it sizes the launch)


def addresses(p: Payload) -> list[int]:
    """The six addresses of a payload's tensors (which must be contiguous: the members of
    a batch share one set of strides)."""
    for f in FIELDS:
        if not getattr(p, f).is_contiguous():
            raise ValueError(f"payload_batch: {f} must be contiguous")
    return [getattr(p, f).data_ptr() for f in FIELDS]


def layout(p: Payload) -> tuple:
    """What the members of one batch must share."""
    return (p.bits, p.group_size, p.value_group_size, p.head_dim, p.v_head_dim, p.k_payload.shape[1:],
            p.v_payload.shape[1:], p.k_scales.dtype, p.v_scales.dtype, p.k_scales.device)


def to_device(t: Tensor, device) -> Tensor:
    """A small host tensor on ``device``: through pinned memory and a copy that does not
    block the host on CUDA (a pageable source would)."""
    device = torch.device(device)
    if device.type != "cuda":
        return on_device(t, device)
    return t.pin_memory().to(device, non_blocking=True)


def payload_batch(members: Sequence[Payload], device=None, ptrs: Optional[Tensor] = None,
                  num_tokens: Optional[Tensor] = None) -> PayloadBatch:
    """A batch of payloads of one layout. ``ptrs``/``num_tokens``: the device tables when the
    caller built them already (e.g. every layer's in one copy per forward)."""
    members = tuple(members)
    if not members:
        raise ValueError("payload_batch: no members")
    first = layout(members[0])
    if any(layout(p) != first for p in members[1:]):
        raise ValueError("payload_batch: the members differ in layout (bits, groups, heads, dtypes)")
    device = members[0].k_payload.device if device is None else device
    if ptrs is None:
        ptrs = to_device(torch.tensor([addresses(p) for p in members], dtype=torch.int64), device)
    if num_tokens is None:
        num_tokens = to_device(torch.tensor([p.num_tokens for p in members], dtype=torch.int32), device)
    return PayloadBatch(members, ptrs, num_tokens, max(p.num_tokens for p in members))


@triton.jit
def _member(ptrs, b, i, like):
    """Member ``b``'s address ``i`` as a pointer of ``like``'s type."""
    return tl.load(ptrs + b * 6 + i).to(like.dtype)


@triton.jit
def _attention_kernel(q, ptrs, ntok, like_kp, like_ks, like_vs, excl, part_out, part_lse, scale,
                      sq0, sq1, skp0, skp1, sks0, sks1, svp0, svp1, svs0, svs1, sxb, sx0, n_excl, group, num_splits,
                      G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      EXCL_LIST: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, GV_POW2: tl.constexpr):
    """Request ``b``'s query row over its own payload: (request, KV head, split)."""
    b = tl.program_id(0)
    attend_split(q, _member(ptrs, b, 0, like_kp), _member(ptrs, b, 1, like_ks), _member(ptrs, b, 2, like_ks),
                 _member(ptrs, b, 3, like_kp), _member(ptrs, b, 4, like_vs), _member(ptrs, b, 5, like_vs),
                 excl + b * sxb, part_out, part_lse, scale, tl.load(ntok + b), b, tl.program_id(1),
                 tl.program_id(2), tl.num_programs(1), sq0, sq1, skp0, skp1, sks0, sks1, svp0, svp1, svs0, svs1,
                 sx0, group, num_splits, G, GV, BITS, D, DV, BLOCK_G, BLOCK_D, BLOCK_DV, BLOCK_N, False,
                 DOT_F32, GV_POW2, n_excl, EXCL_LIST, BLOCK_K)


def attention_reference(q: Tensor, pb: PayloadBatch, scale: float,
                        exclude: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    outs, lses = [], []
    for b, p in enumerate(pb.members):
        ex = None
        if exclude is not None:  # the listed rows as a mask
            ex = torch.zeros(exclude.shape[1], p.num_tokens + 1, dtype=torch.bool, device=q.device)
            ex.scatter_(1, torch.where(exclude[b] >= 0, exclude[b], p.num_tokens), True)
            ex = ex[:, : p.num_tokens]
        o, lse = kivi_reference(q[b : b + 1], p, scale, ex)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def kivi_attention_batch(q: Tensor, pb: PayloadBatch, scale: float, exclude: Optional[Tensor] = None,
                         merge: tuple = ()) -> tuple[Tensor, Tensor]:
    """Float32 ``(out [B, Hq, Dv], lse [B, Hq])``: query row ``b`` of ``q [B, Hq, D]`` over
    member ``b``'s payload, leaving out the rows listed in ``exclude [B, H, K]`` (row
    positions, -1 for none). ``merge``: up to two more partial states ``(out, lse)`` of the
    same queries over other keys, merged in by the same launch that merges the splits. A
    member with no rows gets 0 and -inf (before the merge)."""
    for p in pb.members:
        check(p)
    if backend_for(q) is Backend.TORCH:
        out, lse = attention_reference(q, pb, scale, exclude)
        for o2, l2 in merge:
            out, lse = merge_reference(out, lse, o2, l2)
        return out, lse
    like = pb.members[0]
    bsz, hq, _ = q.shape
    h = like.k_payload.shape[1]
    out = torch.empty(bsz, hq, like.v_head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out, lse
    if exclude is not None and exclude.stride(2) != 1:
        exclude = exclude.contiguous()
    group = hq // h
    splits = num_splits(pb.max_tokens, 1, most=KIVI_MAX_SPLITS)
    part_out = torch.empty(bsz, hq, splits, like.v_head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, hq, splits, dtype=torch.float32, device=q.device)
    n_excl = exclude.shape[2] if exclude is not None else 0
    launch("kivi_attention_batch", _attention_kernel, (bsz, h, splits), q, pb.ptrs, pb.num_tokens, like.k_payload,
           like.k_scales, like.v_scales, exclude if exclude is not None else pb.ptrs, part_out, part_lse,
           float(scale), q.stride(0), q.stride(1), like.k_payload.stride(0), like.k_payload.stride(1),
           like.k_scales.stride(0), like.k_scales.stride(1), like.v_payload.stride(0), like.v_payload.stride(1),
           like.v_scales.stride(0), like.v_scales.stride(1), exclude.stride(0) if exclude is not None else 0,
           exclude.stride(1) if exclude is not None else 0, n_excl, group, splits,
           EXCL_LIST=exclude is not None, BLOCK_K=block(n_excl), **launch_constants(like, q, group))
    merge_splits(part_out, part_lse, out, lse, extra=merge)
    return out, lse


@triton.jit
def _scores_kernel(q, lse, lse2, ptrs, ntok, like_kp, like_ks, out, scale, sqb, sq0, slb, skp0, skp1, sks0, sks1,
                   sob, so0, width, group, G: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAD: tl.constexpr, HAS_LSE2: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    n_q = tl.load(ntok + b)
    total = score_block(q + b * sqb, lse + b * slb, lse2 + b * slb, _member(ptrs, b, 0, like_kp),
                        _member(ptrs, b, 1, like_ks), _member(ptrs, b, 2, like_ks), scale, n_q, kvh, n0, sq0, skp0,
                        skp1, sks0, sks1, group, G, BITS, D, BLOCK_D, BLOCK_N, HAS_LSE2)
    n = n0 + tl.arange(0, BLOCK_N)
    tl.store(out + b * sob + kvh * so0 + n, tl.where(n < n_q, total, PAD), mask=n < width)


def scores_reference(q: Tensor, lse: Tensor, pb: PayloadBatch, scale: float) -> Tensor:
    h = pb.members[0].k_payload.shape[1]
    out = torch.full((q.shape[0], h, pb.max_tokens), PAD_SCORE, dtype=torch.float32, device=q.device)
    for b, p in enumerate(pb.members):
        out[b, :, : p.num_tokens] = scores_row_reference(q[b], lse[b], p, scale)
    return out


def payload_scores_batch(q: Tensor, lse: Tensor, pb: PayloadBatch, scale: float,
                         lse2: Optional[Tensor] = None) -> Tensor:
    """``[B, H, max_tokens]`` float32: each KV head's attention mass (query row ``b`` of
    ``q [B, Hq, D]``, its log-sum-exp over all its keys ``lse [B, Hq]``, or over two
    disjoint key sets ``lse`` and ``lse2``) on each payload row of member ``b``;
    :data:`PAD_SCORE` past the member's rows."""
    if backend_for(q) is Backend.TORCH:
        return scores_reference(q, lse if lse2 is None else torch.logaddexp(lse, lse2), pb, scale)
    like = pb.members[0]
    bsz, hq, _ = q.shape
    h = like.k_payload.shape[1]
    out = torch.empty(bsz, h, pb.max_tokens, dtype=torch.float32, device=q.device)
    if bsz == 0 or pb.max_tokens == 0:
        return out
    q = q.contiguous()
    lse = lse.float().contiguous()
    lse2 = lse if lse2 is None else lse2.float().contiguous()
    bn = 32
    launch("payload_scores_batch", _scores_kernel, (bsz, h, triton.cdiv(pb.max_tokens, bn)), q, lse, lse2, pb.ptrs,
           pb.num_tokens, like.k_payload, like.k_scales, out, float(scale), q.stride(0), q.stride(1), lse.stride(0),
           like.k_payload.stride(0), like.k_payload.stride(1), like.k_scales.stride(0), like.k_scales.stride(1),
           out.stride(0), out.stride(1), pb.max_tokens, hq // h, G=like.group_size, BITS=like.bits,
           D=like.head_dim, BLOCK_D=block(like.head_dim), BLOCK_N=bn, PAD=PAD_SCORE, HAS_LSE2=lse2 is not lse)
    return out
