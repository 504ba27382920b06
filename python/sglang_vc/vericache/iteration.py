"""One staggered iteration's state, from its plan to what it commits.

:class:`~.staggered_round.StaggeredRound` runs an iteration as ``plan -> forward ->
commit``: the plan is an :class:`Iteration` (the schedule's roles, the verifiers staged in
the pool, and the :class:`~.forward_plan.ForwardPlan` of its one forward); the commit is
a :class:`Committed` (each request's accepted tokens, and what the schedule's trace
records of it). Both are passed from step to step; nothing is kept between iterations.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from .staggered_schedule import Outcome, Role

if TYPE_CHECKING:
    from .forward_plan import ForwardPlan
    from .policy import IterationRows
    from .staggered_schedule import IterationPlan, Slot
    from .staging import PoolStaging


@dataclasses.dataclass
class Iteration:
    """One staggered iteration: SGLang's ``batch``, the schedule's roles (``slots``),
    each request's ``req_to_token`` row and last token (``t0``: its KV not computed yet),
    the requests this iteration forwards, and the verifiers' full KV staged in the pool."""

    batch: object
    slots: "IterationPlan"
    rows: list[int]
    t0: list[int]
    drafters: "list[Slot]"
    full: "list[Slot]"  # decode one token from full KV (its ADMIT fallbacks restored)
    verifiers: "list[Slot]"  # staged: they verify this iteration
    staging: "PoolStaging"
    forward: "Optional[ForwardPlan]" = None  # None: nothing forwards (every request waits)
    reloads: dict = dataclasses.field(default_factory=dict)  # forward index -> its LayerwiseReload
    terms: "Optional[IterationRows]" = None  # the mode policy's regressors of the forward
    verify_tokens: int = 0
    sub: object = None  # SGLang's batch of the forwarded requests (set by the forward)
    # the batch's requests as planned: SGLang filters and merges ``batch`` in place, and
    # an overlapped iteration settles after it has built the next one (:mod:`.deferred`)
    reqs: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.reqs:
            self.reqs = list(self.batch.reqs)

    @property
    def part(self) -> "list[Slot]":
        """The requests the forward runs, in batch order."""
        return sorted(self.drafters + self.full + self.verifiers, key=lambda s: s.index)

    def query_owner(self) -> torch.Tensor:
        """The forward's request index of each query row."""
        return torch.arange(len(self.forward.lens)).repeat_interleave(torch.tensor(self.forward.lens))

    def runs(self) -> tuple[list, list[int]]:
        """Per forwarded request, the drafts its rows follow (none for a full-KV request);
        per query row, how many of them come before it (penalties and grammar masks read
        the output up to each row)."""
        runs, before = [], []
        for s, n in zip(self.part, self.forward.lens):
            runs.append(s.track.drafts if s.role is not Role.FULL else ())
            before += range(n) if s.role is Role.VERIFY else [len(s.track.drafts) if s.role is Role.DRAFT else 0]
        return runs, before


@dataclasses.dataclass
class Committed:
    """What an iteration commits: per request of the batch its tokens (``tokens[i, :lens[i]]``),
    per rid the schedule's outcome and the bytes its verify reloaded; the logprob output
    where the batch asks for it."""

    tokens: torch.Tensor
    lens: torch.Tensor
    outcome: "dict[str, Outcome]" = dataclasses.field(default_factory=dict)
    reloaded: dict = dataclasses.field(default_factory=dict)
    logits_output: object = None

    @classmethod
    def nothing(cls, batch_size: int, stride: int) -> "Committed":
        return cls(torch.zeros(batch_size, stride, dtype=torch.int64), torch.zeros(batch_size, dtype=torch.int64))
