"""``speccache``: the speculative model's importance (eq. 1), top ``ceil(rho N)`` (eq. 2),
span completion (eqs. 3-6), cross-tokenizer alignment (eq. 7) and the global budget:
the largest initial top-K whose completed, aligned set fits the target budget, topped up
to exactly the budget (:func:`..spans.fit_budget`). Only chunk tokens are candidates: a
speculative token that maps onto query tokens is not counted and not selected."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import spans as sp
from ..align import Alignment
from .base import Need, SelectionInput, Selector


class SpecCacheSelector(Selector):
    name = "speccache"
    needs = Need.SPEC_SCORES

    def __init__(self, tau_smooth: float = sp.TAU_SMOOTH, tau_cover: float = sp.TAU_COVER,
                 max_span: int = sp.MAX_SPAN):
        self.tau_smooth, self.tau_cover, self.max_span = tau_smooth, tau_cover, max_span

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        if inp.spec_scores is None:
            raise ValueError("speccache needs the speculative model's scores")
        chunks = inp.chunks
        budget = chunks.budget(ratio)
        scores, alignment = inp.spec_scores()
        assert isinstance(alignment, Alignment)
        in_chunk = chunks.mask()
        # a speculative token is a candidate when all the target tokens it covers are chunk tokens
        cand = torch.tensor([bool(in_chunk[s:e].all()) and e > s
                             for s, e in zip(alignment.start.tolist(), alignment.end.tolist())], dtype=torch.bool)
        masked = torch.where(cand, scores.float().cpu(), torch.tensor(float("-inf")))
        spans = sp.segment(scores, self.tau_smooth, self.max_span)

        def expand(mask: Tensor) -> Tensor:
            return sp.complete(mask, spans, self.tau_cover) & cand

        def size(mask: Tensor) -> int:
            return alignment.target_count(mask & cand)

        chosen = sp.fit_budget(masked, budget, expand, size)
        target = alignment.to_target(chosen & cand) & in_chunk
        inp.notes["spec_tokens_selected"] = int((chosen & cand).sum())
        return target
