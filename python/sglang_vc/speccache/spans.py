"""SpecCache's token selection math (section 2.2-2.3 of "SpecCache: Speculative KV Cache
Reuse for Efficient RAG Serving"), on one prompt's per-token scores. Pure torch, no model.

* :func:`importance` (eq. 1): a token's importance is the mean L2 norm of its hidden
  states over the speculative model's deep layers (the last third);
* :func:`top_ratio` (eq. 2): the ``ceil(rho N)`` most important tokens;
* :func:`segment` (eqs. 3-4): spans of consecutive tokens whose normalized importance
  varies smoothly (relative change below ``tau_smooth``), at most ``max_span`` long;
* :func:`complete` (eqs. 5-6): a span whose share of selected tokens is at least
  ``tau_cover`` is selected whole;
* :func:`fit_budget`: the global budget control. Completion only adds tokens, so the
  largest initial top-K whose completed (and aligned) set still fits the budget is found
  by bisection (the sets are nested in K), then topped up with the next most important
  tokens: the set has exactly the budget's size, so a ratio is honoured exactly.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

TAU_SMOOTH = 0.4
TAU_COVER = 0.7
MAX_SPAN = 16


def deep_layers(num_layers: int) -> range:
    """The last third of ``num_layers`` layers (at least one)."""
    return range(num_layers - max(1, num_layers // 3), num_layers)


def importance(hidden_states: Sequence[Tensor]) -> Tensor:
    """Eq. 1: ``hidden_states`` are the outputs of every layer, each ``[N, d]``; returns
    ``[N]`` float32, the mean over the deep layers of each token's L2 norm."""
    layers = deep_layers(len(hidden_states))
    return torch.stack([hidden_states[i].float().norm(dim=-1) for i in layers]).mean(0)


def count(ratio: float, n: int) -> int:
    """``ceil(ratio * n)``, exact for ratios such as 0.15 (no float round-up to +1)."""
    return min(n, math.ceil(round(ratio * n, 9)))


def top_ratio(scores: Tensor, k: int) -> Tensor:
    """Eq. 2: a ``[N]`` bool mask of the ``k`` highest scores (ties: the earlier token)."""
    mask = torch.zeros(scores.shape[0], dtype=torch.bool)
    if k > 0:
        order = _rank(scores)
        mask[order[:k]] = True
    return mask


def _rank(scores: Tensor) -> Tensor:
    """Indices by decreasing score, ties broken by position (deterministic)."""
    return torch.sort(scores.float().cpu(), descending=True, stable=True).indices


def segment(scores: Tensor, tau_smooth: float = TAU_SMOOTH, max_span: int = MAX_SPAN) -> list[tuple[int, int]]:
    """Eqs. 3-4: spans ``(u, v)`` (inclusive) covering ``0 .. N-1`` in order. Scores are
    min-max normalized; token ``i + 1`` joins token ``i``'s span while
    ``|I~_{i+1} - I~_i| / I~_i < tau_smooth`` and the span is shorter than ``max_span``
    (at ``I~_i = 0``, the minimum, only an equal neighbour joins)."""
    n = scores.shape[0]
    if n == 0:
        return []
    s = scores.float().cpu()
    lo, hi = float(s.min()), float(s.max())
    norm = (s - lo) / (hi - lo) if hi > lo else torch.zeros_like(s)
    spans, start = [], 0
    for i in range(n - 1):
        a, b = float(norm[i]), float(norm[i + 1])
        delta = abs(b - a) / a if a > 0 else (0.0 if b == a else math.inf)
        if delta >= tau_smooth or i + 1 - start >= max_span:
            spans.append((start, i))
            start = i + 1
    spans.append((start, n - 1))
    return spans


def complete(mask: Tensor, spans: Sequence[tuple[int, int]], tau_cover: float = TAU_COVER) -> Tensor:
    """Eqs. 5-6: ``mask`` plus every span whose covered share is at least ``tau_cover``."""
    out = mask.clone()
    for u, v in spans:
        if float(mask[u : v + 1].float().mean()) >= tau_cover:
            out[u : v + 1] = True
    return out


def fit_budget(scores: Tensor, budget: int, expand: Callable[[Tensor], Tensor],
               size: Callable[[Tensor], int]) -> Tensor:
    """The global budget control: the largest ``k`` whose ``expand(top_ratio(scores, k))``
    has ``size <= budget``, then topped up with the next tokens by score (each counted
    through ``size``) while the budget allows. ``expand`` must be monotone (nested
    outputs for nested inputs); returns the expanded mask."""
    n = scores.shape[0]
    lo, hi = 0, n  # size(expand(top(lo))) <= budget always holds for lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(expand(top_ratio(scores, mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    chosen = expand(top_ratio(scores, lo))
    for i in _rank(scores).tolist():
        if chosen[i]:
            continue
        trial = chosen.clone()
        trial[i] = True
        if size(trial) <= budget:
            chosen = trial
        if size(chosen) >= budget:
            break
    return chosen
