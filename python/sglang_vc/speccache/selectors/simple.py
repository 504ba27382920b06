"""The reference selectors: ``full-reuse`` (nothing recomputed), ``full-recompute``
(every chunk token), ``random`` (a seeded uniform subset) and ``epic`` (the first tokens
of each chunk, as "EPIC: Efficient Position-Independent Context Caching")."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectionInput, Selector, top_chunk_tokens


class FullReuse(Selector):
    name = "full-reuse"

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        return torch.zeros(inp.chunks.num_tokens, dtype=torch.bool)


class FullRecompute(Selector):
    name = "full-recompute"

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        return inp.chunks.mask()


class Random(Selector):
    name = "random"

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        g = torch.Generator().manual_seed(inp.seed)
        scores = torch.rand(inp.chunks.num_tokens, generator=g)
        return top_chunk_tokens(scores, inp.chunks, inp.chunks.budget(ratio))


class Epic(Selector):
    """The first tokens of each chunk: the budget is shared out over the chunks in
    proportion to their lengths (largest remainders first), so the total is exact."""

    name = "epic"

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        chunks = inp.chunks
        budget = chunks.budget(ratio)
        lengths = [e - s for s, e in zip(chunks.starts, chunks.ends)]
        total = sum(lengths) or 1
        share = [budget * n / total for n in lengths]
        per = [int(x) for x in share]
        for i in sorted(range(len(per)), key=lambda i: per[i] - share[i])[: budget - sum(per)]:
            per[i] += 1
        out = torch.zeros(chunks.num_tokens, dtype=torch.bool)
        for s, k in zip(chunks.starts, per):
            out[s : s + k] = True
        return out
