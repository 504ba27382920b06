"""KNorm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", EMNLP 2024, arXiv:2406.11430).

Rule: keys with a *low* L2 norm receive high attention, so keep, per head, the keys with
the lowest ``||k||_2`` (score = ``-||k||_2``). No query, no protected window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .scorer import ScorerCompressor


@dataclass
class KNorm(ScorerCompressor):
    name: ClassVar[str] = "knorm"

    def score(self, layer_idx, k, v, *, queries=None, **inputs) -> Tensor:
        return -k.float().norm(dim=-1).t()  # [H, n]
