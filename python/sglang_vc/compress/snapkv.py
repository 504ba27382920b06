"""SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation",
NeurIPS 2024, arXiv:2404.14469).

Rule: the last ``W`` prompt tokens (the observation window) already attend to what the
generation will need. For each q head, sum the window queries' (causal, softmax)
attention over the prefix positions ("voting"), smooth it with a 1-D pooling of width
``kernel_size`` so that neighbours of important tokens survive too (clustering), average
the q heads of a GQA group onto their KV head, and keep the top-k prefix positions per
head plus the whole observation window.

Input: ``queries`` = the last W queries of this layer ``[W, num_q_heads, head_dim]``
(post-RoPE, like the keys); W is taken from ``queries.shape[0]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .scorer import ScorerCompressor, grouped_attention


@dataclass
class SnapKV(ScorerCompressor):
    name: ClassVar[str] = "snapkv"
    needs_queries: ClassVar[str] = "observation_window"

    kernel_size: int = 5  # SnapKV reference code default (odd, keeps the length)
    pooling: str = "avg"  # "avg" or "max", both in the SnapKV code
    sm_scale: float | None = None

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv: kernel_size must be a positive odd integer, got {self.kernel_size}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"snapkv: pooling must be 'avg' or 'max', got {self.pooling!r}")

    def score(self, layer_idx, k, v, *, queries=None, **inputs) -> Tensor:
        n = k.shape[0]
        if queries is None or queries.dim() != 3:
            raise ValueError(
                "snapkv needs queries=[W, num_q_heads, head_dim]: the last W (observation window) "
                "queries of this layer"
            )
        w = queries.shape[0]
        if not 0 < w < n:
            raise ValueError(f"snapkv: observation window W={w} must be in [1, num_tokens={n})")
        q_pos = torch.arange(n - w, n, device=k.device)
        probs = grouped_attention(queries, k, q_pos, sm_scale=self.sm_scale)  # [H, G, W, n]
        votes = probs[..., : n - w].sum(dim=2)  # [H, G, n - W]
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        votes = pool(votes, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        scores = votes.mean(dim=1)  # GQA: average the group onto its KV head
        return F.pad(scores, (0, w), value=0.0)  # window positions are protected anyway

    def protected(self, num_tokens, n_keep, *, queries=None):
        return 0, 0 if queries is None else queries.shape[0]
