"""The token-selector interface: which target tokens of a RAG prompt's reused chunks are
recomputed in its prefill.

A prompt is ``[chunk 1][chunk 2]...[chunk c][query]`` in the target's tokens. The query
(everything after the last chunk) is always computed; a selector picks, among the chunk
tokens, ``budget = ceil(ratio * chunk tokens)`` to recompute (the rest reuse their
precomputed KV). Each selector says what it needs (:class:`Need`); the runtime computes
only that. ``ratio = 1`` must give every chunk token, ``ratio = 0`` none.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch
from torch import Tensor

from ..spans import count


class Need(enum.Enum):
    NOTHING = "nothing"
    SPEC_SCORES = "spec_scores"  # the speculative model's per-token importance (eq. 1)
    FIRST_LAYER_DEVIATION = "first_layer_deviation"  # the target's layer-0 KV deviation


@dataclass(frozen=True)
class Chunks:
    """The chunk layout of one prompt in the target's tokens: chunk ``i`` is
    ``[starts[i], ends[i])``; tokens from ``ends[-1]`` on are the query."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        prev = 0
        for s, e in zip(self.starts, self.ends):
            if not prev <= s <= e <= self.num_tokens:
                raise ValueError(f"chunks must be ordered, disjoint spans of the prompt: {self}")
            prev = e

    def mask(self) -> Tensor:
        """``[num_tokens]`` bool: the chunk tokens (candidates for reuse)."""
        m = torch.zeros(self.num_tokens, dtype=torch.bool)
        for s, e in zip(self.starts, self.ends):
            m[s:e] = True
        return m

    @property
    def num_chunk_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))

    def budget(self, ratio: float) -> int:
        return count(ratio, self.num_chunk_tokens)


@dataclass
class SelectionInput:
    chunks: Chunks
    # Need.SPEC_SCORES: a callable giving (spec-token importance [N], alignment to the
    # target tokens), computed lazily so that only the selectors that need it pay for it
    spec_scores: Optional[Callable[[], tuple[Tensor, object]]] = None
    first_layer_deviation: Optional[Tensor] = None  # [num_tokens]
    seed: int = 0
    notes: dict = field(default_factory=dict)  # what the selector measured (shown in stats)


class Selector(ABC):
    """Picks the recomputed chunk tokens: returns a ``[num_tokens]`` bool mask that is
    a subset of the chunk tokens of exactly ``chunks.budget(ratio)`` tokens (fewer only
    where a selector's rule cannot reach it, said in its docstring)."""

    name: ClassVar[str]
    needs: ClassVar[Need] = Need.NOTHING

    @abstractmethod
    def select(self, inp: SelectionInput, ratio: float) -> Tensor: ...


def top_chunk_tokens(scores: Tensor, chunks: Chunks, budget: int) -> Tensor:
    """The ``budget`` chunk tokens of highest score (ties: the earlier token)."""
    masked = torch.where(chunks.mask(), scores.float().cpu(), torch.tensor(float("-inf")))
    order = torch.sort(masked, descending=True, stable=True).indices[:budget]
    out = torch.zeros(chunks.num_tokens, dtype=torch.bool)
    out[order] = True
    return out & chunks.mask()
