"""What one VERICACHE verify forward's attention needs beyond SGLang's batch, carried on
the forward itself: the verify input SGLang hands the attention backend with the forward
batch (``forward_batch.spec_info``), not attributes set on the backend around the call.

The worker attaches it (:func:`attach`) to the verify input it builds; the backend reads it
(:func:`plan_of`) when it builds the forward's metadata, as SGLang's backends read the
batch. A forward without one (SGLang's own, a decode) has the empty plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from . import draft_view

if TYPE_CHECKING:
    from .staging import PoolStaging

PLAN_ATTR = "vc_plan"


@dataclasses.dataclass(frozen=True)
class InPoolDrafts:
    """Which requests of the next forward draft in place, and each one's budget (rows)."""

    budgets: dict  # request index in the forward -> budget
    view: "draft_view.View" = draft_view.View.WINDOW
    rids: dict = dataclasses.field(default_factory=dict)  # drafter index -> rid (re-selected view)
    recent: dict = dataclasses.field(default_factory=dict)  # drafter index -> recent rows (re-selected view)
    # in-pool verifiers whose verify re-selects their view: index -> (rid, selected rows, recent rows)
    verifiers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """``staging``: the verifying requests whose full KV lands in pool slots during the
    forward (each layer waits for its copy); ``in_pool``: the requests drafting over a
    re-selected view of their own rows, and the in-pool verifiers that re-select it."""

    staging: "Optional[PoolStaging]" = None
    in_pool: "Optional[InPoolDrafts]" = None

    @property
    def in_pool_set(self) -> frozenset:
        return frozenset(self.in_pool.budgets) if self.in_pool is not None else frozenset()

    @property
    def staged(self) -> dict:
        """Forward index -> the verifying request staged in the pool."""
        return self.staging.requests if self.staging is not None else {}


NO_PLAN = ForwardPlan()


def attach(spec_info, plan: ForwardPlan) -> None:
    """Carry ``plan`` on the forward's verify input (one of SGLang's spec-info objects)."""
    setattr(spec_info, PLAN_ATTR, plan)


def plan_of(forward_batch) -> ForwardPlan:
    """The plan the forward carries, or the empty one."""
    return getattr(forward_batch.spec_info, PLAN_ATTR, None) or NO_PLAN
