"""In-pool self-speculation's draft view: which of a request's own pool rows a draft step
attends to when its full KV stays resident (MagicDec's StreamingLLM-style draft KV).

A draft query at position ``t`` (so ``T = t + 1`` attendable positions) sees every
position when ``T <= budget``, else the first ``sinks`` positions (attention sinks) and the
last ``budget - sinks`` (a window that slides with generation; it holds the drafts made
since the last verify). The view is an index list over the request's row of
``req_to_token``: no copy of rows, no second KV. Built on the device for the whole batch
with fixed shape ``[n, budget]`` (a validity mask pads short requests), so a draft
iteration has fixed shapes: one gather and one attention call per layer whatever the
batch, nothing read back on the host.

Not built: SparseSpec's re-selected view (the tokens the previous verify attended most);
the offline lab measures it (``bench.fidelity``, ``reselect@B``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_BUDGET = 512
SINKS = 4


@dataclasses.dataclass(frozen=True)
class DraftBudget:
    """``--vc-draft-budget``: a token count (``512``) or a ratio of the request's length
    (``0.125``)."""

    tokens: Optional[int] = DEFAULT_BUDGET
    ratio: Optional[float] = None

    @classmethod
    def parse(cls, text: str) -> "DraftBudget":
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise ValueError(f"--vc-draft-budget takes a token count (e.g. 512) or a ratio in (0, 1), got {text!r}")
        if 0 < value < 1:
            return cls(tokens=None, ratio=value)
        if value >= 1 and value == int(value) and int(value) > SINKS:
            return cls(tokens=int(value), ratio=None)
        raise ValueError(f"--vc-draft-budget takes a token count above {SINKS} (the sinks) or a ratio in (0, 1), "
                         f"got {text!r}")

    def rows(self, length: int) -> int:
        """The budget, in rows, for a request of ``length`` tokens."""
        if self.tokens is not None:
            return self.tokens
        return max(SINKS + 1, int(self.ratio * length))

    def describe(self) -> str:
        return f"{self.tokens} tokens" if self.tokens is not None else f"{self.ratio:g} of the length"

    @property
    def name(self) -> str:
        """The drafter's name in acceptance curves and counters."""
        return f"in-pool:window@{self.tokens if self.tokens is not None else f'{self.ratio:g}'}"


def view_positions(lengths: Tensor, budgets: Tensor, width: int, sinks: int = SINKS) -> tuple[Tensor, Tensor]:
    """Row positions ``[n, width]`` each request's draft query attends to, and their
    validity (``lengths``: attendable positions per request, the query's own included;
    ``budgets``: each request's budget, at most ``width``)."""
    j = torch.arange(width, device=lengths.device)[None, :]
    length = lengths.to(torch.int64)[:, None]
    budget = budgets.to(torch.int64)[:, None]
    tail = length - budget + j  # the sliding window's positions
    pos = torch.where((length <= budget) | (j < sinks), j, tail)
    valid = (j < length) & (j < budget)
    return pos.clamp(min=0), valid


def view_slots(req_to_token: Tensor, rows: Tensor, lengths: Tensor, budgets: Tensor, width: int,
               sinks: int = SINKS) -> tuple[Tensor, Tensor]:
    """The pool slots ``[n, width]`` of :func:`view_positions` (padding is masked out)."""
    pos, valid = view_positions(lengths, budgets, width, sinks)
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    slots = req_to_token[rows.to(torch.int64)[:, None], pos].to(torch.int64)
    return slots, valid


def attend_view(q: Tensor, k_buf: Tensor, v_buf: Tensor, slots: Tensor, valid: Tensor, scale: float) -> Tensor:
    """One decode query per request (``q [n, Hq, D]``) over its view's rows of the pool
    (``k_buf/v_buf [slots, Hkv, D]``): one gather and one batched SDPA for the batch.
    Returns ``[n, Hq, Dv]``."""
    hq = q.shape[1]
    k = k_buf[slots].transpose(1, 2)  # [n, Hkv, budget, D]
    v = v_buf[slots].transpose(1, 2)
    mask = valid[:, None, None, :]  # [n, 1, 1, budget]
    out = F.scaled_dot_product_attention(q[:, :, None, :].to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != hq)
    return out[:, :, 0, :]
