"""Decode and extend attention over paged KV, causal by row position, with the
log-sum-exp of each query row (so that partial attentions merge: :mod:`.merge_state`).

Queries ``q [Tq, Hq, D]`` of a batch (request ``q_req[t]``, position ``q_pos[t]``) attend
over their request's keys ``k_buf[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]``, a key being
visible when its row position is ``<= q_pos`` (a row position of -1: visible to every
query). With :func:`.kv_indices.build_kv_indices` this is attention over a compressed
node's kept rows plus the request's causal tail, read through SGLang's ``req_to_token``;
with ``q_pos`` not consecutive it is SpecCache's selective prefill (the position mask is
built inside the kernel). GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``.

One program per (query row, head), keys in blocks with an online softmax: the decode
shape. Extend batches with long query runs would tile queries too (FlashInfer's prefill
does); not done here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch


def reference(q, k_buf, v_buf, q_req, q_pos, kv_indptr, kv_indices, kv_pos, scale) -> tuple[Tensor, Tensor]:
    """Float32 ``(out [Tq, Hq, Dv], lse [Tq, Hq])``; a query that sees no key gets 0 and -inf."""
    tq, hq, _ = q.shape
    hkv = k_buf.shape[1]
    out = torch.zeros(tq, hq, v_buf.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    indptr = kv_indptr.tolist()
    for t, (b, p) in enumerate(zip(q_req.tolist(), q_pos.tolist())):
        idx = kv_indices[indptr[b] : indptr[b + 1]]
        vis = kv_pos[indptr[b] : indptr[b + 1]] <= p
        if not bool(vis.any()):
            continue
        k = k_buf[idx[vis]].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_buf[idx[vis]].float().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].float(), k) * scale
        lse[t] = torch.logsumexp(s, dim=1)
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), v)
    return out, lse


@triton.jit
def _kernel(q, k_buf, v_buf, q_req, q_pos, kv_indptr, kv_indices, kv_pos, out, lse, scale,
            sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, group,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    b = tl.load(q_req + t)
    qp = tl.load(q_pos + t)
    start = tl.load(kv_indptr + b)
    end = tl.load(kv_indptr + b + 1)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    qv = tl.load(q + t * sq0 + h * sq1 + d, mask=d < D, other=0.0).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        inb = offs < end
        slot = tl.load(kv_indices + offs, mask=inb, other=0).to(tl.int64)
        kp = tl.load(kv_pos + offs, mask=inb, other=0)
        vis = inb & (kp <= qp)
        k = tl.load(k_buf + slot[:, None] * sk0 + kvh * sk1 + d[None, :],
                    mask=vis[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.sum(k * qv[None, :], axis=1) * scale
        s = tl.where(vis, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m - m_safe)
        v = tl.load(v_buf + slot[:, None] * sv0 + kvh * sv1 + dv[None, :],
                    mask=vis[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    seen = l > 0
    o = tl.where(seen, acc / tl.where(seen, l, 1.0), 0.0)
    tl.store(out + t * so0 + h * so1 + dv, o, mask=dv < DV)
    tl.store(lse + t * tl.num_programs(1) + h, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), -float("inf")))


def paged_attention(q: Tensor, k_buf: Tensor, v_buf: Tensor, q_req: Tensor, q_pos: Tensor,
                    kv_indptr: Tensor, kv_indices: Tensor, kv_pos: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` in float32; see the module docstring for the layout."""
    if backend_for(q) is Backend.TORCH:
        return reference(q, k_buf, v_buf, q_req, q_pos, kv_indptr, kv_indices, kv_pos, scale)
    tq, hq, d = q.shape
    dv = v_buf.shape[2]
    out = torch.empty(tq, hq, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    if tq == 0:
        return out, lse
    launch("paged_attention", _kernel, (tq, hq), q, k_buf, v_buf, q_req.contiguous(), q_pos.contiguous(),
           kv_indptr.contiguous(), kv_indices.contiguous(), kv_pos.contiguous(), out, lse, float(scale),
           q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
           out.stride(0), out.stride(1), hq // k_buf.shape[1],
           D=d, DV=dv, BLOCK_D=block(d), BLOCK_DV=block(dv), BLOCK_N=64)
    return out, lse
