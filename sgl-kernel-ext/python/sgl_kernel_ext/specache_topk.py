"""SpeCache's top-k (paper section 3.2): the attention probabilities of one query row
over the low-bit keys of the payload, summed per KV head over its query heads, then the
``k`` highest rows of each KV head.

The probabilities need the row's log-sum-exp over all its keys (payload, substituted
rows, tail), which the attention pass returns (:mod:`.kivi_attention`,
:mod:`.paged_attention`, merged). The kernel computes the payload rows' probabilities
from the packed codes (the same dequantization as the attention); rows left out by
``exclude`` (those attended in full precision) score 0 here, the caller adds their own
probabilities. ``torch.topk`` then picks the rows on the device.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch
from .kivi_attention import Payload, check, dequantize, dequantize_keys


def reference(q_row: Tensor, lse_row: Tensor, p: Payload, scale: float, exclude: Optional[Tensor] = None) -> Tensor:
    """``[H, n_q]`` float32 probability mass per KV head of ``q_row [Hq, D]``."""
    k, _ = dequantize(p)
    hq, h = q_row.shape[0], k.shape[1]
    s = torch.einsum("hd,nhd->hn", q_row.float(), k.float().repeat_interleave(hq // h, dim=1)) * scale
    probs = torch.exp(s - lse_row.float()[:, None]).view(h, hq // h, -1).sum(1)
    if exclude is not None:
        probs = probs.masked_fill(exclude, 0.0)
    return probs


@triton.jit
def _kernel(q, lse, kp, ks, kz, excl, out, scale, n_q, sq0, skp0, skp1, sks0, sks1, sx0, so0, group,
            G: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_EXCL: tl.constexpr):
    kvh = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    total = score_block(q, lse, lse, kp, ks, kz, scale, n_q, kvh, n0, sq0, skp0, skp1, sks0, sks1, group, G, BITS,
                        D, BLOCK_D, BLOCK_N, False)
    n = n0 + tl.arange(0, BLOCK_N)
    inb = n < n_q
    if HAS_EXCL:
        ex = tl.load(excl + kvh * sx0 + n, mask=inb, other=0)
        total = tl.where(ex == 0, total, 0.0)
    tl.store(out + kvh * so0 + n, total, mask=inb)


@triton.jit
def score_block(q, lse, lse2, kp, ks, kz, scale, n_q, kvh, n0, sq0, skp0, skp1, sks0, sks1, group,
                G: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LSE2: tl.constexpr):
    """KV head ``kvh``'s attention mass on payload rows ``n0 + arange(BLOCK_N)`` (0 past
    ``n_q``), summed over its query heads ``q [Hq, D]`` of log-sum-exps ``lse [Hq]`` (with
    ``HAS_LSE2``: over two disjoint key sets, ``lse`` and ``lse2``, combined here)."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    inb = n < n_q
    k = dequantize_keys(kp, ks, kz, n0, n_q, inb, kvh, skp0, skp1, sks0, sks1, G, BITS, D, BLOCK_N, BLOCK_D)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, group):
        h = kvh * group + g
        qv = tl.load(q + h * sq0 + d, mask=d < D, other=0.0).to(tl.float32)
        s = tl.sum(k * qv[None, :], axis=1) * scale
        row_lse = tl.load(lse + h)
        if HAS_LSE2:
            other = tl.load(lse2 + h)
            top = tl.maximum(row_lse, other)
            top = tl.where(top == -float("inf"), 0.0, top)
            row_lse = top + tl.log(tl.exp(row_lse - top) + tl.exp(other - top))
        total += tl.exp(s - row_lse)
    return tl.where(inb, total, 0.0)


def payload_scores(q_row: Tensor, lse_row: Tensor, p: Payload, scale: float,
                   exclude: Optional[Tensor] = None) -> Tensor:
    """``[H, n_q]`` float32: each KV head's attention mass on each payload row."""
    check(p)
    if backend_for(q_row) is Backend.TORCH:
        return reference(q_row, lse_row, p, scale, exclude)
    hq = q_row.shape[0]
    h = p.k_payload.shape[1]
    out = torch.empty(h, p.num_tokens, dtype=torch.float32, device=q_row.device)
    if p.num_tokens == 0:
        return out
    q_row = q_row.contiguous()
    lse_row = lse_row.float().contiguous()
    excl = exclude.to(torch.uint8).contiguous() if exclude is not None else p.k_payload
    bn = 32
    launch("specache_scores", _kernel, (h, triton.cdiv(p.num_tokens, bn)), q_row, lse_row, p.k_payload,
           p.k_scales, p.k_zeros, excl, out, float(scale), p.num_tokens, q_row.stride(0),
           p.k_payload.stride(0), p.k_payload.stride(1), p.k_scales.stride(0), p.k_scales.stride(1),
           excl.stride(0) if exclude is not None else 0, out.stride(0), hq // h, G=p.group_size,
           BITS=p.bits, D=p.head_dim, BLOCK_D=block(p.head_dim), BLOCK_N=bn, HAS_EXCL=exclude is not None)
    return out


def select_topk(scores: Tensor, k: int) -> Tensor:
    """The ``min(k, n)`` rows of highest score per KV head, ``[H, k']`` int64, in
    ascending position order (a set compares equal whatever the tie order)."""
    k = min(int(k), scores.shape[1])
    if k <= 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.int64, device=scores.device)
    return scores.topk(k, dim=1).indices.sort(dim=1).values
