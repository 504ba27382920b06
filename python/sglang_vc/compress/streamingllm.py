"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024, arXiv:2309.17453).

Rule: keep the first ``n_sink`` tokens ("attention sinks", 4 in the paper) and a sliding
window of the most recent tokens; everything in between is dropped. Expressed as a score:
the position itself (more recent = more important) with the sinks protected, so the
budget left after the sinks goes to the most recent tokens. Same positions on every head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .scorer import ScorerCompressor


@dataclass
class StreamingLLM(ScorerCompressor):
    name: ClassVar[str] = "streamingllm"

    n_sink: int = 4

    def score(self, layer_idx, k, v, *, queries=None, **inputs) -> Tensor:
        n, h = k.shape[0], k.shape[1]
        return torch.arange(n, device=k.device, dtype=torch.float32).expand(h, n)

    def protected(self, num_tokens, n_keep, *, queries=None):
        return self.n_sink, 0
