"""KIVI dequantization fused with attention, for 2-bit and 1-bit payloads.

A payload (``sglang_vc.compress``'s ``QuantizedKV`` without its residual) stores, for
``n_q`` tokens, keys per channel and values per token (KIVI; SpeCache's 1-bit variant,
its eq. 3, differs only in the stored zero-point and scale):

* ``k_payload [n_q, H, ceil(D / per)]`` uint8 codes packed along the channel
  (``per = 8 // bits`` codes a byte, lowest bits first), ``k_scales/k_zeros
  [n_q / G, H, D]``: key ``(t, h, c) = code * scale[t // G, h, c] + zero[t // G, h, c]``;
* ``v_payload [n_q, H, ceil(Dv / per)]``, ``v_scales/v_zeros [n_q, H, Dv / Gv]``: value
  ``(t, h, c) = code * scale[t, h, c // Gv] + zero[t, h, c // Gv]``.

Every payload row is visible to every query (the payload is a prefix). The residual
tokens are full precision in the pool and attended by :mod:`.paged_attention`; the two
states merge by :mod:`.merge_state`. ``exclude [H, n_q]`` (bool) leaves rows out per KV
head: SpeCache's eq. 1 replaces its prefetched rows by their full-precision values, which
are attended separately. Dequantized values are rounded to the scales' dtype first, as
the torch dequantization does.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch
from .paged_attention import merge_splits, num_splits


class Payload(NamedTuple):
    bits: int
    group_size: int  # G: tokens per key group
    value_group_size: int  # Gv: channels per value group
    k_payload: Tensor
    k_scales: Tensor
    k_zeros: Tensor
    v_payload: Tensor
    v_scales: Tensor
    v_zeros: Tensor
    head_dim: int
    v_head_dim: int

    @property
    def num_tokens(self) -> int:
        return self.k_payload.shape[0]


def _unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n]


def dequantize(p: Payload) -> tuple[Tensor, Tensor]:
    """``(k [n_q, H, D], v [n_q, H, Dv])`` in the scales' dtype (the reference)."""
    n_q, g, gv = p.num_tokens, p.group_size, p.value_group_size
    h = p.k_payload.shape[1]
    kc = _unpack(p.k_payload, p.bits, p.head_dim).float().view(n_q // g, g, h, p.head_dim)
    k = kc * p.k_scales.float().unsqueeze(1) + p.k_zeros.float().unsqueeze(1)
    vc = _unpack(p.v_payload, p.bits, p.v_head_dim).float().view(n_q, h, p.v_head_dim // gv, gv)
    v = vc * p.v_scales.float().unsqueeze(-1) + p.v_zeros.float().unsqueeze(-1)
    dtype = p.k_scales.dtype
    return k.view(n_q, h, p.head_dim).to(dtype), v.view(n_q, h, p.v_head_dim).to(p.v_scales.dtype)


def reference(q: Tensor, p: Payload, scale: float, exclude: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Float32 ``(out [T, Hq, Dv], lse [T, Hq])`` of ``q [T, Hq, D]`` over the payload."""
    k, v = dequantize(p)
    hq, h = q.shape[1], k.shape[1]
    group = hq // h
    s = torch.einsum("thd,nhd->htn", q.float(), k.float().repeat_interleave(group, dim=1)) * scale
    if exclude is not None:
        s = s.masked_fill(exclude.repeat_interleave(group, dim=0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T]
    probs = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("htn,nhd->thd", probs, v.float().repeat_interleave(group, dim=1))
    return out, lse.t().contiguous()


@triton.jit
def unpack_codes(kp, rows, rows_ok, kvh, s0, s1, NC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 BITS: tl.constexpr):
    """Int32 codes ``[BLOCK_N, BLOCK_C]`` of ``rows`` for KV head ``kvh``: each packed byte
    is loaded once and split in registers (``8 // BITS`` codes a byte, lowest bits first).
    Loading a byte per code instead made the kernel bound by L1 requests on an H200."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = BLOCK_C // PER
    b = tl.arange(0, NB)
    byte = tl.load(kp + rows[:, None] * s0 + kvh * s1 + b[None, :],
                   mask=rows_ok[:, None] & (b[None, :] < (NC + PER - 1) // PER), other=0).to(tl.int32)
    shifts = tl.arange(0, PER) * BITS
    codes = (byte[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [BLOCK_N, BLOCK_C])


@triton.jit
def dequantize_keys(kp, ks, kz, n0, n_end, rows_ok, kvh, skp0, skp1, sks0, sks1, G: tl.constexpr, BITS: tl.constexpr,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Float32 keys ``[BLOCK_N, BLOCK_D]`` of rows ``n0 + arange(BLOCK_N)`` of KV head
    ``kvh`` (KIVI's keys: per channel, groups of ``G`` tokens share a scale and a zero
    point), rounded through the scales' dtype as the reference dequantizes them. ``n0`` is
    a multiple of ``BLOCK_N``: where ``G`` is too, the block is one group and its scales
    are one row, read only when the block starts before the payload's end ``n_end``."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    code = unpack_codes(kp, n, rows_ok, kvh, skp0, skp1, D, BLOCK_N, BLOCK_D, BITS)
    if G % BLOCK_N == 0:
        off = (n0 // G) * sks0 + kvh * sks1 + d
        sc = tl.load(ks + off, mask=(d < D) & (n0 + d * 0 < n_end), other=0.0)[None, :]
        zr = tl.load(kz + off, mask=(d < D) & (n0 + d * 0 < n_end), other=0.0)[None, :]
    else:
        mask = rows_ok[:, None] & (d[None, :] < D)
        off = (n // G)[:, None] * sks0 + kvh * sks1 + d[None, :]
        sc = tl.load(ks + off, mask=mask, other=0.0)
        zr = tl.load(kz + off, mask=mask, other=0.0)
    return (code.to(tl.float32) * sc.to(tl.float32) + zr.to(tl.float32)).to(sc.dtype).to(tl.float32)


@triton.jit
def dequantize_values(vp, vs, vz, n, rows_ok, kvh, svp0, svp1, svs0, svs1, GV: tl.constexpr, BITS: tl.constexpr,
                      DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, GV_POW2: tl.constexpr):
    """Values ``[BLOCK_N, BLOCK_DV]`` in the scales' dtype (KIVI's values: per token, groups
    of ``GV`` channels share a scale and a zero point). Where ``GV`` is a power of two the
    token's ``DV / GV`` scales are loaded once each and broadcast over their channels."""
    code = unpack_codes(vp, n, rows_ok, kvh, svp0, svp1, DV, BLOCK_N, BLOCK_DV, BITS)
    if GV_POW2:
        NG: tl.constexpr = BLOCK_DV // GV
        j = tl.arange(0, NG)
        off = n[:, None] * svs0 + kvh * svs1 + j[None, :]
        mask = rows_ok[:, None] & (j[None, :] < DV // GV)
        sc = tl.reshape(tl.broadcast_to(tl.load(vs + off, mask=mask, other=0.0)[:, :, None], [BLOCK_N, NG, GV]),
                        [BLOCK_N, BLOCK_DV])
        zr = tl.reshape(tl.broadcast_to(tl.load(vz + off, mask=mask, other=0.0)[:, :, None], [BLOCK_N, NG, GV]),
                        [BLOCK_N, BLOCK_DV])
    else:
        dv = tl.arange(0, BLOCK_DV)
        mask = rows_ok[:, None] & (dv[None, :] < DV)
        off = n[:, None] * svs0 + kvh * svs1 + dv[None, :] // GV
        sc = tl.load(vs + off, mask=mask, other=0.0)
        zr = tl.load(vz + off, mask=mask, other=0.0)
    return (code.to(tl.float32) * sc.to(tl.float32) + zr.to(tl.float32)).to(sc.dtype)


@triton.jit
def _kernel(q, kp, ks, kz, vp, vs, vz, excl, part_out, part_lse, scale, n_q,
            sq0, sq1, skp0, skp1, sks0, sks1, svp0, svp1, svs0, svs1, sx0, group, num_splits,
            G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXCL: tl.constexpr, DOT_F32: tl.constexpr,
            GV_POW2: tl.constexpr):
    """One (query row, KV head, payload split) of one payload."""
    attend_split(q, kp, ks, kz, vp, vs, vz, excl, part_out, part_lse, scale, n_q, tl.program_id(0),
                 tl.program_id(1), tl.program_id(2), tl.num_programs(1), sq0, sq1, skp0, skp1, sks0, sks1, svp0,
                 svp1, svs0, svs1, sx0, group, num_splits, G, GV, BITS, D, DV, BLOCK_G, BLOCK_D, BLOCK_DV, BLOCK_N,
                 HAS_EXCL, DOT_F32, GV_POW2, 0, False, 16)


@triton.jit
def attend_split(q, kp, ks, kz, vp, vs, vz, excl, part_out, part_lse, scale, n_q, t, kvh, sp, num_kv_heads,
                 sq0, sq1, skp0, skp1, sks0, sks1, svp0, svp1, svs0, svs1, sx0, group, num_splits,
                 G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_EXCL: tl.constexpr, DOT_F32: tl.constexpr, GV_POW2: tl.constexpr, n_excl,
                 EXCL_LIST: tl.constexpr, BLOCK_K: tl.constexpr):
    """Query row ``t``, KV head ``kvh``, split ``sp`` of a payload of ``n_q`` rows,
    flash-decoding as :mod:`.paged_attention`: the GQA group's query heads together, so
    each packed key and value is read and dequantized once per group and the scores are
    a ``tl.dot``; partial outputs and log-sum-exps go to ``part_out [T, Hq, S, DV]`` /
    ``part_lse [T, Hq, S]``. Rows left out: a mask ``excl [H, n_q]`` (``HAS_EXCL``) or a
    list of ``n_excl`` row positions per KV head, -1 for none (``EXCL_LIST``: SpeCache's
    top-k, compared in registers, no mask written)."""
    per = tl.cdiv(tl.cdiv(n_q, num_splits), BLOCK_N) * BLOCK_N
    lo = sp * per
    hi = tl.minimum(n_q, lo + per)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    in_group = g < group
    h = kvh * group + g
    dm = d < D
    dvm = dv < DV
    qv = tl.load(q + t * sq0 + h[:, None] * sq1 + d[None, :], mask=in_group[:, None] & dm[None, :], other=0.0)
    m = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    if EXCL_LIST:
        kk = tl.arange(0, BLOCK_K)
        sel = tl.load(excl + kvh * sx0 + kk, mask=kk < n_excl, other=-1)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        vis = n < hi
        if HAS_EXCL:
            ex = tl.load(excl + kvh * sx0 + n, mask=vis, other=0)
            vis = vis & (ex == 0)
        if EXCL_LIST:
            hit = tl.max((n[:, None] == sel[None, :]).to(tl.int32), axis=1)
            vis = vis & (hit == 0)
        # dequantized keys are exact in the scales' dtype (rounded through it); where that
        # is the query's dtype the dot runs in it (tensor cores), else in float32
        k = dequantize_keys(kp, ks, kz, n0, hi, vis, kvh, skp0, skp1, sks0, sks1, G, BITS, D, BLOCK_N, BLOCK_D)
        if DOT_F32:
            s = tl.dot(qv.to(tl.float32), tl.trans(k), input_precision="ieee") * scale  # [G, N]
        else:
            s = tl.dot(qv, tl.trans(k.to(qv.dtype)), input_precision="ieee") * scale
        s = tl.where(vis[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        pr = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = dequantize_values(vp, vs, vz, n, vis, kvh, svp0, svp1, svs0, svs1, GV, BITS, DV, BLOCK_N, BLOCK_DV,
                              GV_POW2)
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        m = m_new
    seen = l > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    row = (t * num_kv_heads * group + h) * num_splits + sp  # [T, Hq, S] flattened
    tl.store(part_out + row[:, None] * DV + dv[None, :], o, mask=in_group[:, None] & dvm[None, :])
    tl.store(part_lse + row, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), -float("inf")), mask=in_group)


# One request's payload per launch (T query rows of it): 32 splits and 64-row blocks were
# the fastest of 54 launch shapes for 32k 2-bit tokens, 8 KV heads, GQA 4 on an H200
# (63 us against 138 us at 16 and 32; a CUDA graph of the launch and the merge).
KIVI_MAX_SPLITS = 32


def check(p: Payload) -> None:
    if p.bits not in (1, 2, 4, 8):
        raise ValueError(f"kivi_attention: packed codes of 1, 2, 4 or 8 bits, got {p.bits}")
    if p.num_tokens % p.group_size:
        raise ValueError(f"kivi_attention: {p.num_tokens} payload tokens are not whole groups of {p.group_size}")


def kivi_attention(q: Tensor, p: Payload, scale: float, exclude: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Float32 ``(out [T, Hq, Dv], lse [T, Hq])`` of ``q [T, Hq, D]`` over the payload."""
    check(p)
    if backend_for(q) is Backend.TORCH:
        return reference(q, p, scale, exclude)
    t, hq, _ = q.shape
    h = p.k_payload.shape[1]
    out = torch.empty(t, hq, p.v_head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    excl = exclude.to(torch.uint8).contiguous() if exclude is not None else p.k_payload  # unused stand-in
    group = hq // h
    splits = num_splits(p.num_tokens, 1, most=KIVI_MAX_SPLITS)
    part_out = torch.empty(t, hq, splits, p.v_head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)
    launch("kivi_attention", _kernel, (t, h, splits), q, p.k_payload, p.k_scales, p.k_zeros, p.v_payload,
           p.v_scales, p.v_zeros, excl, part_out, part_lse, float(scale), p.num_tokens,
           q.stride(0), q.stride(1), p.k_payload.stride(0), p.k_payload.stride(1),
           p.k_scales.stride(0), p.k_scales.stride(1), p.v_payload.stride(0), p.v_payload.stride(1),
           p.v_scales.stride(0), p.v_scales.stride(1), excl.stride(0) if exclude is not None else 0,
           group, splits, HAS_EXCL=exclude is not None, **launch_constants(p, q, group))
    merge_splits(part_out, part_lse, out, lse)
    return out, lse


def launch_constants(p: Payload, q: Tensor, group: int) -> dict:
    """The constexprs of :func:`attend_split` that a payload's layout and the query fix."""
    return dict(G=p.group_size, GV=p.value_group_size, BITS=p.bits, D=p.head_dim, DV=p.v_head_dim,
                BLOCK_G=block(group), BLOCK_D=block(p.head_dim), BLOCK_DV=block(p.v_head_dim), BLOCK_N=64,
                DOT_F32=q.dtype != p.k_scales.dtype or q.dtype == torch.float32,
                GV_POW2=p.value_group_size & (p.value_group_size - 1) == 0
                and p.value_group_size <= block(p.v_head_dim))
