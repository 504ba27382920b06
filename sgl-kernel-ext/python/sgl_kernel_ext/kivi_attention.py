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
def dequantize_keys(kp, ks, kz, n, d, kvh, mask, skp0, skp1, sks0, sks1, G, BITS: tl.constexpr):
    """Float32 keys of rows ``n``, channels ``d`` of KV head ``kvh`` from their packed codes
    (KIVI's keys: per channel, groups of ``G`` tokens share a scale and a zero point),
    rounded through the scales' dtype as the reference dequantizes them."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    byte = tl.load(kp + n[:, None] * skp0 + kvh * skp1 + d[None, :] // PER, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((d[None, :] % PER) * BITS)) & MASK
    grp = n // G
    sc = tl.load(ks + grp[:, None] * sks0 + kvh * sks1 + d[None, :], mask=mask, other=0.0)
    zr = tl.load(kz + grp[:, None] * sks0 + kvh * sks1 + d[None, :], mask=mask, other=0.0)
    return (code.to(tl.float32) * sc.to(tl.float32) + zr.to(tl.float32)).to(sc.dtype).to(tl.float32)


@triton.jit
def _kernel(q, kp, ks, kz, vp, vs, vz, excl, out, lse, scale, n_q,
            sq0, sq1, skp0, skp1, sks0, sks1, svp0, svp1, svs0, svs1, so0, so1, sx0, group, G, GV,
            BITS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXCL: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    dm = d < D
    dvm = dv < DV
    qv = tl.load(q + t * sq0 + h * sq1 + d, mask=dm, other=0.0).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, n_q, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inb = n < n_q
        vis = inb
        if HAS_EXCL:
            ex = tl.load(excl + kvh * sx0 + n, mask=inb, other=0)
            vis = inb & (ex == 0)
        mk = vis[:, None] & dm[None, :]
        k = dequantize_keys(kp, ks, kz, n, d, kvh, mk, skp0, skp1, sks0, sks1, G, BITS)
        s = tl.sum(k * qv[None, :], axis=1) * scale
        s = tl.where(vis, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        pr = tl.exp(s - m_safe)
        alpha = tl.exp(m - m_safe)
        mv = vis[:, None] & dvm[None, :]
        vbyte = tl.load(vp + n[:, None] * svp0 + kvh * svp1 + dv[None, :] // PER, mask=mv, other=0).to(tl.int32)
        vcode = (vbyte >> ((dv[None, :] % PER) * BITS)) & MASK
        vsc = tl.load(vs + n[:, None] * svs0 + kvh * svs1 + dv[None, :] // GV, mask=mv, other=0.0)
        vzr = tl.load(vz + n[:, None] * svs0 + kvh * svs1 + dv[None, :] // GV, mask=mv, other=0.0)
        v = (vcode.to(tl.float32) * vsc.to(tl.float32) + vzr.to(tl.float32)).to(vsc.dtype).to(tl.float32)
        l = l * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
        m = m_new
    seen = l > 0
    tl.store(out + t * so0 + h * so1 + dv, tl.where(seen, acc / tl.where(seen, l, 1.0), 0.0), mask=dvm)
    tl.store(lse + t * tl.num_programs(1) + h, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), -float("inf")))


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
    launch("kivi_attention", _kernel, (t, hq), q, p.k_payload, p.k_scales, p.k_zeros, p.v_payload, p.v_scales,
           p.v_zeros, excl, out, lse, float(scale), p.num_tokens,
           q.stride(0), q.stride(1), p.k_payload.stride(0), p.k_payload.stride(1),
           p.k_scales.stride(0), p.k_scales.stride(1), p.v_payload.stride(0), p.v_payload.stride(1),
           p.v_scales.stride(0), p.v_scales.stride(1), out.stride(0), out.stride(1),
           excl.stride(0) if exclude is not None else 0, hq // h, p.group_size, p.value_group_size,
           BITS=p.bits, D=p.head_dim, DV=p.v_head_dim, BLOCK_D=block(p.head_dim), BLOCK_DV=block(p.v_head_dim),
           BLOCK_N=32, HAS_EXCL=exclude is not None)
    return out, lse
