"""In-pool self-speculation's draft view: which of a request's own pool rows a draft step
attends to when its full KV stays resident (MagicDec's StreamingLLM-style draft KV).

A draft query at position ``t`` (so ``T = t + 1`` attendable positions) sees every
position when ``T <= budget``, else:

* ``window`` (MagicDec's StreamingLLM draft): the first ``sinks`` positions (attention
  sinks) and the last ``budget - sinks`` (a window that slides with generation; it holds
  the drafts made since the last verify);
* ``reselect`` (SparseSpec's PillarAttn): per layer and KV head, the sinks, a recent
  window of ``budget // 4`` and the ``budget - sinks - budget // 4`` positions the last
  verify's queries attended most (:func:`select_positions`, scored in that verify's
  forward). Until a request's first verify it is the window view.
* ``shared``: the same split, one selection for every layer and KV head, from the verify's
  scores summed over them all (:func:`pillar_scores`): one row list per request, which
  SGLang's backends read from a view row of ``req_to_token`` (:mod:`.view_rows`).

The view is an index list over the request's row of ``req_to_token``: no copy of rows, no
second KV. Built on the device for the whole batch with fixed shapes (a validity mask pads
short requests): one gather and one attention call per layer whatever the batch, nothing
read back on the host.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_BUDGET = 512
SINKS = 4


class View(str, enum.Enum):
    WINDOW = "window"
    SHARED = "shared"  # one re-selection for every layer and KV head
    RESELECT = "reselect"


@dataclasses.dataclass(frozen=True)
class DraftBudget:
    """``--vc-draft-budget``: a token count (``512``) or a ratio of the request's length
    (``0.125``); and ``--vc-draft-view``."""

    tokens: Optional[int] = DEFAULT_BUDGET
    ratio: Optional[float] = None
    view: View = View.WINDOW

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
        return f"in-pool:{self.view.value}@{self.tokens if self.tokens is not None else f'{self.ratio:g}'}"

    def split(self, length: int) -> tuple[int, int]:
        """``(selected, recent)`` rows of a request's view beside the sinks: the window
        view selects none; the re-selected one keeps a quarter of the budget recent."""
        rows = self.rows(length)
        if self.view is View.WINDOW:
            return 0, rows - SINKS
        recent = max(1, rows // 4)
        return rows - SINKS - recent, recent


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


def reselect_positions(lengths: Tensor, selected: Tensor, n_selected: Tensor, recent: Tensor, recent_width: int,
                       sinks: int = SINKS) -> tuple[Tensor, Tensor]:
    """Per KV head ``[n, H, sinks + K + recent_width]`` positions and validity of the
    re-selected view: sinks, the ``n_selected`` positions of ``selected [n, H, K]`` (chosen
    below the recent window, so nothing is attended twice), the last ``recent`` positions.
    A request with ``T <= sinks + n_selected + recent`` sees ``[0, T)``."""
    n, h, k = selected.shape
    width = sinks + k + recent_width
    j = torch.arange(width, device=lengths.device)[None, None, :]
    length = lengths.to(torch.int64)[:, None, None]
    n_sel, rec = n_selected.to(torch.int64)[:, None, None], recent.to(torch.int64)[:, None, None]
    r = j - sinks - k  # index in the recent part
    pos = torch.where(j < sinks, j, length - rec + r)
    sel = torch.cat([torch.zeros(n, h, sinks, dtype=torch.int64, device=lengths.device), selected.to(torch.int64),
                     torch.zeros(n, h, recent_width, dtype=torch.int64, device=lengths.device)], dim=2)
    in_sel = (j >= sinks) & (j < sinks + k)
    pos = torch.where(in_sel, sel, pos)
    valid = (j < sinks) | (in_sel & (j - sinks < n_sel)) | ((r >= 0) & (r < rec))
    short = length <= sinks + n_sel + rec
    pos = torch.where(short, j.expand(n, h, width), pos)
    valid = torch.where(short, j < length, valid)
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    return pos, valid.expand(n, h, width)


def select_positions(q: Tensor, k_rows: Tensor, first: int, count: int, scale: float) -> Tensor:
    """The ``count`` positions per KV head that a verify's queries ``q [w, Hq, D]`` attend
    most among the candidates ``k_rows [m, Hkv, D]`` at positions ``first ..``: softmax
    over the candidates, summed over the queries and the query heads of the KV head's
    group (SparseSpec's PillarAttn score). Returns ``[Hkv, count]`` positions."""
    w, hq, d = q.shape
    hkv = k_rows.shape[1]
    qg = q.view(w, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, w * group, D]
    logits = torch.einsum("hqd,mhd->hqm", qg.to(k_rows.dtype), k_rows) * scale
    score = torch.softmax(logits.float(), dim=-1).sum(dim=1)  # [Hkv, m]
    return score.topk(count, dim=-1).indices + first


def pillar_scores(q: Tensor, k_rows: Tensor, scale: float) -> Tensor:
    """The score of each candidate row ``k_rows [m, Hkv, D]`` under a verify's queries
    ``q [w, Hq, D]``: softmax over the candidates, summed over the queries and every query
    head (the shared view's; :func:`select_positions` keeps the KV heads apart). ``[m]``."""
    w, hq, d = q.shape
    hkv = k_rows.shape[1]
    qg = q.view(w, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)
    logits = torch.einsum("hqd,mhd->hqm", qg.to(k_rows.dtype), k_rows) * scale
    return torch.softmax(logits.float(), dim=-1).sum(dim=(0, 1))


def compact(pos: Tensor, valid: Tensor) -> Tensor:
    """``pos [n, width]`` with each row's valid entries moved to its front, in order (a
    view row holds its view's slots in its first ``view length`` entries)."""
    j = torch.arange(pos.shape[-1], device=pos.device)
    order = torch.where(valid, j, j + pos.shape[-1]).argsort(dim=-1)
    return pos.gather(-1, order)


def attend_view(q: Tensor, k_buf: Tensor, v_buf: Tensor, slots: Tensor, valid: Tensor, scale: float) -> Tensor:
    """One decode query per request (``q [n, Hq, D]``) over its view's rows of the pool
    (``k_buf/v_buf [slots, Hkv, D]``; ``slots [n, width]`` shared by the KV heads, or
    ``[n, Hkv, width]`` per head): one gather and one batched SDPA for the batch.
    Returns ``[n, Hq, Dv]``."""
    hq = q.shape[1]
    if slots.dim() == 2:
        k = k_buf[slots].transpose(1, 2)  # [n, Hkv, width, D]
        v = v_buf[slots].transpose(1, 2)
        mask = valid[:, None, None, :]  # [n, 1, 1, width]
    else:
        heads = torch.arange(slots.shape[1], device=slots.device)[None, :, None]
        k, v = k_buf[slots, heads], v_buf[slots, heads]  # [n, Hkv, width, D]
        mask = valid.repeat_interleave(hq // slots.shape[1], dim=1)[:, :, None, :]  # [n, Hq, 1, width]
    out = F.scaled_dot_product_attention(q[:, :, None, :].to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != hq)
    return out[:, :, 0, :]
