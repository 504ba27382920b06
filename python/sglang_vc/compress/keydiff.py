"""KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments", arXiv:2504.15364).

Rule: keys that are distinctive carry information; keys similar to the average key are
redundant. Per head, the anchor is the mean of the L2-normalised keys and the score is
``-cos(k_i, anchor)``: the keys *least* similar to the mean key are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from .scorer import ScorerCompressor


@dataclass
class KeyDiff(ScorerCompressor):
    name: ClassVar[str] = "keydiff"

    def score(self, layer_idx, k, v, *, queries=None, **inputs) -> Tensor:
        kf = k.float()
        anchor = F.normalize(kf, dim=-1).mean(dim=0, keepdim=True)  # [1, H, D]
        return -F.cosine_similarity(kf, anchor, dim=-1).t()  # [H, n]
