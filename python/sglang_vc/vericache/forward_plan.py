"""What one VERICACHE verify forward's attention needs beyond SGLang's batch, carried on
the forward itself: the verify input SGLang hands the attention backend with the forward
batch (``forward_batch.spec_info``), not attributes set on the backend around the call.

The worker attaches it (:func:`attach`) to the verify input it builds; the backend reads it
(:func:`plan_of`) when it builds the forward's metadata, as SGLang's backends read the
batch. A forward without one (SGLang's own, a decode) has the empty plan.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Optional

from . import draft_view

if TYPE_CHECKING:
    import torch

    from .staging import PoolStaging
    from .view_rows import SharedSelections, Views

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
    # the worker's stores the verifies re-select into and the drafts read: the per-head view's
    # rid -> positions [layers, Hkv, K]; the shared view's :class:`.view_rows.SharedSelections`
    selections: dict = dataclasses.field(default_factory=dict)
    shared: "Optional[SharedSelections]" = None


class Shape(enum.Enum):
    """Which of SGLang's forward layouts an iteration runs."""

    DECODE = "decode"  # one query each: every request decodes full KV or drafts over a view row
    UNIFORM_VERIFY = "uniform"  # every request verifies W tokens over resident full KV (graphs replay it)
    RAGGED_VERIFY = "ragged"  # per-request query lengths (drafts, full-KV tokens and verifies together)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """One forward of a VERICACHE iteration, planned before it runs.

    Per request of the forward (``index``: its place in SGLang's batch, in batch order):
    its ``roles`` (draft, full, verify), the ``lens`` query tokens it forwards from
    ``starts`` (its committed length, plus the drafts before a draft), and the
    ``req_to_token`` row it forwards over (``rows``; a window-view drafter's view row,
    :mod:`.view_rows`, whose committed length is ``row_starts``). ``ids`` and
    ``positions`` are the forward's tokens request after request (host tensors).

    What its attention reads: ``staging``, the verifying requests whose full KV lands in
    pool slots during the forward (each layer waits for its copy); ``in_pool``, the
    requests drafting over a re-selected view of their own rows, and the in-pool
    verifiers that re-select it. A plan built for a forward SGLang runs on its own (a
    decode) is the empty one."""

    staging: "Optional[PoolStaging]" = None
    in_pool: "Optional[InPoolDrafts]" = None
    shape: Shape = Shape.RAGGED_VERIFY
    index: tuple = ()
    roles: tuple = ()
    starts: tuple = ()
    lens: tuple = ()
    rows: tuple = ()
    row_starts: tuple = ()
    ids: "Optional[torch.Tensor]" = None
    positions: "Optional[torch.Tensor]" = None
    views: "Optional[Views]" = None  # the window and shared views' rows, given back after the forward

    @property
    def offsets(self) -> list[int]:
        """Each request's first query row in the forward, and the total."""
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return out

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
