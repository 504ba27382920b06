"""One mode per request and cycle, from measured costs (the DESIGN's *mode*):

* ``full``: decode one exact token per iteration from the full KV in the pool;
* ``in-pool``: self-speculate over a sparse view of the request's own pool rows
  (:mod:`.draft_view`), verify in place through SGLang's backend;
* ``offload``: the request was compressed after its prefill (the pool binds); drafts from
  its compressed KV, verifies against the full KV reloaded from the host.

Offload is decided when the prefill ends (``--vc-compress-when``, the runtime's compress
gate): where the pool binds, :meth:`ModePolicy.offload` weighs the batch's tokens/s with
the request offloaded (and waiting requests admitted into the rows that frees) against
it kept at full KV, by the same fitted costs. For a request whose full KV is resident,
:class:`ModePolicy` chooses full or in-pool at every cycle boundary (after a verify, or between full-KV tokens): in-pool
where :func:`.perf_model.in_pool_speedup` -- the costs fitted here from the server's own
iterations and the acceptance A(x) seen from the view -- beats full-KV decoding by a
margin. Until ``MIN_ITERATIONS`` iterations are timed a request decodes full KV (what the
plain server does); until ``MIN_VERIFIES`` verifies are seen it explores in-pool only where
the fitted costs predict a gain with every draft accepted.

No SGLang dependency.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Optional

from .draft_length import MIN_ITERATIONS, MIN_VERIFIES, REFIT_EVERY, AcceptanceCurve, nonnegative_fit
from .perf_model import RowCosts, full_kv_request_time, in_pool_speedup, offload_gain

COST_WINDOW = 256  # iterations the fit looks back over
MARGIN = 1.05  # in-pool must be predicted this much faster (no flapping on noise)
OFFLOAD_MARGIN = 1.10  # offload too (measured: the model over-predicted an offload run by 21-26%)
FULL_SAMPLES = 2  # full-KV iterations kept per batch size
SAMPLE_TRIES = 8  # boundary decisions per request spent waiting for a batch size's full-KV sample


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
        # iterations in which every request decoded from full KV, the last few per batch size:
        # kept in the fit beyond the window (they separate the fixed cost from the rows')
        self.full_samples: dict[int, collections.deque] = {}
        self._sampling: collections.Counter = collections.Counter()  # batch -> decisions spent sampling
        self._costs: Optional[RowCosts] = None  # the last fit (None: none yet)
        self._since = 0  # iterations recorded since it
        self.fits = 0  # fits made so far: a decision stands until the next one
        # rid -> (what the decision was made on, the decision): :meth:`decide_for`
        self._standing: dict[str, tuple[tuple, Decision]] = {}

    def record(self, seconds: float, it: IterationRows, batch: int = 0, full_only: bool = False) -> None:
        """One iteration's forward time and what it forwarded; ``full_only``: each of its
        ``batch`` requests decoded one token from full KV."""
        row = (seconds, it.tokens, it.rows, it.query_rows, it.offload_drafts)
        self.history.append(row)
        if full_only and batch not in self.full_samples:
            self._since = REFIT_EVERY  # a batch size's first full-KV sample: the next decision refits
        if full_only:
            self.full_samples.setdefault(batch, collections.deque(maxlen=FULL_SAMPLES)).append(row)
        self._since += 1

    def costs(self) -> Optional[RowCosts]:
        """The costs fitted on the last ``COST_WINDOW`` iterations and the full-KV samples,
        refitted every :data:`~.draft_length.REFIT_EVERY` iterations (a least-squares solve
        on the scheduler's thread; the costs move over many iterations)."""
        if (self._costs is None or self._since >= REFIT_EVERY) and len(self.history) >= MIN_ITERATIONS:
            self._since = 0
            kept = {id(h) for h in self.history}
            rows = [*self.history, *(h for q in self.full_samples.values() for h in q if id(h) not in kept)]
            terms = nonnegative_fit([h[0] for h in rows], [h[1:] for h in rows])
            self._costs = None if terms is None else RowCosts(*terms)
            self.fits += 1
        return self._costs

    def decide_for(self, rid: str, length: int, batch: int, curve: AcceptanceCurve) -> Decision:
        """:meth:`decide` for request ``rid`` at a cycle boundary, or its standing decision
        where nothing it weighs has moved: the same fit (refitted every
        :data:`~.draft_length.REFIT_EVERY` iterations), batch size and acceptance curve. A
        full-KV request is at a boundary every iteration; without this each would sweep
        every X on the scheduler's thread per iteration (~75 us a request on this CPU:
        2.4 ms an iteration at batch 32, host work an overlapped GPU step must hide). Its
        length moves meanwhile by the tokens it committed, which the prediction barely
        feels. Only a priced decision stands: one forced by a flag, taken because the request
        fits the draft budget (its length decides that) or spent sampling full KV for the
        fit (it is counted) is taken again each time, and costs nothing to take."""
        self.costs()  # refit when due, so that a new fit is seen now
        if self.forced is not None or length <= self.budget_rows(length) or self.needs_full_sample(batch):
            self._standing.pop(rid, None)
            return self.decide(length, batch, curve)
        on = (self.fits, batch, id(curve), curve.verifies)
        standing = self._standing.get(rid)
        if standing is not None and standing[0] == on:
            return standing[1]
        decision = self.decide(length, batch, curve)
        self._standing[rid] = (on, decision)
        return decision

    def forget(self, rid: str) -> None:
        self._standing.pop(rid, None)

    def needs_full_sample(self, batch: int) -> bool:
        """Whether the fit lacks an iteration of ``batch`` requests all decoding from full
        KV (without one the fixed cost and the rows' are not told apart: every drafting
        iteration of a batch reads about the same rows). Requests at a cycle boundary then
        decode full KV until the whole batch does once; a batch size that never gets there
        is given up after ``SAMPLE_TRIES`` such decisions."""
        if self.forced is not None or batch < 2 or batch in self.full_samples:
            return False
        return self._sampling[batch] < SAMPLE_TRIES * batch

    def _draft_lengths(self):
        """The anchors X a decision weighs: the fixed one, or 1 to ``max_x``."""
        return [self.fixed_x] if self.fixed_x else range(1, self.max_x + 1)

    def offload_measured(self) -> int:
        """Iterations of the cost window that had offload drafters in them."""
        return sum(1 for h in self.history if h[4] > 0)

    def offload(self, length: int, full: int, offloaded: int, admitted: float, curve: AcceptanceCurve,
                reload_s: float, probe: Optional[tuple[float, float]] = None) -> Decision:
        """Offload a request whose prefill just ended (the pool binds: compressing it frees
        rows for ``admitted`` waiting requests), or keep its full KV, by the same fitted costs
        as the in-pool choice (:func:`.perf_model.offload_gain`), with appendix B.1's cap on
        the requests offloaded at once (Eq. 9: ``B_c * ell <= x + 1``, ``ell`` the reload's
        iterations). Until offloads are measured, a full-KV request's attention and an
        offload draft step are priced by ``probe`` (seconds per iteration, timed on this
        machine: :mod:`.draft_probe`) rather than by a young fit, at the best acceptance
        (only the costs can then rule offloading out); without a probe one request is
        offloaded to measure them. Before any decode iteration is timed, requests keep
        their full KV. Offload must be predicted :data:`OFFLOAD_MARGIN` faster: its verifies
        stage and reload the request's whole KV, which the fit prices only once measured."""
        x = self.default_x
        if admitted <= 0:
            return Decision(Mode.FULL, None, "offloading it frees no room for a waiting request")
        costs = self.costs()
        if costs is None:
            return Decision(Mode.FULL, None, "the pool binds; no decode iteration timed yet: full KV until one is")
        measured = self.offload_measured() >= MIN_ITERATIONS and curve.verifies >= MIN_VERIFIES
        how = "measured"
        if not measured:
            if probe is None:
                if offloaded == 0:
                    return Decision(Mode.OFFLOAD, x, "the pool binds; no offload costs measured yet: this request "
                                    "is offloaded to measure them")
                return Decision(Mode.FULL, None, f"the pool binds; offload costs not measured yet "
                                f"({offloaded} request(s) offloaded to measure them)")
            full_s, draft_s = probe
            costs = dataclasses.replace(costs, row=full_s / max(1, length), query_row=0.0, offload_draft=draft_s)
            curve = curve if curve.verifies >= MIN_VERIFIES else _ALL_ACCEPTED
            how = f"priced by this machine's draft step, x{draft_s / full_s:.2f} a full-KV step"
        xs = self._draft_lengths()
        a = curve.acceptances(max(xs))
        gain, x = max((offload_gain(costs, a[x - 1], x, length, full, offloaded, admitted), x) for x in xs)
        iteration = costs.fixed + full * full_kv_request_time(costs, length)
        ell = max(1, math.ceil(reload_s / iteration)) if iteration > 0 else 1
        if (offloaded + 1) * ell > x + 1:
            return Decision(Mode.FULL, None, f"appendix B.1 Eq. 9: {offloaded} offloaded requests already keep the "
                            f"link busy (a reload takes {ell} iterations, X={x})", gain)
        terms = (f"{how}: offload draft {1e3 * costs.offload_draft:.1f} ms, full-KV request "
                 f"{1e3 * full_kv_request_time(costs, length):.1f} ms an iteration, fixed {1e3 * costs.fixed:.1f} ms, "
                 f"A({x})={curve.acceptance(x):.2f}, {admitted:.1f} waiting admitted")
        if gain >= OFFLOAD_MARGIN:
            return Decision(Mode.OFFLOAD, x, f"offload predicted {gain:.2f}x the batch's tokens/s ({terms})", gain)
        return Decision(Mode.FULL, None, f"offload predicted {gain:.2f}x the batch's tokens/s, below "
                        f"{OFFLOAD_MARGIN:.2f}x ({terms})", gain)

    def decide(self, length: int, batch: int, curve: AcceptanceCurve) -> Decision:
        budget = self.budget_rows(length)
        if self.forced is Mode.FULL:
            return Decision(Mode.FULL, None, "--vc-in-pool never")
        if length <= budget:
            return Decision(Mode.FULL, None, f"its {length} tokens fit the draft budget ({budget}): nothing to skip")
        if self.forced is Mode.IN_POOL:
            return Decision(Mode.IN_POOL, self.default_x, "--vc-in-pool always")
        if self.needs_full_sample(batch):
            self._sampling[batch] += 1
            return Decision(Mode.FULL, None, f"measuring full-KV decoding at batch {batch} (the cost fit needs it)")
        costs = self.costs()
        if costs is None:
            # an unpriced draft can only lose (2k requests at batch 2-3 explored before the
            # fit: 0.87x full KV, bench.throughput --quick); the fit needs MIN_ITERATIONS
            return Decision(Mode.FULL, None, f"no cost data yet: full KV until {MIN_ITERATIONS} iterations are timed")
        if curve.verifies < MIN_VERIFIES:
            # no acceptance measured yet: explore in-pool only where the costs allow a gain
            # with every draft accepted
            best = max(in_pool_speedup(costs, x + 1.0, length, batch, x, budget)  # A(x) = x + 1
                       for x in self._draft_lengths())
            if best < MARGIN:
                return Decision(Mode.FULL, None, f"no acceptance measured yet; even every draft accepted predicts "
                                f"{best:.2f}x full KV (below {MARGIN:.2f}x)", best)
            return Decision(Mode.IN_POOL, self.default_x, f"exploring at X={self.default_x}: no acceptance measured "
                            f"yet, every draft accepted would give {best:.2f}x full KV", best)
        xs = self._draft_lengths()
        a = curve.acceptances(max(xs))
        speedup, x = max((in_pool_speedup(costs, a[x - 1], length, batch, x, budget), x) for x in xs)
        if speedup >= MARGIN:
            return Decision(Mode.IN_POOL, x, f"predicted {speedup:.2f}x full KV at X={x}, "
                            f"A={curve.acceptance(x):.2f}", speedup)
        return Decision(Mode.FULL, None, f"in-pool drafting predicted {speedup:.2f}x full KV (below "
                        f"{MARGIN:.2f}x)", speedup)


def _prior_curve(x: int) -> AcceptanceCurve:
    """Before a drafter's verifies are seen: every draft accepted (the most offloading could
    gain), so that only the costs can rule it out: A(x) = x + 1 at every x."""
    curve = AcceptanceCurve()
    for _ in range(MIN_VERIFIES):
        curve.record(x, x)
    return curve


_ALL_ACCEPTED = _prior_curve(1)  # every rate 1 (untried positions take the pooled rate)

