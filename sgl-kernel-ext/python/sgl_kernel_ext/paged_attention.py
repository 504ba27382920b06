"""Decode and extend attention over paged KV, causal by row position, with the
log-sum-exp of each query row (so that partial attentions merge: :mod:`.merge_state`).

Queries ``q [Tq, Hq, D]`` of a batch (request ``q_req[t]``, position ``q_pos[t]``) attend
over their request's keys ``k_buf[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]``, a key being
visible when its row position is ``<= q_pos`` (a row position of -1: visible to every
query). With :func:`.kv_indices.build_kv_indices` this is attention over a compressed
node's kept rows plus the request's causal tail, read through SGLang's ``req_to_token``;
with ``q_pos`` not consecutive it is SpecCache's selective prefill (the position mask is
built inside the kernel). GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``.

Flash-decoding: one program per (query row, KV head, KV split) holds the query heads of
the GQA group together, so each key and value is read once per group and the scores are
a ``tl.dot`` (tensor cores in bf16/fp16); a long request's keys spread over up to
:data:`MAX_SPLITS` programs (chosen from host-known sizes, no device read), and a second
kernel merges the splits by log-sum-exp. Extend batches with long query runs would tile
queries too (FlashInfer's prefill does); not done here.
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
def _split_kernel(q, k_buf, v_buf, q_req, q_pos, kv_indptr, kv_indices, kv_pos, part_out, part_lse, scale,
                  sq0, sq1, sk0, sk1, sv0, sv1, group, num_splits,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (query row, KV head, KV split): the GQA group's query heads together (one
    read of each key and value for the group, scores by ``tl.dot`` on tensor cores),
    over its split of the request's keys; the partial output and log-sum-exp of each
    head go to ``part_out [Tq, Hq, S, DV]`` / ``part_lse [Tq, Hq, S]``."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    b = tl.load(q_req + t)
    qp = tl.load(q_pos + t)
    start = tl.load(kv_indptr + b)
    end = tl.load(kv_indptr + b + 1)
    per = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + sp * per
    hi = tl.minimum(end, lo + per)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    in_group = g < group
    h = kvh * group + g
    qv = tl.load(q + t * sq0 + h[:, None] * sq1 + d[None, :], mask=in_group[:, None] & (d[None, :] < D), other=0.0)
    m = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        inb = offs < hi
        slot = tl.load(kv_indices + offs, mask=inb, other=0).to(tl.int64)
        kp = tl.load(kv_pos + offs, mask=inb, other=0)
        vis = inb & (kp <= qp)
        k = tl.load(k_buf + slot[:, None] * sk0 + kvh * sk1 + d[None, :],
                    mask=vis[:, None] & (d[None, :] < D), other=0.0)
        s = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale  # [G, N]
        s = tl.where(vis[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = tl.load(v_buf + slot[:, None] * sv0 + kvh * sv1 + dv[None, :],
                    mask=vis[:, None] & (dv[None, :] < DV), other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    seen = l > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    row = (t * tl.num_programs(1) * group + h) * num_splits + sp  # [Tq, Hq, S] flattened
    tl.store(part_out + row[:, None] * DV + dv[None, :], o, mask=in_group[:, None] & (dv[None, :] < DV))
    tl.store(part_lse + row, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), -float("inf")), mask=in_group)


@triton.jit
def _reduce_kernel(part_out, part_lse, out, lse, eo0, el0, eo1, el1, num_splits, DV: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_EXTRA: tl.constexpr):
    """Merge one (query row, head)'s splits, and up to two more partial states of it
    (``eo/el``: ``[R, DV]``/``[R]``), by their log-sum-exps; no visible key: 0, -inf."""
    r = tl.program_id(0)  # t * Hq + h
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    ls = tl.load(part_lse + r * num_splits + s, mask=s < num_splits, other=-float("inf"))
    mx = tl.max(ls, axis=0)
    if NUM_EXTRA >= 1:
        l0 = tl.load(el0 + r)
        mx = tl.maximum(mx, l0)
    if NUM_EXTRA >= 2:
        l1 = tl.load(el1 + r)
        mx = tl.maximum(mx, l1)
    mx_safe = tl.where(mx == -float("inf"), 0.0, mx)
    w = tl.exp(ls - mx_safe)
    total = tl.sum(w, axis=0)
    po = tl.load(part_out + (r * num_splits + s)[:, None] * DV + dv[None, :],
                 mask=(s[:, None] < num_splits) & (dv[None, :] < DV), other=0.0)
    acc = tl.sum(w[:, None] * po, axis=0)
    if NUM_EXTRA >= 1:
        w0 = tl.exp(l0 - mx_safe)
        total += w0
        acc += w0 * tl.load(eo0 + r * DV + dv, mask=dv < DV, other=0.0)
    if NUM_EXTRA >= 2:
        w1 = tl.exp(l1 - mx_safe)
        total += w1
        acc += w1 * tl.load(eo1 + r * DV + dv, mask=dv < DV, other=0.0)
    seen = total > 0
    o = acc / tl.where(seen, total, 1.0)
    tl.store(out + r * DV + dv, tl.where(seen, o, 0.0), mask=dv < DV)
    tl.store(lse + r, tl.where(seen, mx_safe + tl.log(tl.where(seen, total, 1.0)), -float("inf")))


def merge_splits(part_out: Tensor, part_lse: Tensor, out: Tensor, lse: Tensor, extra: tuple = ()) -> None:
    """``out [Tq, Hq, DV]``/``lse [Tq, Hq]`` from the splits ``part_out [Tq, Hq, S, DV]`` /
    ``part_lse [Tq, Hq, S]`` of a flash-decoding kernel (this one, :mod:`.kivi_attention`),
    and up to two more partial states ``(out, lse)`` of the same queries (``extra``), in
    one launch."""
    tq, hq, splits, dv = part_out.shape
    if len(extra) > 2:
        raise ValueError("merge_splits: at most two extra states")
    ex = [(o.float().contiguous(), l.float().contiguous()) for o, l in extra]
    ex += [(part_out, part_lse)] * (2 - len(ex))  # unused stand-ins
    launch("paged_attention_reduce", _reduce_kernel, (tq * hq,), part_out, part_lse, out, lse, ex[0][0], ex[0][1],
           ex[1][0], ex[1][1], splits, DV=dv, BLOCK_S=block(splits, least=2), BLOCK_DV=block(dv),
           NUM_EXTRA=len(extra))


MAX_SPLITS = 16
SPLIT_ROWS = 256  # keys per split, about: a long request spreads over up to MAX_SPLITS programs


def num_splits(num_keys: int, num_requests: int, most: int = MAX_SPLITS) -> int:
    """KV splits per (query row, KV head), from host-known sizes only (no device read):
    the mean keys per request over :data:`SPLIT_ROWS`, at most ``most``."""
    mean = -(-num_keys // max(1, num_requests))
    return max(1, min(most, -(-mean // SPLIT_ROWS)))


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
    hkv = k_buf.shape[1]
    group = hq // hkv
    splits = num_splits(kv_indices.numel(), kv_indptr.numel() - 1)
    part_out = torch.empty(tq, hq, splits, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(tq, hq, splits, dtype=torch.float32, device=q.device)
    launch("paged_attention", _split_kernel, (tq, hkv, splits), q, k_buf, v_buf, q_req.contiguous(),
           q_pos.contiguous(), kv_indptr.contiguous(), kv_indices.contiguous(), kv_pos.contiguous(),
           part_out, part_lse, float(scale), q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
           v_buf.stride(0), v_buf.stride(1), group, splits,
           D=d, DV=dv, BLOCK_G=block(group), BLOCK_D=block(d), BLOCK_DV=block(dv), BLOCK_N=64)
    merge_splits(part_out, part_lse, out, lse)
    return out, lse
