"""SpeCache's fetched rows for a whole batch: each request's top-k rows per KV head
brought in at full precision, and its query's attention over them (SpeCache eq. 1: the
payload attends everything else).

* :func:`fetch_rows` -- request ``b``, KV head ``h``, selection ``j``: row position
  ``r = pos[b, h, j]``. A row below the request's tree-shared prefix ``shared[b]`` is in
  the device pool (slot ``req_to_token[rows[b], r]``); the others are in the request's
  full-precision host copy at ``r - shared[b]``, whose two addresses (K, V) are
  ``host[b]``: pinned memory the GPU reads over the bus under unified addressing, at
  indices that never leave the device. A selection past the request's own ``topk[b]``, or
  at a position past its payload rows ``num_tokens[b]`` (a top-k over padding), is not a
  row: it is zeroed and listed as -1. The list of fetched positions ``selected [B, H, K]``
  is what the payload attention leaves out (``kivi_attention_batch``'s ``exclude``).
* :func:`rows_attention` -- per (request, KV head), the GQA group's queries over that
  head's valid rows: float32 ``(out [B, Hq, Dv], lse [B, Hq])``, 0 and -inf with none.

One launch each for the batch. The torch references loop over the requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch


class Fetched(NamedTuple):
    k: Tensor  # [B, K, H, D] in the pool's dtype
    v: Tensor  # [B, K, H, Dv]
    selected: Tensor  # [B, H, K] int64 row positions fetched, -1 for none

    @property
    def valid(self) -> Tensor:
        return self.selected >= 0


def fetch_rows_reference(pos, host_k, host_v, shared, topk, num_tokens, rows, req_to_token, k_buf,
                         v_buf) -> Fetched:
    """``host_k``/``host_v``: each request's host copy ``[n - p, H, D]`` (None: no copy)."""
    bsz, h, kk = pos.shape
    dev = k_buf.device
    k = torch.zeros(bsz, kk, h, k_buf.shape[2], dtype=k_buf.dtype, device=dev)
    v = torch.zeros(bsz, kk, h, v_buf.shape[2], dtype=v_buf.dtype, device=dev)
    j = torch.arange(kk, device=pos.device)
    valid = (j < topk.to(pos.device)[:, None, None]) & (pos < num_tokens.to(pos.device)[:, None, None])
    for b in range(bsz):
        p = int(shared[b])
        for hh in range(h):
            for jj in range(kk):
                if not bool(valid[b, hh, jj]):
                    continue
                r = int(pos[b, hh, jj])
                if r < p:
                    slot = int(req_to_token[int(rows[b]), r])
                    k[b, jj, hh], v[b, jj, hh] = k_buf[slot, hh], v_buf[slot, hh]
                else:
                    k[b, jj, hh] = host_k[b][r - p, hh].to(dev, k_buf.dtype)
                    v[b, jj, hh] = host_v[b][r - p, hh].to(dev, v_buf.dtype)
    return Fetched(k, v, torch.where(valid, pos, -1).to(dev))


@triton.jit
def _fetch_kernel(pos, host, like_host, shared, topk, ntok, rows, req_to_token, k_buf, v_buf, k_out, v_out, sel,
                  spb, sph, srt, skb0, skb1, svb0, svb1, shk0, shk1, shv0, shv1, sob, soj, soh, svob, svoj,
                  svoh, ssb, ssh, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    r = tl.load(pos + b * spb + h * sph + j).to(tl.int64)
    tk = tl.load(topk + b)
    n = tl.load(ntok + b)
    p = tl.load(shared + b).to(tl.int64)
    ok = (j < tk) & (r < n)
    slot = tl.load(req_to_token + tl.load(rows + b).to(tl.int64) * srt + r, mask=ok & (r < p), other=0).to(tl.int64)
    hk = tl.load(host + b * 2).to(like_host.dtype)
    hv = tl.load(host + b * 2 + 1).to(like_host.dtype)
    ty = k_out.dtype.element_ty
    # masks as vectors (Triton's interpreter refuses a scalar mask beside a vector one)
    d = tl.arange(0, BLOCK_D)
    rd = r + d * 0
    ok_d = (j + d * 0 < tk) & (rd < n) & (d < D)
    kd = tl.load(k_buf + slot * skb0 + h * skb1 + d, mask=ok_d & (rd < p), other=0.0)
    kh = tl.load(hk + (r - p) * shk0 + h * shk1 + d, mask=ok_d & (rd >= p), other=0.0)
    tl.store(k_out + b * sob + j * soj + h * soh + d, tl.where(rd < p, kd.to(ty), kh.to(ty)), mask=d < D)
    dv = tl.arange(0, BLOCK_DV)
    rv = r + dv * 0
    ok_v = (j + dv * 0 < tk) & (rv < n) & (dv < DV)
    vd = tl.load(v_buf + slot * svb0 + h * svb1 + dv, mask=ok_v & (rv < p), other=0.0)
    vh = tl.load(hv + (r - p) * shv0 + h * shv1 + dv, mask=ok_v & (rv >= p), other=0.0)
    tl.store(v_out + b * svob + j * svoj + h * svoh + dv, tl.where(rv < p, vd.to(ty), vh.to(ty)), mask=dv < DV)
    tl.store(sel + b * ssb + h * ssh + j, tl.where(ok, r, -1))


def fetch_rows(pos: Tensor, host: Tensor, host_like: Tensor, shared: Tensor, topk: Tensor, num_tokens: Tensor,
               rows: Tensor, req_to_token: Tensor, k_buf: Tensor, v_buf: Tensor, host_k=None,
               host_v=None) -> Fetched:
    """See the module docstring. ``pos [B, H, K]``, ``host [B, 2]`` int64 addresses of each
    request's host K and V copies (0: none), ``host_like``: one of them (their dtype and,
    all being contiguous ``[n - p, H, D]``, their strides), ``shared/topk/num_tokens/rows
    [B]``. ``host_k/host_v``: the host tensors per request, for the torch path."""
    if backend_for(pos) is Backend.TORCH:
        return fetch_rows_reference(pos, host_k, host_v, shared, topk, num_tokens, rows, req_to_token, k_buf,
                                    v_buf)
    bsz, h, kk = pos.shape
    d, dv = k_buf.shape[2], v_buf.shape[2]
    k = torch.empty(bsz, kk, h, d, dtype=k_buf.dtype, device=pos.device)
    v = torch.empty(bsz, kk, h, dv, dtype=v_buf.dtype, device=pos.device)
    sel = torch.empty(bsz, h, kk, dtype=torch.int64, device=pos.device)
    if bsz == 0 or kk == 0:
        return Fetched(k, v, sel)
    if not host_like.is_contiguous():
        raise ValueError("fetch_rows: the host copies must be contiguous")
    launch("specache_fetch_rows", _fetch_kernel, (bsz, kk, h), pos, host, host_like, shared, topk, num_tokens, rows,
           req_to_token, k_buf, v_buf, k, v, sel, pos.stride(0), pos.stride(1), req_to_token.stride(0),
           k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), h * d, d, h * dv, dv, k.stride(0),
           k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), sel.stride(0), sel.stride(1),
           D=d, DV=dv, BLOCK_D=block(d), BLOCK_DV=block(dv))
    return Fetched(k, v, sel)


def rows_attention_reference(q: Tensor, f: Fetched, scale: float) -> tuple[Tensor, Tensor]:
    bsz, hq, d = q.shape
    h = f.k.shape[2]
    qg = q.float().view(bsz, h, hq // h, d)
    s = torch.einsum("bhgd,bkhd->bhgk", qg, f.k.float()) * scale
    s = s.masked_fill(~f.valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgk,bkhd->bhgd", probs, f.v.float())
    return out.reshape(bsz, hq, -1), lse.reshape(bsz, hq)


@triton.jit
def _rows_kernel(q, k, v, sel, out, lse, scale, sqb, sqh, skb, skj, skh, svb, svj, svh, ssb, ssh, group, kk,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    hq = kvh * group + g
    gm = g < group
    qv = tl.load(q + b * sqb + hq[:, None] * sqh + d[None, :], mask=gm[:, None] & (d[None, :] < D), other=0.0)
    ok = tl.load(sel + b * ssb + kvh * ssh + j, mask=j < kk, other=-1) >= 0
    kr = tl.load(k + b * skb + j[:, None] * skj + kvh * skh + d[None, :], mask=ok[:, None] & (d[None, :] < D),
                 other=0.0)
    s = tl.dot(qv.to(tl.float32), tl.trans(kr.to(tl.float32)), input_precision="ieee") * scale
    s = tl.where(ok[None, :], s, -float("inf"))
    m = tl.max(s, axis=1)
    seen = m > -float("inf")
    m_safe = tl.where(seen, m, 0.0)
    pr = tl.exp(s - m_safe[:, None])
    l = tl.sum(pr, axis=1)
    vr = tl.load(v + b * svb + j[:, None] * svj + kvh * svh + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV),
                 other=0.0)
    acc = tl.dot(pr, vr.to(tl.float32), input_precision="ieee")
    o = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    row = b * tl.num_programs(1) * group + hq
    tl.store(out + row[:, None] * DV + dv[None, :], o, mask=gm[:, None] & (dv[None, :] < DV))
    tl.store(lse + row, tl.where(seen, m_safe + tl.log(tl.where(seen, l, 1.0)), -float("inf")), mask=gm)


def rows_attention(q: Tensor, f: Fetched, scale: float) -> tuple[Tensor, Tensor]:
    """Float32 ``(out [B, Hq, Dv], lse [B, Hq])`` of ``q [B, Hq, D]`` over its request's
    valid fetched rows, per KV head."""
    if backend_for(q) is Backend.TORCH:
        return rows_attention_reference(q, f, scale)
    bsz, hq, d = q.shape
    _, kk, h, dv = f.v.shape
    out = torch.empty(bsz, hq, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out, lse
    group = hq // h
    launch("specache_rows_attention", _rows_kernel, (bsz, h), q, f.k, f.v, f.selected, out, lse,
           float(scale), q.stride(0), q.stride(1), f.k.stride(0), f.k.stride(1), f.k.stride(2), f.v.stride(0),
           f.v.stride(1), f.v.stride(2), f.selected.stride(0), f.selected.stride(1), group, kk, D=d, DV=dv,
           BLOCK_G=block(group), BLOCK_K=block(kk), BLOCK_D=block(d), BLOCK_DV=block(dv))
    return out, lse
