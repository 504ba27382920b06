"""The attention mask of a selective prefill (SpecCache, CacheBlend): queries at
arbitrary positions ``q_pos [T]`` over ``num_prefix`` rows every query sees followed by
rows at ``k_pos [N]``; query ``t`` sees row ``n`` when ``k_pos[n] <= q_pos[t]``.

:mod:`.paged_attention` applies this mask inside its kernel; this builds it as a tensor
for a dense attention call (SDPA's ``attn_mask``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, launch


def reference(q_pos: Tensor, k_pos: Tensor, num_prefix: int) -> Tensor:
    visible = k_pos.view(1, -1) <= q_pos.view(-1, 1)
    return torch.cat([visible.new_ones(q_pos.numel(), num_prefix), visible], dim=1)


@triton.jit
def _kernel(q_pos, k_pos, out, n_k, num_prefix, so0, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    qp = tl.load(q_pos + t)
    inb = c < num_prefix + n_k
    kp = tl.load(k_pos + (c - num_prefix), mask=inb & (c >= num_prefix), other=0)
    vis = (c < num_prefix) | (kp <= qp)
    tl.store(out + t * so0 + c, vis.to(tl.int8), mask=inb)


def position_mask(q_pos: Tensor, k_pos: Tensor, num_prefix: int = 0) -> Tensor:
    """Bool ``[T, num_prefix + N]``."""
    if backend_for(q_pos) is Backend.TORCH:
        return reference(q_pos, k_pos, num_prefix)
    t, n = q_pos.numel(), k_pos.numel()
    out = torch.empty(t, num_prefix + n, dtype=torch.int8, device=q_pos.device)
    if t and num_prefix + n:
        bc = 128
        launch("position_mask", _kernel, (t, triton.cdiv(num_prefix + n, bc)), q_pos.contiguous(),
               k_pos.to(q_pos.dtype).contiguous(), out, n, num_prefix, out.stride(0), BLOCK=bc)
    return out.bool()
