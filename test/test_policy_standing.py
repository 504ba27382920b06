"""A request's mode decision stands until something it weighs moves (the cost fit, the
batch size, its acceptance curve): a full-KV request is at a cycle boundary every
iteration, and re-deciding there swept every X per request per iteration (no server)."""

from __future__ import annotations

from sglang_vc.vericache import policy as policy_mod
from sglang_vc.vericache.draft_length import MIN_ITERATIONS, REFIT_EVERY, AcceptanceCurve
from sglang_vc.vericache.policy import IterationRows, Mode, ModePolicy


def _record(policy: ModePolicy, n: int, batch: int = 8) -> None:
    """``n`` iterations timed by a known cost model, with full-KV samples at ``batch``."""
    for i in range(n):
        it = IterationRows(tokens=8 + i % 5, rows=2000 * (1 + i % 7), query_rows=2000 * (1 + i % 7) * (1 + i % 4),
                           offload_drafts=0)
        policy.record(0.005 + 0.001 * it.tokens + 2e-6 * it.rows, it, batch=batch, full_only=i % 4 == 0)


def _curve(n: int = 10) -> AcceptanceCurve:
    curve = AcceptanceCurve()
    for _ in range(n):
        curve.record(4, 4)
    return curve


def test_a_decision_stands_until_the_fit_the_batch_or_the_curve_moves(monkeypatch):
    sweeps = []
    real = policy_mod.in_pool_speedup
    monkeypatch.setattr(policy_mod, "in_pool_speedup", lambda *a: sweeps.append(a) or real(*a))
    policy = ModePolicy(lambda n: 512, 8, None)
    _record(policy, MIN_ITERATIONS, batch=9)
    _record(policy, MIN_ITERATIONS, batch=8)
    curve = _curve()

    first = policy.decide_for("a", 8000, 8, curve)
    assert first.mode is Mode.IN_POOL and len(sweeps) == 8  # X = 1..8
    for length in range(8001, 8001 + REFIT_EVERY - 1):  # a token an iteration: the fit does not move
        _record(policy, 1)
        assert policy.decide_for("a", length, 8, curve) is first
    assert len(sweeps) == 8
    _record(policy, 1)  # the REFIT_EVERY-th iteration since the fit: refitted, decided again
    policy.decide_for("a", 8100, 8, curve)
    assert len(sweeps) == 16
    policy.decide_for("a", 8100, 9, curve)  # another batch size
    assert len(sweeps) == 24
    curve.record(4, 2)  # a verify moved the curve
    policy.decide_for("a", 8100, 9, curve)
    assert len(sweeps) == 32
    policy.forget("a")
    policy.decide_for("a", 8100, 9, curve)
    assert len(sweeps) == 40
    policy.decide_for("b", 8100, 9, curve)  # each request its own
    assert len(sweeps) == 48


def test_a_decision_spent_sampling_full_kv_is_counted_each_time():
    """A batch size without a full-KV sample keeps requests at full KV for the fit, and
    gives that up after a bounded number of decisions: each one counts, standing or not."""
    policy = ModePolicy(lambda n: 512, 8, None)
    _record(policy, 2 * MIN_ITERATIONS, batch=8)
    curve = _curve()
    decisions = [policy.decide_for("a", 8000, 5, curve) for _ in range(policy_mod.SAMPLE_TRIES * 5)]
    assert all(d.mode is Mode.FULL and "measuring" in d.reason for d in decisions)
    assert policy.decide_for("a", 8000, 5, curve).mode is Mode.IN_POOL  # given up: priced


def test_a_request_that_outgrows_the_draft_budget_is_priced_then():
    """Below the draft budget a request decodes full KV whatever the costs; the decision
    does not stand once it has grown past the budget (a drafting server's short prompt
    then never drafted). A flag's forced mode is taken each time too."""
    policy = ModePolicy(lambda n: 512, 8, None)
    _record(policy, MIN_ITERATIONS, batch=8)
    curve = _curve()
    assert "fit the draft budget" in policy.decide_for("a", 500, 8, curve).reason
    assert policy.decide_for("a", 8000, 8, curve).mode is Mode.IN_POOL
    forced = ModePolicy(lambda n: 32, 8, None, forced=Mode.IN_POOL)
    assert forced.decide_for("a", 30, 1, curve).mode is Mode.FULL
    assert forced.decide_for("a", 33, 1, curve).reason == "--vc-in-pool always"
