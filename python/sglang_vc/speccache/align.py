"""Cross-tokenizer alignment (eq. 7 of SpecCache) by character offsets.

The speculative and target models tokenize the same text; a speculative token covers the
characters ``[a, b)`` and maps to every target token whose characters overlap them, so a
selected token recomputes all target sub-tokens of the same text. Offsets come from the
fast tokenizers' ``return_offsets_mapping``; both sequences are in text order, so the
target tokens of a speculative token are one contiguous range, found by binary search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Alignment:
    """Speculative token ``i`` maps to target tokens ``start[i] .. end[i] - 1``."""

    start: Tensor  # [N] int64
    end: Tensor  # [N] int64
    num_target: int

    def to_target(self, mask: Tensor) -> Tensor:
        """A ``[N]`` bool mask over speculative tokens -> the ``[M]`` mask of the target
        tokens they cover (eq. 7)."""
        sel = mask.nonzero().flatten()
        delta = torch.zeros(self.num_target + 1, dtype=torch.int64)
        delta.index_add_(0, self.start[sel], torch.ones_like(sel))
        delta.index_add_(0, self.end[sel], -torch.ones_like(sel))
        return delta.cumsum(0)[: self.num_target] > 0

    def target_count(self, mask: Tensor) -> int:
        return int(self.to_target(mask).sum())


def align(spec_offsets: Sequence[tuple[int, int]], target_offsets: Sequence[tuple[int, int]]) -> Alignment:
    """Map each speculative token (character span ``[a, b)``) to the target tokens whose
    spans overlap it (``c < b`` and ``d > a``). An empty span (a special token) maps to
    nothing."""
    spec = torch.tensor(list(spec_offsets), dtype=torch.int64).view(-1, 2)
    tgt = torch.tensor(list(target_offsets), dtype=torch.int64).view(-1, 2)
    m = tgt.shape[0]
    if m and (bool((tgt[1:, 0] < tgt[:-1, 0]).any()) or bool((tgt[1:, 1] < tgt[:-1, 1]).any())):
        raise ValueError("target offsets are not in text order")
    a, b = spec[:, 0].contiguous(), spec[:, 1].contiguous()
    # first target token ending after a; first target token starting at or after b
    start = torch.searchsorted(tgt[:, 1].contiguous(), a, right=True)
    end = torch.searchsorted(tgt[:, 0].contiguous(), b, right=False)
    end = torch.where(b > a, torch.maximum(end, start), start)
    return Alignment(start, end, m)


def identity(n: int) -> Alignment:
    """Same tokenizer: token ``i`` is token ``i``."""
    idx = torch.arange(n, dtype=torch.int64)
    return Alignment(idx, idx + 1, n)
