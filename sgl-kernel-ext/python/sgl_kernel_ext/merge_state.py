"""Merge two partial attentions of the same queries over disjoint key sets, from their
outputs and (natural) log-sum-exps. Used where a request's keys come from two places: a
quantized payload attended by :mod:`.kivi_attention` and pool rows attended by
:mod:`.paged_attention`.

A few elementwise torch ops on any device. FlashInfer has the same operator
(``flashinfer.cascade.merge_state``, base-2 log-sum-exps); it is not used because it was
never run here, and the torch formula is not where the time goes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the union: ``o [T, H, D]`` float32, ``lse [T, H]``; a side that
    saw no key has ``lse = -inf`` and weight 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse
