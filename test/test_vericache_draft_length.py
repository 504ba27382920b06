"""The draft length X from data (vericache/draft_length.py): the acceptance curve from
verify outcomes, the cost fit, B.1's objective and the choice, on pinned inputs."""

from __future__ import annotations

import pytest

from sglang_vc.vericache.draft_length import (MIN_VERIFIES, AcceptanceCurve, CostFit, Costs, DraftLength, best_x,
                                              throughput)


def test_curve_counts_each_position_given_the_earlier_ones_passed():
    c = AcceptanceCurve()
    c.record(4, 4)  # all passed: positions 1-4 tried and passed
    c.record(4, 1)  # 1 passed, 2 failed; 3 and 4 never tried
    c.record(2, 0)  # 1 failed
    assert c.trials == [3, 2, 1, 1] and c.passes == [2, 1, 1, 1] and c.verifies == 3
    assert c.rates(5) == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0, 5 / 7])  # position 5: pooled
    # A(x) = 1 + p1 + p1 p2 + ...
    assert c.acceptance(2) == pytest.approx(1 + 2 / 3 + 1 / 3)
    assert AcceptanceCurve().acceptance(4) is None


def test_constant_rate_gives_the_geometric_acceptance_length():
    c = AcceptanceCurve()
    for _ in range(9):
        c.record(8, 8)
    c.record(8, 0)  # pooled over what was tried: 72 passes of 73 trials
    p = c.rates(3)
    assert p[0] == pytest.approx(0.9) and p[1] == pytest.approx(1.0)


def test_cost_fit_recovers_the_costs():
    """Known costs (50 ms fixed, 4 ms a drafting request, 9 ms a full-KV one, 2 ms a
    verified token, 10 ms a verify) come back; a term the data would make negative is
    left out (never a negative cost); one request alone (an iteration drafts or
    verifies) still gives the sums B.1 needs."""
    fit = CostFit()
    for it in range(24):
        d, f, ver = 2 + it % 5, it % 2, it % 3
        tok = ver * (3 + it % 4)
        fit.record(0.05 + 0.004 * d + 0.009 * f + 0.002 * tok + 0.01 * ver, d, f, tok, ver)
    c = fit.costs()
    assert (c.fixed, c.draft, c.full, c.verify_token, c.verify) == pytest.approx((0.05, 0.004, 0.009, 0.002, 0.01))
    noisy = CostFit()
    for it in range(24):
        d = 1 + it % 4
        noisy.record(0.1 + 0.01 * d - (0.001 if it % 2 else 0.0), d, 0, it % 2, it % 2)  # verifies "save" time
    c = noisy.costs()
    assert min(c.fixed, c.draft, c.full, c.verify_token, c.verify) >= 0.0
    alone = CostFit()
    for it in range(20):
        x = 3 + it % 3
        if it % 4 == 0:
            alone.record(0.1 + 0.01 * (x + 1) + 0.02, 0, 0, x + 1, 1)
        else:
            alone.record(0.1, 1, 0, 0, 0)
    c = alone.costs()
    assert c.fixed + c.draft == pytest.approx(0.1) and c.verify_token == pytest.approx(0.01)
    assert c.fixed + c.verify == pytest.approx(0.12)
    assert CostFit().costs() is None  # no iterations yet


def _curve(rate: float, depth: int = 40) -> AcceptanceCurve:
    """A drafter whose every position passes with ``rate``, as counts over 1000 verifies."""
    c = AcceptanceCurve()
    c.trials = [1000] * depth
    c.passes = [round(1000 * rate)] * depth
    c.verifies = 1000
    return c


def test_best_x_follows_acceptance_and_costs():
    """A drafter that is almost always right drafts longer than a poor one; a dearer
    verify (its reload) lengthens X, dearer drafting shortens it; the choice is the
    argmax of B.1's objective."""
    base = Costs(fixed=0.05, draft=0.002, full=0.01, verify_token=0.004, verify=0.02)
    good, poor = best_x(_curve(0.97), base, 8, 32), best_x(_curve(0.5), base, 8, 32)
    assert good > poor and poor <= 3, (good, poor)
    assert best_x(_curve(0.97), Costs(0.05, 0.002, 0.01, 0.004, 0.2), 8, 32) > good  # a verify reloads more
    assert best_x(_curve(0.97), Costs(0.05, 0.03, 0.01, 0.004, 0.02), 8, 32) < good  # drafting costs more
    tps = [throughput(_curve(0.97).acceptance(x), x, base, 8) for x in range(1, 33)]
    assert tps[good - 1] == max(tps)


def test_anchor_is_fixed_or_the_default_until_there_is_data():
    fixed = DraftLength(6, 6, 4)
    assert fixed.anchor("snapkv", "r", 4) == 6 and not fixed.auto
    auto = DraftLength(None, 32, 4)
    assert auto.anchor("snapkv", "r", 4) == 4  # no verifies, no costs yet
    for _ in range(MIN_VERIFIES):
        auto.record_verify("snapkv", "r", 4, 4)
    assert auto.anchor("snapkv", "r", 4) == 4  # still no cost fit
    for it in range(20):
        one, tok, ver = 2 + it % 5, (it % 4) * 5, it % 3
        auto.record_iteration(0.05 + 0.002 * one + 0.004 * tok + 0.02 * ver, one, 0, tok, ver)
    x = auto.anchor("snapkv", "r", 4)
    assert 4 < x <= 32  # every draft passed: longer than the default
    assert auto.chosen["snapkv"] == x
    # a request with enough verifies of its own uses its own curve
    for _ in range(MIN_VERIFIES):
        auto.record_verify("snapkv", "bad", 4, 0)
    assert auto.anchor("snapkv", "bad", 4) < x
    auto.forget({"r"})
    assert "bad" not in auto.own


def test_a_decision_reads_the_curve_in_one_pass_and_the_fit_every_refit_iterations(monkeypatch):
    """The host work at a cycle boundary, on the scheduler's thread: A(1..X) is computed
    once per recorded verify (not once per x, each O(x)); the least-squares cost fit runs
    once per ``REFIT_EVERY`` recorded iterations, however many requests ask for it; and
    the curve's values are the same either way."""
    from sglang_vc.vericache import draft_length as dl

    c = AcceptanceCurve()
    for a in (3, 1, 4, 0, 2):
        c.record(4, a)
    passes = []
    real_rates = c.rates
    monkeypatch.setattr(c, "rates", lambda n: passes.append(n) or real_rates(n))
    whole = c.acceptances(16)
    assert [c.acceptance(x) for x in range(1, 17)] == whole and passes == [16]
    by_hand = [1 + sum(__import__("math").prod(real_rates(16)[:k]) for k in range(1, x + 1)) for x in range(1, 17)]
    assert whole == pytest.approx(by_hand)
    c.record(4, 4)  # a new verify: one more pass
    assert c.acceptances(16)[2] == pytest.approx(c.acceptance(3)) and len(passes) == 2

    fits = []
    real_fit = dl.nonnegative_fit
    monkeypatch.setattr(dl, "nonnegative_fit", lambda *a: fits.append(1) or real_fit(*a))
    fit = CostFit()
    for it in range(dl.MIN_ITERATIONS + 3 * dl.REFIT_EVERY):
        fit.record(0.05 + 0.004 * (it % 5), it % 5, 1, 0, 0)
        for _ in range(8):  # eight requests at a cycle boundary in this iteration
            fit.costs()
    assert len(fits) == 4  # at MIN_ITERATIONS, then every REFIT_EVERY iterations
    assert fit.costs().draft == pytest.approx(0.004, rel=1e-6)
