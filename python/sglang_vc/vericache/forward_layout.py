"""The layout of a staggered iteration's one forward (:class:`.forward_plan.ForwardPlan`).

Per forwarded request, in batch order: a verifier forwards ``[t0, d1 .. dj]`` from its
committed length, a drafter its last draft (or ``t0``) after its drafts, a full-KV request
``t0``. In-pool drafters attend a sparse view of their own rows (:mod:`.draft_view`): the
window and shared views through view rows of SGLang's ``req_to_token``, taken here for
the forward (:mod:`.view_rows`), the re-selected one through the project's attention. The
layout also chooses SGLang's forward shape and prices the forward for the mode policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .draft_view import View
from .forward_plan import ForwardPlan, InPoolDrafts, Shape
from .policy import IterationRows
from .staggered_schedule import Role

if TYPE_CHECKING:
    from .iteration import Iteration
    from .request_modes import RequestModes


def lay_out(worker, modes: "RequestModes", it: "Iteration") -> None:
    """Set ``it.forward`` (the forward's plan) and ``it.terms`` (its costs)."""
    part = it.part
    ids, positions, starts, lens = [], [], [], []
    for s in part:
        tr = s.track
        if s.role is Role.VERIFY:
            toks, start = [it.t0[s.index], *tr.drafts], tr.committed
        elif s.role is Role.DRAFT:
            toks, start = [tr.drafts[-1] if tr.drafts else it.t0[s.index]], tr.committed + len(tr.drafts)
        else:
            toks, start = [it.t0[s.index]], tr.committed
        ids += toks
        positions += range(start, start + len(toks))
        starts.append(start)
        lens.append(len(toks))
    budget = worker.budget
    in_pool = {k: budget.rows(s.track.committed) for k, s in enumerate(part)
               if s.role is Role.DRAFT and modes.in_pool(s.track)}
    native = budget.view is not View.RESELECT
    views = None
    if in_pool and native:
        shared = None
        if budget.view is View.SHARED:
            shared = (worker.shared_selections,
                      {k: (part[k].track.rid, budget.split(part[k].track.committed)[1]) for k in in_pool})
        views = worker.view_rows.write(in_pool, [it.rows[s.index] for s in part], [st + 1 for st in starts], shared)
    rows, row_starts = [it.rows[s.index] for s in part], list(starts)
    for k, view_row in (views.rows.items() if views is not None else ()):
        rows[k], row_starts[k] = view_row, views.lengths[k] - 1
    drafts = in_pool_drafts(worker, modes, part, {} if native else in_pool)
    viewed = views.rows if views is not None else {}
    if all(s.role is Role.FULL or k in viewed for k, s in enumerate(part)):
        shape = Shape.DECODE
    elif _uniform_verify(worker, modes, part, lens, it.staging, drafts):
        shape = Shape.UNIFORM_VERIFY
    else:
        shape = Shape.RAGGED_VERIFY
    it.forward = ForwardPlan(staging=it.staging, in_pool=drafts, shape=shape, index=tuple(s.index for s in part),
                             roles=tuple(s.role for s in part), starts=tuple(starts), lens=tuple(lens),
                             rows=tuple(rows), row_starts=tuple(row_starts),
                             ids=torch.tensor(ids, dtype=torch.int64),
                             positions=torch.tensor(positions, dtype=torch.int64), views=views)
    it.terms = _terms(worker, part, in_pool, starts, lens)
    it.verify_tokens = sum(n for s, n in zip(part, lens) if s.role is Role.VERIFY)


def _terms(worker, part, in_pool: dict, starts: list[int], lens: list[int]) -> IterationRows:
    """The mode policy's regressors: full rows read (in-pool drafters' views, full-KV
    requests' and every verifier's rows, an offloaded one's staged ones too) and query x
    row products (a verify's queries each score every row); offload drafters have a term
    of their own."""
    full_rows = [k in in_pool or s.role is Role.VERIFY or worker.runtime.entry_for_row(s.track.row) is None
                 for k, s in enumerate(part)]
    rows_read = sum(min(in_pool[k], st + 1) if k in in_pool else st + n
                    for k, (st, n) in enumerate(zip(starts, lens)) if full_rows[k])
    query_rows = sum(min(in_pool[k], st + 1) if k in in_pool else n * (st + n)
                     for k, (st, n) in enumerate(zip(starts, lens)) if full_rows[k])
    offload_drafts = sum(1 for k, s in enumerate(part) if s.role is Role.DRAFT and k not in in_pool)
    return IterationRows(sum(lens), rows_read, query_rows, offload_drafts)


def _uniform_verify(worker, modes, part, lens: list[int], staging, drafts) -> bool:
    """Whether this forward is a uniform verify no project attention takes part in:
    every request verifies the same number of tokens over its full KV resident in the
    pool (in-pool drafters: nothing staged, nothing compressed, no re-selection)."""
    return (len(set(lens)) == 1 and lens[0] > 1 and not staging.requests and drafts is None
            and all(s.role is Role.VERIFY and modes.in_pool(s.track)
                    and worker.runtime.entry_for_row(s.track.row) is None for s in part))


def in_pool_drafts(worker, modes, part, in_pool: dict) -> Optional[InPoolDrafts]:
    """What the attention backend needs of this forward's in-pool requests: the
    per-head re-selected view's drafters (``in_pool``: budgets; the other views'
    drafters forward over view rows) and, for a re-selected view (per head or shared),
    the verifiers that re-select, with the worker's selection stores."""
    budget = worker.budget
    if budget.view is View.WINDOW:
        return None
    verifiers = {}
    for k, s in enumerate(part):
        if s.role is Role.VERIFY and modes.in_pool(s.track):
            count, recent = budget.split(s.track.committed)
            verifiers[k] = (s.track.rid, count, recent)
    if not in_pool and not verifiers:
        return None
    return InPoolDrafts(in_pool, budget.view, {k: part[k].track.rid for k in in_pool},
                        {k: budget.split(part[k].track.committed)[1] for k in in_pool}, verifiers,
                        worker.selections, worker.shared_selections)
