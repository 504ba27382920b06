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


def test_cost_fit_recovers_the_costs_and_refuses_a_degenerate_one():
    fit = CostFit()
    for it in range(20):
        one, tok, ver = 2 + it % 5, (it % 4) * 5, it % 3
        fit.record(0.05 + 0.004 * one + 0.002 * tok + 0.01 * ver, one, tok, ver)
    costs = fit.costs()
    assert costs.fixed == pytest.approx(0.05) and costs.one_token == pytest.approx(0.004)
    assert costs.verify_token == pytest.approx(0.002) and costs.verify == pytest.approx(0.01)
    same = CostFit()
    for _ in range(20):
        same.record(0.1, 3, 0, 0)  # no variation: nothing to fit
    assert same.costs() is None
    alone = CostFit()  # one request: each iteration drafts (1 token) or verifies (x + 1 tokens)
    for it in range(20):
        x = 3 + it % 3
        alone.record(0.1 + 0.01 * (x + 1), 0, x + 1, 1) if it % 4 == 0 else alone.record(0.1, 1, 0, 0)
    costs = alone.costs()
    assert costs.fixed == pytest.approx(0.1) and costs.verify_token == pytest.approx(0.01)
    assert costs.one_token == pytest.approx(0.0, abs=1e-9) and costs.verify == 0.0


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
    base = Costs(fixed=0.05, one_token=0.002, verify_token=0.004, verify=0.02)
    good, poor = best_x(_curve(0.97), base, 8, 32), best_x(_curve(0.5), base, 8, 32)
    assert good > poor and poor <= 3, (good, poor)
    assert best_x(_curve(0.97), Costs(0.05, 0.002, 0.004, 0.2), 8, 32) > good  # a verify reloads more
    assert best_x(_curve(0.97), Costs(0.05, 0.03, 0.004, 0.02), 8, 32) < good  # drafting costs more
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
        auto.record_iteration(0.05 + 0.002 * one + 0.004 * tok + 0.02 * ver, one, tok, ver)
    x = auto.anchor("snapkv", "r", 4)
    assert 4 < x <= 32  # every draft passed: longer than the default
    assert auto.summary()["snapkv"]["draft_len"] == x
    # a request with enough verifies of its own uses its own curve
    for _ in range(MIN_VERIFIES):
        auto.record_verify("snapkv", "bad", 4, 0)
    assert auto.anchor("snapkv", "bad", 4) < x
    auto.forget({"r"})
    assert "bad" not in auto.own
