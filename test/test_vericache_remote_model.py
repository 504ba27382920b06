"""Appendix B.2's model of remote prefix caching (``vericache/remote/model.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_vc.vericache.remote import model as rm

GB = 1e9


def _cluster(k: int, **kw) -> rm.Cluster:
    # an 8B model at 32k on 80 GB GPUs: one local GPU on a 25 GB/s link, four remote on 1.25 GB/s
    base = dict(weights_bytes=16 * GB, kv_full_bytes=4.3 * GB, compression=0.25, hbm_bw=3.35e12,
                gpu_mem_bytes=80 * GB, local_gpus=1, remote_gpus=4, bw_high=25 * GB, bw_low=1.25 * GB,
                output_tokens=k)
    return rm.Cluster(**{**base, **kw})


def test_vertex_search_finds_the_lp_optimum():
    """Against random feasible points: none serves more requests than the vertex found."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = rng.uniform(0.0, 2.0, size=(6, 6))
        cap = rng.uniform(0.5, 3.0, size=6)
        best = rm._max_rate(costs, cap)
        assert np.all(costs.T @ best <= cap + 1e-9) and np.all(best >= 0)
        for _ in range(300):
            n = rng.uniform(0, 1, size=6) * rng.integers(0, 2, size=6)
            scale = np.min(cap / np.maximum(costs.T @ n, 1e-12))  # push it to the boundary
            assert (n * scale).sum() <= best.sum() + 1e-9


@pytest.mark.parametrize("k", [16, 256, 1024, 4096])
def test_the_mix_is_feasible_and_never_below_the_baselines(k):
    cl = _cluster(k)
    full = rm.best_mix(cl, 30, 20.0, (rm.Route.B1, rm.Route.B2))
    mix = rm.best_mix(cl, 30, 20.0)
    assert mix.tokens_per_s >= full.tokens_per_s * (1 - 1e-9) and mix.binding
    assert set(rm.route_costs(cl, 30, 20.0, cl.max_batch, cl.max_batch)) == set(rm.Route)
    for route in rm.Route:  # every route alone is a feasible mix too: never better
        assert rm.best_mix(cl, 30, 20.0, (route,)).tokens_per_s <= mix.tokens_per_s * (1 + 1e-9)


def test_p1_for_short_outputs_p2_for_long_ones():
    assert rm.choose_route(_cluster(64), 30, 20.0) is rm.Route.P1_CACHED
    assert rm.choose_route(_cluster(4096), 30, 20.0) is rm.Route.P2_CACHED


def test_a_drafter_that_is_never_accepted_buys_nothing():
    """A = 1 (every draft rejected): the speculative routes only add work; the mix is the
    baselines' (within rounding)."""
    cl = _cluster(256)
    full = rm.best_mix(cl, 4, 1.0, (rm.Route.B1, rm.Route.B2))
    assert rm.best_mix(cl, 4, 1.0).tokens_per_s == pytest.approx(full.tokens_per_s, rel=0.02)


def test_a_compute_bound_pool_runs_at_b_max():
    """Memory-time counts whole decode steps (the module's stated deviation), so a pool
    that only decodes settles at B_max, not at one request."""
    cl = _cluster(4096)
    mix = rm.best_mix(cl, 30, 20.0, (rm.Route.B1,))
    assert mix.t_tok_local == pytest.approx(cl.t_tok(cl.max_batch))
    assert "local_gpu" in mix.binding or "local_mem" in mix.binding


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="accept_len"):
        rm.route_costs(_cluster(64), 4, 6.0, 1, 1)
    with pytest.raises(ValueError, match="compression"):
        rm.best_mix(_cluster(64, compression=1.0), 4, 2.0)
    with pytest.raises(ValueError, match="no request fits"):
        rm.best_mix(_cluster(64, weights_bytes=79 * GB), 4, 2.0)


def _inputs(k: int, **kw):
    from sglang_vc.vericache.remote.stream import PathInputs

    # a 47 MB full copy on a 20 MB/s link (2.4 s); a 1.5 s verify round committing 6.7
    # tokens; a 0.05 s draft step
    base = dict(new_tokens=k, full_bytes=47e6, link_bytes_per_s=20e6, round_s=1.5, commits_per_round=6.7,
                step_s=0.05, draft_tokens=8)
    return PathInputs(**{**base, **kw})


def test_the_runtime_choice_is_p1_when_the_full_copy_would_arrive_too_late():
    from sglang_vc.vericache.remote.stream import RemotePath, choose_path

    # 8 tokens: P1 is done in ~1.8 s, before the copy's 2.35 s
    assert choose_path(_inputs(8)) is RemotePath.P1
    # 256 tokens: P1 takes ~57 s; P2 has the copy after 2.35 s and decodes the rest alone
    assert choose_path(_inputs(256)) is RemotePath.P2
    # ... unless decoding alone is slower than verifying remotely
    assert choose_path(_inputs(256, step_s=0.5)) is RemotePath.P1
    # a faster link moves the crossover down
    assert choose_path(_inputs(16, link_bytes_per_s=2e9)) is RemotePath.P2


def test_before_anything_is_measured_long_outputs_take_p2():
    from sglang_vc.vericache.remote.stream import RemotePath, choose_path

    cold = dict(round_s=None, commits_per_round=None, step_s=None)
    assert choose_path(_inputs(15, **cold)) is RemotePath.P1
    assert choose_path(_inputs(16, **cold)) is RemotePath.P2
