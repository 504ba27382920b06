"""One mode per request and cycle, from measured costs (the DESIGN's *mode*):

* ``full``: decode one exact token per iteration from the full KV in the pool;
* ``in-pool``: self-speculate over a sparse view of the request's own pool rows
  (:mod:`.draft_view`), verify in place through SGLang's backend;
* ``offload``: the request was compressed after its prefill (the pool binds); drafts from
  its compressed KV, verifies against the full KV reloaded from the host.

Offload is decided when the prefill ends (``--vc-compress-when``, the runtime's compress
gate). For a request whose full KV is resident, :class:`ModePolicy` chooses full or
in-pool at every cycle boundary (after a verify, or between full-KV tokens): in-pool
where :func:`.perf_model.in_pool_speedup` -- the costs fitted here from the server's own
iterations and the acceptance A(x) seen from the view -- beats full-KV decoding by a
margin. Until there is data (``MIN_ITERATIONS`` iterations and ``MIN_VERIFIES``
verifies) it drafts only where the request is ``PRIOR_LENGTH_RATIO`` times the budget.

No SGLang dependency.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Optional

from .draft_length import MIN_ITERATIONS, MIN_VERIFIES, AcceptanceCurve, nonnegative_fit
from .perf_model import RowCosts, in_pool_speedup

COST_WINDOW = 256  # iterations the fit looks back over
MARGIN = 1.05  # in-pool must be predicted this much faster (no flapping on noise)
PRIOR_LENGTH_RATIO = 4  # without data: draft where the request is this many budgets long


class Mode(str, enum.Enum):
    FULL = "full"
    IN_POOL = "in-pool"
    OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class Decision:
    mode: Mode
    draft_len: Optional[int]  # the in-pool anchor X (None: full)
    reason: str
    predicted_speedup: Optional[float] = None  # in-pool over full KV, from the fit


@dataclasses.dataclass(frozen=True)
class IterationRows:
    """What one iteration forwarded, the fit's regressors."""

    tokens: int  # query tokens
    rows: int  # KV rows attended, once per request (full, verifying, in-pool drafting)
    query_rows: int  # the same, times the request's queries (a verify's x + 1 score every row)
    offload_drafts: int  # drafters over compressed KV (their own term: bytes differ by method)


class ModePolicy:
    def __init__(self, budget_rows, max_x: int, fixed_x: Optional[int], forced: Optional[Mode] = None,
                 default_x: int = 4):
        self.budget_rows = budget_rows  # length -> budget (DraftBudget.rows)
        self.max_x = max_x
        self.fixed_x = fixed_x
        self.default_x = fixed_x or min(default_x, max_x)  # X before A(x) is known
        self.forced = forced  # IN_POOL (--vc-in-pool always) or FULL (never); None: auto
        self.history: collections.deque = collections.deque(maxlen=COST_WINDOW)
        self._costs: Optional[RowCosts] = None  # the fit of the history as it is (None: refit)

    def record(self, seconds: float, it: IterationRows) -> None:
        self.history.append((seconds, it.tokens, it.rows, it.query_rows, it.offload_drafts))
        self._costs = None

    def costs(self) -> Optional[RowCosts]:
        """The costs fitted on the last ``COST_WINDOW`` iterations (once per iteration)."""
        if self._costs is None and len(self.history) >= MIN_ITERATIONS:
            terms = nonnegative_fit([h[0] for h in self.history], [h[1:] for h in self.history])
            self._costs = None if terms is None else RowCosts(*terms[:4])
        return self._costs

    def decide(self, length: int, batch: int, curve: AcceptanceCurve) -> Decision:
        budget = self.budget_rows(length)
        if self.forced is Mode.FULL:
            return Decision(Mode.FULL, None, "--vc-in-pool never")
        if length <= budget:
            return Decision(Mode.FULL, None, f"its {length} tokens fit the draft budget ({budget}): nothing to skip")
        if self.forced is Mode.IN_POOL:
            return Decision(Mode.IN_POOL, self.default_x, "--vc-in-pool always")
        costs = self.costs()
        if costs is None or curve.verifies < MIN_VERIFIES:
            x = self.default_x
            if length >= PRIOR_LENGTH_RATIO * budget:
                return Decision(Mode.IN_POOL, x, f"no cost data yet; {length} tokens >= {PRIOR_LENGTH_RATIO} x "
                                f"the {budget}-token budget")
            return Decision(Mode.FULL, None, f"no cost data yet; {length} tokens < {PRIOR_LENGTH_RATIO} x the "
                            f"{budget}-token budget")
        xs = [self.fixed_x] if self.fixed_x else range(1, self.max_x + 1)
        speedup, x = max((in_pool_speedup(costs, curve.acceptance(x), length, batch, x, budget), x) for x in xs)
        if speedup >= MARGIN:
            return Decision(Mode.IN_POOL, x, f"predicted {speedup:.2f}x full KV at X={x}, "
                            f"A={curve.acceptance(x):.2f}", speedup)
        return Decision(Mode.FULL, None, f"in-pool drafting predicted {speedup:.2f}x full KV (below "
                        f"{MARGIN:.2f}x)", speedup)
