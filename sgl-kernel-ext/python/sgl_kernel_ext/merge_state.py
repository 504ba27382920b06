"""Merge two partial attentions of the same queries over disjoint key sets, from their
outputs and (natural) log-sum-exps. Used where a request's keys come from two places: a
quantized payload attended by :mod:`.kivi_attention` and pool rows attended by
:mod:`.paged_attention`, or SpeCache's fetched rows beside its payload.

One Triton launch on CUDA (the torch formula is eleven elementwise kernels, and a
drafting layer merges three times); the torch reference elsewhere. FlashInfer has the
same operator (``flashinfer.cascade.merge_state``, base-2 log-sum-exps); it is not used
because it was never run here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch


def reference(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


@triton.jit
def _kernel(o_a, lse_a, o_b, lse_b, out, lse, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_DV)
    la = tl.load(lse_a + row)
    lb = tl.load(lse_b + row)
    m = tl.maximum(la, lb)
    seen = m > -float("inf")
    m_safe = tl.where(seen, m, 0.0)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = tl.where(seen, wa + wb, 1.0)
    a = tl.load(o_a + row * DV + d, mask=d < DV, other=0.0)
    b = tl.load(o_b + row * DV + d, mask=d < DV, other=0.0)
    tl.store(out + row * DV + d, (a * wa + b * wb) / total, mask=d < DV)
    tl.store(lse + row, tl.where(seen, m_safe + tl.log(total), -float("inf")))


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the union: ``o [T, H, D]`` float32, ``lse [T, H]``; a side that
    saw no key has ``lse = -inf`` and weight 0."""
    if backend_for(o_a) is Backend.TORCH:
        return reference(o_a, lse_a, o_b, lse_b)
    o_a, o_b = o_a.float().contiguous(), o_b.float().contiguous()
    lse_a, lse_b = lse_a.float().contiguous(), lse_b.float().contiguous()
    out = torch.empty_like(o_a)
    lse = torch.empty_like(lse_a)
    if lse.numel():
        dv = o_a.shape[-1]
        launch("merge_state", _kernel, (lse.numel(),), o_a, lse_a, o_b, lse_b, out, lse, DV=dv, BLOCK_DV=block(dv))
    return out, lse
