"""The draft length X from data: the anchor ADMIT places each request's next verify at
(VeriCache §5.2) is the x that maximises appendix B.1's throughput for the drafter's
acceptance curve A(x), measured from the verifies the server has seen, at this machine's
measured per-iteration costs.

* **A(x).** A verify of ``d`` drafts that accepted ``a`` of them tried positions
  ``1 .. min(a + 1, d)`` and passed ``1 .. a``: each position's pass rate ``p_i`` is
  counted per drafter (and per request once it has enough verifies). Then
  ``A(x) = 1 + sum_{k<=x} prod_{i<=k} p_i`` (the bonus or correction token is the 1).
  Positions never tried yet take the pooled rate of those that were.
* **Costs.** Each iteration's forward time is fitted (non-negative least squares over
  recent iterations) as ``fixed + c_draft * drafting requests + c_full * full-KV requests
  + c_tok * verified tokens + c_verify * verifies``.
* **Objective** (B.1 with B requests in the batch, each cycling through x drafts and one
  verify of x + 1 tokens): committed tokens per second ``B * A(x) / ((x + 1) * fixed +
  B * (x * c_draft + (x + 1) * c_tok + c_verify))``.

``--speculative-num-draft-tokens X`` fixes X; without it X is chosen in ``1 .. max_x``,
starting at the default until enough verifies and iterations have been seen.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

MIN_VERIFIES = 8  # verifies before a curve is trusted (a drafter's, or one request's own)
MIN_ITERATIONS = 8  # iterations before the cost fit is trusted
COST_WINDOW = 128  # iterations the cost fit looks back over
# iterations recorded between two fits: a fit is a least-squares solve over the window, on
# the scheduler's thread; the costs move over many iterations, not within one
REFIT_EVERY = 16


@dataclass
class AcceptanceCurve:
    """How often draft position ``i`` (1-based) passed, given every earlier one did."""

    trials: list[int] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    verifies: int = 0
    # (verifies, [A(1), .., A(n)]): the curve as of that many verifies
    _cached: Optional[tuple] = field(default=None, repr=False, compare=False)

    def record(self, drafts: int, accepted: int) -> None:
        if drafts <= 0:
            return
        accepted = max(0, min(accepted, drafts))
        tried = min(accepted + 1, drafts)
        grow = tried - len(self.trials)
        if grow > 0:
            self.trials += [0] * grow
            self.passes += [0] * grow
        for i in range(tried):
            self.trials[i] += 1
            if i < accepted:
                self.passes[i] += 1
        self.verifies += 1

    def rates(self, max_x: int) -> Optional[list[float]]:
        """``p_1 .. p_max_x``; None before any draft was verified."""
        total = sum(self.trials)
        if total == 0:
            return None
        pooled = sum(self.passes) / total
        return [self.passes[i] / self.trials[i] if i < len(self.trials) and self.trials[i] else pooled
                for i in range(max_x)]

    def acceptance(self, x: int) -> Optional[float]:
        """A(x): expected tokens committed per verify of ``x`` drafts."""
        a = self.acceptances(x)
        return None if a is None else a[x - 1]

    def acceptances(self, max_x: int) -> Optional[list[float]]:
        """``[A(1), .., A(max_x)]`` in one pass over the rates, kept until the next verify
        is recorded (a decision weighs every x of it: one pass, not one per x)."""
        if self._cached is not None and self._cached[0] == self.verifies and len(self._cached[1]) >= max_x:
            return self._cached[1]
        p = self.rates(max_x)
        if p is None:
            return None
        out, run, total = [], 1.0, 1.0
        for rate in p:
            run *= rate
            total += run
            out.append(total)
        self._cached = (self.verifies, out)
        return out


@dataclass(frozen=True)
class Costs:
    fixed: float  # seconds per iteration, whatever the batch (weights, launch)
    draft: float  # per drafting request
    full: float  # per request decoding from full KV
    verify_token: float  # per verified token
    verify: float  # per verifying request (its reload's share, its setup)


class CostFit:
    """Non-negative least squares of recent iterations' forward time on what they held
    (an active set: a term the data would make negative is left out and refitted)."""

    def __init__(self, window: int = COST_WINDOW):
        self.rows: collections.deque = collections.deque(maxlen=window)
        self._costs: Optional[Costs] = None
        self._since = 0  # iterations recorded since the last fit

    def record(self, seconds: float, drafting: int, full: int, verify_tokens: int, verifies: int) -> None:
        self.rows.append((seconds, drafting, full, verify_tokens, verifies))
        self._since += 1

    def costs(self) -> Optional[Costs]:
        """The fitted costs, refitted every :data:`REFIT_EVERY` iterations; None with too
        few iterations. Terms the iterations cannot tell apart (one request drafts or
        verifies, never both) share the time by the minimum-norm solution: B.1's objective
        only needs their sums."""
        if len(self.rows) < MIN_ITERATIONS:
            return None
        if self._costs is None or self._since >= REFIT_EVERY:
            terms = nonnegative_fit([r[0] for r in self.rows], [r[1:] for r in self.rows])
            self._costs, self._since = (None if terms is None else Costs(*terms)), 0
        return self._costs


def nonnegative_fit(seconds: list[float], columns: list[tuple]) -> Optional[list[float]]:
    """Non-negative least squares of ``seconds`` on ``[1, *columns]`` (an active set: a
    term the data would make negative is left out and refitted); the terms, or None."""
    import numpy as np

    y = np.array(seconds, dtype=float)
    a = np.array([[1.0, *c] for c in columns], dtype=float)
    active = list(range(a.shape[1]))
    while active:
        coef = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (coef >= -1e-9).all():
            terms = [0.0] * a.shape[1]
            for i, c in zip(active, coef):
                terms[i] = max(0.0, float(c))
            return terms
        active.pop(int(np.argmin(coef)))
    return None


def throughput(acceptance: float, x: int, costs: Costs, batch: int) -> float:
    """B.1's committed tokens per second for ``batch`` requests at draft length ``x``."""
    b = max(1, batch)
    per_cycle = (x + 1) * costs.fixed + b * (x * costs.draft + (x + 1) * costs.verify_token + costs.verify)
    return b * acceptance / per_cycle if per_cycle > 0 else 0.0


def best_x(curve: AcceptanceCurve, costs: Costs, batch: int, max_x: int) -> int:
    """The x in ``1 .. max_x`` of highest :func:`throughput` (the shorter one on a tie)."""
    best, arg = -1.0, 1
    for x, a in enumerate(curve.acceptances(max_x), start=1):
        tps = throughput(a, x, costs, batch)
        if tps > best * (1 + 1e-9):
            best, arg = tps, x
    return arg


class DraftLength:
    """The anchor X per request: fixed, or chosen from data (module docstring)."""

    def __init__(self, fixed: Optional[int], max_x: int, default: int):
        self.fixed = fixed
        self.max_x = max_x
        self.default = min(default, max_x)
        self.curves: dict[str, AcceptanceCurve] = collections.defaultdict(AcceptanceCurve)  # per drafter
        self.own: dict[str, AcceptanceCurve] = collections.defaultdict(AcceptanceCurve)  # per request
        self.fit = CostFit()
        self.chosen: dict[str, int] = {}  # drafter -> the X last chosen for it

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def record_verify(self, drafter: str, rid: str, drafts: int, accepted: int) -> None:
        self.curves[drafter].record(drafts, accepted)
        self.own[rid].record(drafts, accepted)

    def record_iteration(self, seconds: float, drafting: int, full: int, verify_tokens: int, verifies: int) -> None:
        self.fit.record(seconds, drafting, full, verify_tokens, verifies)

    def forget(self, live: set[str]) -> None:
        for rid in [r for r in self.own if r not in live]:
            del self.own[rid]

    def curve_for(self, drafter: str, rid: str) -> AcceptanceCurve:
        own = self.own.get(rid)
        return own if own is not None and own.verifies >= MIN_VERIFIES else self.curves[drafter]

    def anchor(self, drafter: str, rid: str, batch: int) -> int:
        if self.fixed is not None:
            return self.fixed
        curve = self.curve_for(drafter, rid)
        costs = self.fit.costs()
        if curve.verifies < MIN_VERIFIES or costs is None:
            return self.default
        x = best_x(curve, costs, batch, self.max_x)
        self.chosen[drafter] = x
        return x
