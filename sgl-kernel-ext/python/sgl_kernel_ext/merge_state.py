"""Merge two partial attentions of the same queries over disjoint key sets, from their
outputs and log-sum-exps (FlashInfer's ``merge_state``, which runs on CUDA; the torch
formula elsewhere). Used where a request's keys come from two places: a quantized payload
attended by :mod:`.kivi_attention` and pool rows attended by :mod:`.paged_attention`."""

from __future__ import annotations

import torch
from torch import Tensor


def reference(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the union: ``o [T, H, D]`` float32, ``lse [T, H]`` (natural log)."""
    if o_a.is_cuda:
        try:
            from flashinfer.cascade import merge_state as fi_merge
        except ImportError:
            return reference(o_a, lse_a, o_b, lse_b)
        # FlashInfer's states are base-2 log-sum-exps
        log2e = 1.4426950408889634
        out, lse2 = fi_merge(o_a.contiguous(), (lse_a * log2e).contiguous(), o_b.contiguous(),
                             (lse_b * log2e).contiguous())
        return out, lse2 / log2e
    return reference(o_a, lse_a, o_b, lse_b)
