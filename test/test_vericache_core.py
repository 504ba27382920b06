"""VeriCache core without SGLang: rings + ADMIT (paper §5, Algorithm 1), the §4.2.1
staggering example, verification rules (§4.1), the appendix B.1 model, counters."""

from __future__ import annotations

import math
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

try:
    import sglang_vc  # noqa: F401
except ImportError:  # plain checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_vc.vericache import perf_model as pm
from sglang_vc.vericache.admit import (
    AdmitState,
    admit,
    bw_profile,
    candidate_offsets,
    load_span,
)
from sglang_vc.vericache.metrics import VeriCacheMetrics
from sglang_vc.vericache.rings import BwRing, HbmRing, Ring
from sglang_vc.vericache.sampling import (
    greedy_verify,
    greedy_verify_ids,
    rejection_verify,
    verify,
)
from sglang_vc.vericache.reload_planner import ReloadPlanner

GB = 1e9

# ----------------------------------------------------------------------------- rings


def test_ring_advance_slides_and_wraps():
    r = Ring(4, capacity=10)
    r.add(1, [1, 2, 3])
    assert r.to_list() == [0, 1, 2, 3]
    assert r.advance() == 0
    assert r.to_list() == [1, 2, 3, 0]  # fresh empty window at W-1
    for _ in range(9):  # many wraps of the circular buffer
        r.advance()
    assert r.to_list() == [0, 0, 0, 0]
    r.add(3, [5])
    assert r[3] == 5 and r.peak() == 5
    with pytest.raises(IndexError):
        r[4]


def test_ring_fits_and_remove():
    r = Ring(5, capacity=1.0)
    r.add(0, [0.7, 0.3])
    assert r.fits(1, [0.7])  # exactly full is fine
    assert not r.fits(0, [0.4])
    assert not r.fits(4, [0.1, 0.1])  # past the window
    assert r.fits(0, [0.4], capacity=2.0)  # per-check override
    r.remove(-1, [9, 0.7])  # window -1 already retired: skipped
    assert r.to_list() == [0.0, 0.3, 0, 0, 0]


def test_hbm_ring_capacity_is_hbm_minus_weights_minus_resident():
    h = HbmRing(8, hbm_bytes=96 * GB, weights_bytes=50 * GB, resident_bytes=10 * GB)
    assert h.capacity == pytest.approx(36 * GB)
    assert h.fits(1, [36 * GB]) and not h.fits(1, [37 * GB])
    h.resident_bytes = 40 * GB
    assert h.capacity == pytest.approx(6 * GB)
    h.add(2, [4 * GB])
    assert h.device_peak() == pytest.approx(94 * GB)
    assert HbmRing(8).capacity == math.inf
    b = BwRing(8, iter_time=0.037)
    assert b.capacity == b.iter_time == 0.037


# ----------------------------------------------------------------------------- ADMIT


def test_load_span_and_profile():
    # ell_r = KV / (BW T_iter); S_r = max(1, ceil(ell_r))
    assert load_span(4 * GB, 50 * GB, 0.037) == (pytest.approx(4 / (50 * 0.037)), 3)
    assert load_span(1 * GB, 50 * GB, 0.02) == (pytest.approx(1.0), 1)  # exact fit
    assert load_span(0, 50 * GB, 0.02) == (0.0, 1)
    assert load_span(1.5 * GB, 50 * GB, 0.01)[1] == 3
    # serialised link kicked off at the first window: full windows, then the remainder
    assert bw_profile(2.5, 3, 0.01) == pytest.approx((0.01, 0.01, 0.005))
    assert bw_profile(0.25, 1, 0.04) == pytest.approx((0.01,))


def test_candidate_order_anchor_then_minus_then_plus():
    assert candidate_offsets(5, 1, 10) == [5, 4, 6, 3, 7, 2, 8, 1, 9]
    assert candidate_offsets(5, 3, 8) == [5, 4, 6, 3, 7]  # clamped to [S_r, W-1]
    assert candidate_offsets(1, 3, 8)[:3] == [3, 4, 5]  # anchor clamped up to S_r
    assert candidate_offsets(50, 1, 8) == [7, 6, 5, 4, 3, 2, 1]  # anchor clamped to W-1
    assert candidate_offsets(5, 8, 8) == []  # span larger than the window
    assert candidate_offsets(5, 1, 10, max_offset=3) == [3, 2, 1]  # few tokens left: at most 3 drafts
    assert candidate_offsets(5, 2, 10, max_offset=1) == [2]  # never below the reload's span


def test_decode_slots_one_more_per_iteration_and_no_draft_past_the_last_token():
    """SGLang's decode allocation with VERICACHE's per-request reserve: each request gets
    its committed length plus its outstanding drafts plus one (never less than it holds),
    and a request drafts at most its tokens left less one."""
    from types import SimpleNamespace as NS

    from sglang_vc.vericache.decode_slots import decode_alloc_lens, draft_cap

    reqs = [NS(kv=NS(kv_committed_len=100, kv_allocated_len=100), drafts=0),  # after prefill
            NS(kv=NS(kv_committed_len=100, kv_allocated_len=103), drafts=3),  # drafting: its 4th draft
            NS(kv=NS(kv_committed_len=104, kv_allocated_len=106), drafts=0)]  # verified 4 of 6 slots
    cur, nxt, needed = decode_alloc_lens(reqs, lambda r: r.drafts + 1, page_size=1)
    assert (cur, nxt, needed) == ([100, 103, 106], [101, 104, 106], 2)
    assert decode_alloc_lens(reqs[:1], lambda r: 1, page_size=16)[1] == [112]  # page-aligned
    assert draft_cap(32, 10) == 21 and draft_cap(32, 30) == 1 and draft_cap(32, 31) == 0
    assert draft_cap(None, 10) is None


def _rings(window=16, iter_time=1.0, hbm=None):
    return BwRing(window, iter_time), HbmRing(window, hbm_bytes=hbm)


def test_admit_reserves_span_on_both_rings_at_anchor():
    bw, hbm = _rings(iter_time=1.0, hbm=100.0)
    # KV 2.5 bytes at BW 1 byte/s, T_iter 1 s: ell 2.5, S_r 3
    p = admit(bw, hbm, kv_bytes=2.5, bandwidth=1.0, draft_len=8)
    assert (p.verify_offset, p.span, p.start_offset) == (8, 3, 6)
    assert bw.to_list()[6:9] == pytest.approx([1.0, 1.0, 0.5])
    assert sum(bw.to_list()) == pytest.approx(2.5)
    assert hbm.to_list()[6:9] == [2.5] * 3 and sum(hbm.to_list()) == 7.5


def test_admit_search_order_x_minus_1_then_x_plus_1_then_x_minus_2():
    bw, hbm = _rings()
    x = 8
    bw.add(x, [1.0])  # the anchor's window is taken on the link
    assert admit(bw, hbm, 1.0, 1.0, x).verify_offset == x - 1
    assert admit(bw, hbm, 1.0, 1.0, x).verify_offset == x + 1  # x, x-1 now taken
    assert admit(bw, hbm, 1.0, 1.0, x).verify_offset == x - 2
    assert admit(bw, hbm, 1.0, 1.0, x).verify_offset == x + 2


def test_admit_span_must_be_free_in_every_window():
    bw, hbm = _rings()
    bw.add(6, [0.6])  # one busy window inside the anchor's span [6, 8]
    p = admit(bw, hbm, 2.5, 1.0, 8)  # spans touching window 6 with a full slot fail
    # d=8 needs a full window 6, d=7: full 5, 6 fail; d=9: [7,8,9] all free
    assert p.verify_offset == 9
    # a busy *last* window of the span only needs room for the remainder (0.5)
    bw2, hbm2 = _rings()
    bw2.add(8, [0.4])
    assert admit(bw2, hbm2, 2.5, 1.0, 8).verify_offset == 8
    bw3, hbm3 = _rings()
    bw3.add(8, [0.6])
    assert admit(bw3, hbm3, 2.5, 1.0, 8).verify_offset == 7


def test_admit_respects_hbm_ring():
    bw, hbm = _rings(hbm=10.0)
    hbm.add(7, [8.0])  # only 2 bytes of HBM left in window 7
    p = admit(bw, hbm, 3.0, 100.0, 7)  # fast link: S_r = 1, needs 3 bytes of HBM
    assert p.verify_offset == 6
    hbm.add(1, [10.0] * 15)  # everything full
    assert admit(bw, hbm, 3.0, 100.0, 7) is None


def test_scheduler_defers_when_full_and_falls_back():
    s = ReloadPlanner(8, iter_time=1.0, bandwidth=1.0, stagger=False, fallback_after=3)
    # each reload takes a full window; windows 1..7 can hold 7 of them
    assert all(s.admit(i, 1.0, 4) is not None for i in range(7))
    assert s.admit("late", 1.0, 4) is None
    assert s.mode("late") is AdmitState.WAITING
    assert s.counters() == {"admissions": 7, "deferrals": 1, "fallbacks": 0}
    for _ in range(2):
        s.admit("late", 1.0, 4)
    assert s.mode("late") is AdmitState.FALLBACK and s.counters()["fallbacks"] == 1
    assert s.admit("late", 1.0, 4) is None and s.counters()["deferrals"] == 3
    # a span that can never fit (S_r = 8 > W - 1) falls back at once
    assert s.admit("huge", 8.0, 4) is None and s.mode("huge") is AdmitState.FALLBACK


def test_release_frees_slots():
    m = VeriCacheMetrics()
    s = ReloadPlanner(16, iter_time=1.0, bandwidth=1.0, hbm_bytes=100, metrics=m)
    a = s.admit("a", 2.5, 8)
    assert (a.reload_iteration, a.verify_iteration, a.draft_len) == (6, 8, 8)
    before = s.snapshot()
    b = s.admit("b", 2.5, 8)  # 8, 7, 9, 6, 10 overlap a's span: lands at 5
    assert b.verify_iteration == 5 and s.due_reloads(3) == ["b"]
    assert s.release("b") is True
    assert s.snapshot() == before and s.due_reloads(3) == [] and s.due_verifies(5) == []
    for _ in range(3):
        s.advance()
    snap = s.snapshot()
    assert sum(snap["bw_seconds"]) == pytest.approx(2.5)  # a's reservation, shifted by 3
    assert snap["bw_seconds"][3:6] == pytest.approx([1.0, 1.0, 0.5])
    assert s.release("a") is True and s.release("a") is False
    snap = s.snapshot()
    assert sum(snap["bw_seconds"]) == 0 and sum(snap["hbm_bytes"]) == 0
    assert sum(snap["verifies"]) == 0
    assert s.due_reloads(6) == [] and s.due_verifies(8) == [] and s.mode("a") is None
    # the freed slot is usable again
    c = s.admit("c", 2.5, 5)
    assert c.verify_iteration == s.now + 5
    assert m.admissions == 3 and m.admissions_deferred == 0


def test_release_mid_reload_frees_remaining_windows():
    s = ReloadPlanner(16, iter_time=1.0, bandwidth=1.0)
    s.admit("a", 2.5, 4)  # windows 2, 3, 4
    for _ in range(3):
        s.advance()  # now = 3: reload in flight
    assert s.snapshot()["bw_seconds"][:2] == pytest.approx([1.0, 0.5])
    s.release("a")
    assert sum(s.snapshot()["bw_seconds"]) == 0


def test_execution_loop_due_lists_and_readmission():
    s = ReloadPlanner(16, iter_time=1.0, bandwidth=1.0)
    s.admit("a", 2.5, 5)  # reload kicks off at 3, verify at 5
    seen = {}
    for t in range(6):
        assert s.now == t
        seen[t] = (s.due_reloads(), s.due_verifies())
        if t == 5:
            with pytest.raises(ValueError):
                s.admit("a", 2.5, 5)  # still pending in its verify iteration
        done = s.advance()
    assert seen[3] == (["a"], []) and seen[5] == ([], ["a"])
    assert done == ["a"]
    a2 = s.admit("a", 2.5, 5)  # re-ADMIT after the verify, from the next iteration
    assert (a2.admitted_at, a2.verify_iteration) == (6, 11)


def _run_loop(sched, n_req, kv_bytes, x, iters):
    """Drive the §5.2 loop; returns verifies per iteration and draft lengths."""
    waiting = list(range(n_req))
    per_iter, drafts = [], []
    for t in range(iters):
        for r in list(waiting):
            a = sched.admit(r, kv_bytes, x)
            if a is not None:
                waiting.remove(r)
                drafts.append(a.draft_len)
        per_iter.append(len(sched.due_verifies(t)))
        waiting += sched.advance()
    return per_iter, drafts


def test_staggered_verifies_about_B_over_x_per_iteration():
    B, x = 64, 15
    # fast link, no HBM limit: no resource forces staggering, the verify cap does
    s = ReloadPlanner(40, iter_time=0.02, bandwidth=1e12)
    per_iter, _ = _run_loop(s, B, 1e6, x, 400)
    steady = per_iter[100:]
    assert max(steady) <= math.ceil(B / x)
    assert sum(steady) / len(steady) == pytest.approx(B / (x + 1), rel=0.05)
    # lock-step (no stagger): everyone verifies together every x + 1 iterations
    s = ReloadPlanner(40, iter_time=0.02, bandwidth=1e12, stagger=False)
    per_iter, _ = _run_loop(s, B, 1e6, x, 400)
    assert max(per_iter) == B and Counter(per_iter)[0] > 300


# ------------------------------------------------- paper §4.2.1 concrete example


# Mistral 24B on an RTX PRO 6000 (96 GB, PCIe Gen5 x16), B = 10, KV_comp = 1 GB,
# KV_full = 4 GB, x = 30. The paper's derived numbers pin the rest down:
#   peak HBM M + B KV_comp + KV_full = 64 GB and M + B KV_full = 90 GB  =>  M = 50 GB;
#   "each verify transfers one KV_full over PCIe (~80 ms)"   =>  BW = 4 GB / 80 ms = 50 GB/s
#   (effective; 64 GB/s nominal), which also gives "40 GB ... ~800 ms";
#   draft-only iteration ~35 ms for M + B KV_comp = 60 GB     =>  BW_hbm ~ 1.71 TB/s,
#   and a verify-carrying iteration, 64 GB, takes ~37 ms = T_iter.
EX = dict(M=50 * GB, B=10, KV_COMP=1 * GB, KV_FULL=4 * GB, X=30, HBM=96 * GB,
          BW=4 * GB / 0.080, BW_HBM=60 * GB / 0.035)
EX_T_ITER = (EX["M"] + EX["B"] * EX["KV_COMP"] + EX["KV_FULL"]) / EX["BW_HBM"]


def _example_scheduler():
    return ReloadPlanner(
        window=64, iter_time=EX_T_ITER, bandwidth=EX["BW"], hbm_bytes=EX["HBM"],
        weights_bytes=EX["M"], resident_bytes=EX["B"] * EX["KV_COMP"],
    )


def test_paper_example_derived_numbers():
    assert EX_T_ITER == pytest.approx(0.037, abs=0.0005)  # "~37 ms"
    ell, span = load_span(EX["KV_FULL"], EX["BW"], EX_T_ITER)
    assert ell == pytest.approx(0.080 / EX_T_ITER) and span == 3  # 80 ms / ~37 ms
    # one reload per 3 windows x 10 requests = 30 windows = x: "one every 3 draft iterations"
    assert span * EX["B"] == EX["X"]


def test_paper_example_staggering_avoids_lockstep_spike():
    s = _example_scheduler()
    adms = [s.admit(r, EX["KV_FULL"], EX["X"]) for r in range(EX["B"])]
    verify_at = sorted(a.verify_iteration for a in adms)
    # ADMIT spreads the 10 verifies one every 3 iterations around the anchor x = 30
    assert verify_at == list(range(15, 43, 3))
    assert [a.verify_iteration for a in adms[:3]] == [30, 27, 33]
    snap = s.snapshot()
    staggered_link_peak = max(snap["bw_seconds"])  # seconds of PCIe per iteration
    staggered_hbm_peak = s.hbm_ring.device_peak()
    assert staggered_link_peak <= EX_T_ITER * (1 + 1e-9)  # fits in one iteration
    assert staggered_hbm_peak == pytest.approx(64 * GB)  # paper: 64 GB
    assert max(snap["verifies"]) == 1

    # Lock-step: all 10 verifies at iteration 30, their reloads serialised on the link
    # after the all-draft iterations (which leave it idle).
    lockstep_link = EX["B"] * EX["KV_FULL"] / EX["BW"]
    lockstep_hbm = EX["M"] + EX["B"] * EX["KV_FULL"]  # compressed KV offloaded
    assert lockstep_link == pytest.approx(0.800)  # paper: ~800 ms
    assert lockstep_link / EX_T_ITER == pytest.approx(20, rel=0.1)  # "~20x the window"
    assert lockstep_hbm == pytest.approx(90 * GB)  # paper: 90 GB
    # peak per-iteration reload demand, with vs without staggering
    assert lockstep_link / staggered_link_peak > 20
    assert lockstep_hbm - staggered_hbm_peak == pytest.approx(26 * GB)
    # keeping the compressed KV resident, lock-step does not even fit in 96 GB
    assert lockstep_hbm + EX["B"] * EX["KV_COMP"] > EX["HBM"]


def test_paper_example_steady_state_one_verify_per_iteration():
    s = _example_scheduler()
    per_iter, drafts = _run_loop(s, EX["B"], EX["KV_FULL"], EX["X"], 1000)
    assert max(per_iter) == 1
    assert Counter(drafts[EX["B"]:]) == {EX["X"]: len(drafts) - EX["B"]}  # cycles of x
    assert s.counters()["deferrals"] == 0
    assert sum(per_iter[100:]) / 900 == pytest.approx(EX["B"] / (EX["X"] + 1), rel=0.02)


# ------------------------------------------------------------------ greedy verify


def test_greedy_accept_correct_bonus():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    target = torch.tensor([
        [5, 6, 7, 8],  # all accepted + bonus 8
        [5, 9, 7, 8],  # mismatch at 1: accept 5, correction 9
        [1, 6, 7, 8],  # mismatch at 0: correction 1 only
    ])
    r = greedy_verify_ids(draft, target)
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert r.num_tokens.tolist() == [4, 2, 1]
    assert r.tokens.tolist() == [[5, 6, 7, 8], [5, 9, -1, -1], [1, -1, -1, -1]]


def test_greedy_from_logits_and_variable_draft_lens():
    V = 12
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 3, 4]])
    logits = torch.nn.functional.one_hot(target, V).float() * 3 + 0.01 * torch.randn(2, 4, V)
    draft = torch.tensor([[5, 6, 7], [5, 6, 0]])  # row 1 drafted only 2 tokens
    r = greedy_verify(draft, logits, draft_lens=torch.tensor([3, 2]))
    assert r.num_accepted.tolist() == [3, 2]
    assert r.tokens.tolist() == [[5, 6, 7, 8], [5, 6, 3, -1]]  # bonus from row len=2
    # no drafts at all: commit the verifier's token
    r0 = greedy_verify_ids(torch.empty(2, 0, dtype=torch.long), target[:, :1])
    assert r0.tokens.tolist() == [[5], [5]] and r0.num_accepted.tolist() == [0, 0]


# ------------------------------------------------------------- rejection sampling


def _dist(gen, *shape, V, scale=1.0):
    return torch.softmax(torch.randn(*shape, V, generator=gen) * scale, dim=-1)


def _chi2(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_999 = {4: 18.467, 24: 51.179}  # chi-square 0.999 quantiles (df)


def test_rejection_sampling_matches_target_joint_distribution():
    """Two tokens via rounds of draft (q) + rejection against target (p): their joint
    law must be p(a) p(b | a) exactly, whatever the drafter."""
    V, N = 5, 200_000
    g = torch.Generator().manual_seed(0)
    p0, P1, P2 = _dist(g, V=V), _dist(g, V, V=V), _dist(g, V=V)
    q0, Q1 = _dist(g, V=V, scale=2.0), _dist(g, V, V=V, scale=2.0)
    # round 1: draft two tokens from q, verify against p
    t1 = torch.multinomial(q0.expand(N, V), 1, generator=g).squeeze(1)
    t2 = torch.multinomial(Q1[t1], 1, generator=g).squeeze(1)
    draft = torch.stack([t1, t2], 1)
    draft_probs = torch.stack([q0.expand(N, V), Q1[t1]], 1)
    target_probs = torch.stack([p0.expand(N, V), P1[t1], P2.expand(N, V)], 1)
    r = rejection_verify(draft, draft_probs, target_probs, generator=g)
    x1 = r.tokens[:, 0]
    x2 = r.tokens[:, 1].clone()
    # rows that committed a single token: a second round drafts one token given x1
    short = r.num_tokens < 2
    s1 = torch.multinomial(Q1[x1[short]], 1, generator=g)
    r2 = rejection_verify(
        s1, Q1[x1[short]][:, None], torch.stack([P1[x1[short]], P2.expand(int(short.sum()), V)], 1),
        generator=g,
    )
    x2[short] = r2.tokens[:, 0]
    counts = torch.bincount(x1 * V + x2, minlength=V * V).double()
    expected = (p0[:, None] * P1).flatten().double() * N
    assert _chi2(counts, expected) < CHI2_999[24]
    assert 0.5 * float((counts / N - expected / N).abs().sum()) < 0.01  # total variation
    # acceptance of the first draft happens with probability sum_v min(p, q)
    acc0 = float((r.num_accepted >= 1).double().mean())
    assert acc0 == pytest.approx(float(torch.minimum(p0, q0).sum()), abs=0.005)
    # negative control: trusting the drafter (accept everything) is caught by the test
    naive = torch.bincount(t1 * V + t2, minlength=V * V).double()
    assert _chi2(naive, expected) > 100 * CHI2_999[24]


def test_rejection_bonus_token_follows_target():
    V, N = 5, 100_000
    g = torch.Generator().manual_seed(1)
    p, bonus = _dist(g, V=V), _dist(g, V=V)
    draft = torch.multinomial(p.expand(N, V), 1, replacement=True, generator=g)
    # q == p: every draft is accepted, the bonus comes from the last target row
    r = rejection_verify(draft, p.expand(N, 1, V), torch.stack([p.expand(N, V), bonus.expand(N, V)], 1),
                         generator=g)
    assert bool((r.num_accepted == 1).all())
    counts = torch.bincount(r.tokens[:, 1], minlength=V).double()
    assert _chi2(counts, bonus.double() * N) < CHI2_999[4]


def test_rejection_edge_cases_and_determinism():
    V = 6
    onehot = torch.nn.functional.one_hot(torch.tensor([2, 3, 4]), V).float()
    # deterministic target disagreeing with the draft: always rejected, corrected to p's token
    target = torch.stack([onehot[0], onehot[1], onehot[2], onehot[2]])[None]
    r = rejection_verify(torch.tensor([[1, 1, 1]]), onehot.new_full((1, 3, V), 1 / V), target)
    assert r.num_accepted.tolist() == [0] and r.tokens.tolist() == [[2, -1, -1, -1]]
    # draft lens: row with 0 real drafts samples from target row 0
    g = torch.Generator().manual_seed(3)
    p = _dist(g, 4, 3, V=V)
    q = _dist(g, 4, 2, V=V)
    d = torch.randint(0, V, (4, 2), generator=g)
    lens = torch.tensor([2, 1, 0, 2])
    a = rejection_verify(d, q, p, lens, torch.Generator().manual_seed(7))
    b = rejection_verify(d, q, p, lens, torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert bool((a.num_accepted <= lens).all())


def test_verify_dispatch_mixed_temperatures():
    g = torch.Generator().manual_seed(0)
    B, X, V = 4, 3, 7
    logits = torch.randn(B, X + 1, V, generator=g)
    draft = logits[:, :X].argmax(-1)
    draft[1, 1] = (draft[1, 1] + 1) % V
    q = torch.softmax(torch.randn(B, X, V, generator=g), -1)
    temp = torch.tensor([0.0, 0.0, 0.8, 1.0])
    r = verify(draft, logits, temp, draft_probs=q, generator=g)
    greedy = greedy_verify(draft[:2], logits[:2])
    assert torch.equal(r.tokens[:2], greedy.tokens) and r.num_accepted[:2].tolist() == [3, 1]
    assert bool((r.num_tokens == r.num_accepted + 1).all())
    assert torch.equal(verify(draft, logits).tokens, greedy_verify(draft, logits).tokens)
    with pytest.raises(ValueError):
        verify(draft, logits, 0.5)


# ------------------------------------------------------------------ perf model (B.1)


def test_perf_model_reproduces_section_4_2_1():
    M, B, KV, c, x = EX["M"], EX["B"], EX["KV_FULL"], 0.25, EX["X"]
    draft_only = pm.gpu_time(M, B, EX["KV_COMP"], EX["BW_HBM"])
    assert draft_only == pytest.approx(0.035)
    with_verify = (M + B * EX["KV_COMP"] + KV) / EX["BW_HBM"]
    assert with_verify == pytest.approx(0.037, abs=0.0005)
    # Eq. 3: B/x = 1/3 verify per iteration, the GPU side dominates, T_xfer < T_gpu
    t_iter, t_gpu, t_xfer = pm.staggered_iter_time(M, B, KV, c, x, EX["BW_HBM"], EX["BW"])
    assert t_iter == t_gpu == pytest.approx(0.0358, abs=0.0005)
    assert t_xfer == pytest.approx(10 * 4 / (30 * 50))
    # Eq. 9 with ell = S_r = 3: B_c ell / (x + 1) = 30/31 <= 1: one reload in flight
    assert pm.link_concurrency(B, x, 3) == pytest.approx(30 / 31)
    # Eq. 5 / 6: average device KV per offloaded request and the batch it allows
    assert pm.avg_kv_per_offloaded(KV, c, x) == pytest.approx(KV * 8.5 / 31)
    assert pm.full_kv_batch(EX["HBM"], M, KV) == 11
    assert pm.max_offloaded_batch(EX["HBM"], M, KV, c, x) == 41


def test_perf_model_section_2_1_numbers():
    # Llama-3.1-8B (~16 GB) on H100 (3 TB/s): ~5 ms/step at 5K (0.6 GB KV), ~25 ms at 500K
    # (60 GB); 100 tokens take ~0.5 s and ~2.5 s.
    for kv, secs in ((0.6 * GB, 0.5), (60 * GB, 2.5)):
        tps, b, t = pm.full_kv_from_hardware(
            weights_bytes=16 * GB, kv_full_bytes=kv, hbm_bw=3e12, gpu_mem_bytes=80 * GB, batch_size=1
        )
        assert 100 / tps == pytest.approx(secs, rel=0.12)
    # Qwen-32B (~64 GB) on 80 GB: ~0.3 GB/request at 2K -> batch ~50; 15 GB at 100K -> 1
    assert pm.full_kv_batch(80 * GB, 64 * GB, 0.3 * GB) == pytest.approx(50, rel=0.1)
    assert pm.full_kv_batch(80 * GB, 64 * GB, 15 * GB) == 1


def test_perf_model_sanity():
    kw = dict(weights_bytes=50 * GB, kv_full_bytes=4 * GB, compression=0.25, draft_len=30,
              hbm_bw=EX["BW_HBM"], interconnect_bw=EX["BW"], gpu_mem_bytes=96 * GB)
    full_tps, full_b, _ = pm.full_kv_from_hardware(weights_bytes=50 * GB, kv_full_bytes=4 * GB,
                                                   hbm_bw=EX["BW_HBM"], gpu_mem_bytes=96 * GB)
    assert full_b == 11
    # perfect acceptance (gamma = 1) with a batch that respects Eq. 9 beats full KV
    good = pm.predict_from_hardware(accept_len=pm.acceptance_length(1.0, 30), batch_size=31, **kw)
    assert good.feasible and good.tokens_per_s > 2 * full_tps
    assert good.tokens_per_iter == pytest.approx(31.0)  # every request 1 token/iteration
    # more accepted tokens -> more throughput, everything else equal
    tps = [pm.predict_from_hardware(accept_len=a, batch_size=31, **kw).tokens_per_s for a in (1, 10, 20, 31)]
    assert tps == sorted(tps)
    # Eq. 6 batch (41) violates Eq. 9 at ell = 1 (41 > 31): flagged
    big = pm.predict_from_hardware(accept_len=20, **kw)
    assert big.batch_size == 41 and not big.feasible
    # no offloaded requests: no transfers; slow link: interconnect-bound
    none_off = pm.predict_throughput(batch_size=8, draft_len=10, accept_len=5, t_gpu=0.02,
                                     reload_bytes=1 * GB, interconnect_bw=1 * GB, offloaded=0)
    assert none_off.t_xfer == 0 and none_off.bottleneck == "hbm"
    slow = pm.predict_throughput(batch_size=8, draft_len=10, accept_len=5, t_gpu=0.02,
                                 reload_bytes=1 * GB, interconnect_bw=1 * GB)
    assert slow.bottleneck == "interconnect" and slow.t_iter == pytest.approx(8 / 11)
    assert slow.link_utilization == pytest.approx(1.0)
    assert pm.acceptance_rate(pm.acceptance_length(0.8, 30), 30) == pytest.approx(0.8)


# ------------------------------------------------------------------------- metrics


def test_metrics_counters_thread_safe_and_dict():
    m = VeriCacheMetrics()

    def work():
        for _ in range(1000):
            m.record_verify(drafted=4, accepted=3)
            m.add(bytes_reloaded=10)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = m.to_dict()
    assert d["verify_rounds"] == 4000 and d["drafted"] == 16000 and d["accepted"] == 12000
    assert d["committed"] == 16000 and d["bytes_reloaded"] == 40000
    assert d["mean_acceptance_length"] == pytest.approx(4.0) == m.mean_acceptance_length
    assert d["acceptance_rate"] == pytest.approx(0.75)
    assert "mean_acceptance_length" not in m.to_dict(derived=False)
    with pytest.raises(AttributeError):
        m.add(nonsense=1)
    m.reset()
    assert m.to_dict()["verify_rounds"] == 0 and m.mean_acceptance_length == 0.0


def test_unsupported_parameters_are_named():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_vc.vericache.requests import unsupported_request, unsupported_sampling

    assert unsupported_sampling(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                               logit_bias={"3": -1.0}, sampling_seed=7)) == []
    sp = SamplingParams(frequency_penalty=0.1, repetition_penalty=1.1, regex="a+", min_new_tokens=2)
    assert unsupported_sampling(sp) == []  # penalties and grammars are applied per position
    assert unsupported_sampling(sp, "SPECACHE") == ["regex"]
    assert unsupported_request(GenerateReqInput(input_ids=[1, 2])) == []
    # VERICACHE returns logprobs from its verify; SPECACHE and the remote verifier do not
    assert unsupported_request(GenerateReqInput(input_ids=[1, 2], return_logprob=True, top_logprobs_num=2)) == []
    assert unsupported_request(GenerateReqInput(input_ids=[1], custom_logit_processor="{}")) == ["custom_logit_processor"]
    assert unsupported_request(GenerateReqInput(input_ids=[1, 2], return_logprob=True), "SPECACHE") == ["return_logprob"]
    assert unsupported_request(GenerateReqInput(input_ids=[[1], [2]], return_logprob=[False, True]),
                               "VERICACHE_REMOTE") == ["return_logprob"]
    assert unsupported_request(GenerateReqInput(input_ids=[1], token_ids_logprob=[0]), "SPECACHE") == ["token_ids_logprob"]
    assert unsupported_request(GenerateReqInput(input_ids=[[1], [2]], token_ids_logprob=[None, None]), "SPECACHE") == []


# ----------------------------------------------------------------------------- staggered


def _run_staggered(n_requests: int, x: int, iterations: int, kv_bytes, hbm_bytes=None):
    """Drive StaggeredSchedule like the worker: drafters append a token, verifiers commit
    one token (every draft rejected) and are re-admitted next iteration."""
    from sglang_vc.vericache.staggered_schedule import Outcome, Role, StaggeredSchedule

    sched = StaggeredSchedule(ReloadPlanner(window=2 * x, iter_time=1.0, bandwidth=1e9,
                                              hbm_bytes=hbm_bytes, fallback_after=2 * x), x)
    rids = [f"r{i}" for i in range(n_requests)]
    committed = {rid: 100 for rid in rids}
    log = []
    for _ in range(iterations):
        plan = sched.plan(rids, list(range(n_requests)), [committed[r] for r in rids], kv_bytes)
        outcome = {}
        for slot in plan.reloads_due:
            slot.track.reload_started_at = plan.iteration
        for slot in plan.slots:
            if slot.role is Role.DRAFT:
                slot.track.drafts.append(7)
            elif slot.role in (Role.VERIFY, Role.FULL):
                outcome[slot.track.rid] = Outcome(len(slot.track.drafts), 1)
                adm = slot.track.admission
                log.append((plan.iteration, slot.role, len(slot.track.drafts),
                            None if adm is None else (adm.admitted_at, adm.verify_iteration, adm.reload_iteration),
                            slot.track.reload_started_at))
                sched.verified(slot.track, 1)
                committed[slot.track.rid] += 1
            else:
                log.append((plan.iteration, slot.role, 0, None, None))
        sched.finish(plan, 1.0, outcome, {})
    return log


def test_staggered_schedule_verifies_as_admitted_and_spreads_verifies():
    """Eight requests at X = 4: each verify happens at the iteration ADMIT reserved, after
    exactly the drafts it allowed, with the reload started at the reserved window; about
    8 / 4 requests verify per iteration instead of all eight every fifth."""
    log = _run_staggered(8, 4, 40, kv_bytes=lambda i: int(2e8))  # 0.2 s of link per reload
    verifies = [e for e in log if e[1].value == "verify"]
    assert len(verifies) >= 40
    for it, _, drafts, (admitted, verify_at, reload_at), started in verifies:
        assert it == verify_at and drafts == verify_at - admitted and started == reload_at
    per_iteration = Counter(e[0] for e in verifies)
    assert max(per_iteration.values()) <= 2  # ceil(8 / 4)


def _run_in_pool(uniform: bool, x: int, arrivals: dict, iterations: int):
    """In-pool drafters (nothing to reload) arriving at ``arrivals[rid]``, driven like the
    worker drives them (every draft accepted: x + 1 tokens per verify)."""
    from sglang_vc.vericache.staggered_schedule import Outcome, Role, StaggeredSchedule

    sched = StaggeredSchedule(ReloadPlanner(window=2 * x, iter_time=1.0, bandwidth=1e9, fallback_after=2 * x), x)
    sched.uniform_in_pool = uniform
    committed, verifies = {}, []  # (iteration, rid, drafts)
    for it in range(iterations):
        rids = [r for r, at in arrivals.items() if at <= it]
        for r in rids:
            committed.setdefault(r, 600)
        plan = sched.plan(rids, list(range(len(rids))), [committed[r] for r in rids], lambda i: 0)
        outcome = {}
        for slot in plan.slots:
            if slot.role is Role.DRAFT:
                slot.track.drafts.append(7)
            elif slot.role is Role.VERIFY:
                n = len(slot.track.drafts)
                verifies.append((plan.iteration, slot.track.rid, n))
                outcome[slot.track.rid] = Outcome(n, n + 1)
                sched.verified(slot.track, n + 1)
                committed[slot.track.rid] += n + 1
        sched.finish(plan, 1.0, outcome, {})
    return verifies


def test_uniform_in_pool_drafters_verify_together_at_one_width():
    """``--vc-in-pool-verify uniform``: in-pool drafters that arrive at different
    iterations join the cohort's verify (a newcomer drafts fewer tokens once), and from
    then on every verify iteration holds all of them at X drafts each, the iterations in
    between none; staggered, at most ceil(6 / 4) verify per iteration."""
    x, arrivals = 4, {"a": 0, "b": 0, "c": 0, "d": 2, "e": 3, "f": 7}
    verifies = _run_in_pool(True, x, arrivals, 40)
    by_iteration: dict = {}
    for it, rid, n in verifies:
        by_iteration.setdefault(it, []).append((rid, n))
    steady = {it: v for it, v in by_iteration.items() if it > 12}
    assert len(steady) >= 5
    for it, members in steady.items():
        assert sorted(r for r, _ in members) == sorted(arrivals) and {n for _, n in members} == {x}, (it, members)
    gaps = sorted(steady)
    assert all(b - a == x + 1 for a, b in zip(gaps, gaps[1:]))  # x drafting iterations, then the verify
    joins = [n for it, rid, n in verifies if rid == "f"][:1]
    assert joins and joins[0] < x  # its first cycle was cut short to join
    per_iteration = Counter(it for it, _, _ in _run_in_pool(False, x, arrivals, 40) if it > 12)
    assert max(per_iteration.values()) <= math.ceil(6 / x)


def test_staggered_schedule_full_and_waiting_requests():
    """A request whose KV is not compressed decodes every iteration (FULL). When the
    device budget cannot hold a reload, requests wait, then fall back to full decoding."""
    log = _run_staggered(3, 2, 6, kv_bytes=lambda i: None if i == 0 else int(1e8))
    assert sum(e[1].value == "full" for e in log) == 6  # request 0, every iteration
    assert any(e[1].value == "verify" for e in log)  # the others speculate
    log = _run_staggered(2, 2, 12, kv_bytes=lambda i: int(1e8), hbm_bytes=5e7)
    roles = [e[1].value for e in log]
    assert roles[:2] == ["wait", "wait"] and "verify" not in roles
    assert roles[-2:] == ["full", "full"]  # fell back after 2X deferrals


def test_best_feasible_point_of_eq_11_on_the_papers_example():
    """Mistral-24B-like (M = 50 GB, KV_full = 4 GB) on a 96 GB GPU, PCIe 64 GB/s, x = 30,
    c = 0.25: Eq. 6 alone would offload 41 requests, which Eq. 9 forbids (41 > x + 1);
    the feasible optimum offloads 31, keeps 3 on the device, and is about 2x full KV
    (11 requests) at the paper's acceptance length of about 19-20 at x = 30."""
    hw = dict(weights_bytes=50 * GB, kv_full_bytes=4 * GB, compression=0.25, hbm_bw=EX["BW_HBM"],
              interconnect_bw=64 * GB, gpu_mem_bytes=96 * GB)
    o = pm.best_feasible(acceptance={30: 19.5}, **hw)
    assert (o.offloaded, o.on_device, o.batch_size, o.cycles_per_load, o.full_kv_batch) == (31, 3, 34, 1, 11)
    assert o.ratio_to_full == pytest.approx(2.0, abs=0.15)
    assert pm.Bound.LINK_CONCURRENCY in o.binding and pm.Bound.MEMORY in o.binding and pm.Bound.HBM in o.binding
    # the draft length is chosen from the acceptance curve: x = 4 amortizes nothing
    curve = pm.best_feasible(acceptance={4: 3.7, 15: 12.0, 30: 19.5}, **hw)
    assert curve.draft_len in (15, 30) and curve.tokens_per_s >= o.tokens_per_s
    # a slow link: the interconnect binds, and the optimum offloads fewer requests
    slow = pm.best_feasible(acceptance={30: 19.5}, **{**hw, "interconnect_bw": 2 * GB})
    assert slow.offloaded < 31 and slow.tokens_per_s < o.tokens_per_s
    # a quantizer's verify reloads all of the full KV, not (1 - c) of it: never faster
    link = {**hw, "interconnect_bw": GB // 2}
    quant = pm.best_feasible(acceptance={30: 19.5}, reload_fraction=1.0, **link)
    assert quant.tokens_per_s <= pm.best_feasible(acceptance={30: 19.5}, **link).tokens_per_s
    assert quant.offloaded and quant.t_xfer == pytest.approx(
        pm.xfer_time(quant.offloaded, 4 * GB, 30, GB // 2, quant.cycles_per_load))


def test_best_feasible_prices_on_device_requests_at_full_kv():
    """A request kept at full KV on the device reads all of it each iteration and commits
    one token; the offloaded ones read the average and commit A / (x + 1)."""
    hw = dict(weights_bytes=50 * GB, kv_full_bytes=4 * GB, compression=0.25, hbm_bw=EX["BW_HBM"],
              interconnect_bw=64 * GB, gpu_mem_bytes=96 * GB)
    o = pm.best_feasible(acceptance={30: 19.5}, **hw)
    kv_avg = pm.avg_kv_per_offloaded(4 * GB, 0.25, 30)
    assert o.t_gpu == pytest.approx((50 * GB + o.on_device * 4 * GB + o.offloaded * kv_avg) / EX["BW_HBM"])
    tokens = o.offloaded * 19.5 / 31 + o.on_device
    assert o.tokens_per_s == pytest.approx(tokens / max(o.t_gpu, o.t_xfer))


def test_best_feasible_is_never_infeasible():
    import random

    rng = random.Random(0)
    for _ in range(200):
        c = rng.uniform(0.05, 0.9)
        m, kv, mem = rng.uniform(1, 60) * GB, rng.uniform(0.1, 10) * GB, rng.uniform(20, 140) * GB
        if mem <= m + kv:
            continue
        curve = {x: 1 + rng.uniform(0, 1) * x for x in rng.sample(range(1, 41), 3)}
        o = pm.best_feasible(weights_bytes=m, kv_full_bytes=kv, compression=c, acceptance=curve,
                             hbm_bw=rng.uniform(0.5, 4) * 1e12, interconnect_bw=rng.uniform(1, 100) * GB,
                             gpu_mem_bytes=mem, max_requests=rng.choice([None, 4, 64]))
        kv_avg = pm.avg_kv_per_offloaded(kv, c, o.draft_len)
        assert m + o.on_device * kv + o.offloaded * kv_avg <= mem * (1 + 1e-9)  # Eq. 6
        assert o.offloaded * o.cycles_per_load <= o.draft_len + 1 and o.cycles_per_load >= 1  # Eq. 9
        assert o.batch_size >= 1 and o.tokens_per_s > 0
    with pytest.raises(ValueError):
        pm.best_feasible(weights_bytes=95 * GB, kv_full_bytes=10 * GB, compression=0.25, acceptance={30: 19},
                         hbm_bw=1e12, interconnect_bw=GB, gpu_mem_bytes=96 * GB)


def test_the_host_store_is_bounded_by_default():
    """Without ``--vc-host-kv-gb`` the host store holds at most half of the machine's
    memory (pinned memory cannot be swapped: unbounded, it could take the machine)."""
    import psutil

    from sglang_vc.vericache import flags

    assert flags.host_kv_bytes({}) == int(0.5 * psutil.virtual_memory().total)
    assert flags.host_kv_bytes({"host_kv_gb": 1.5}) == int(1.5 * 2**30)


def test_a_prompt_waiting_requests_share_is_not_compressed():
    """The compress gate keeps a prompt whose first half waiting requests share at full KV
    (a compressed request's rows never enter the radix tree, so each of them would prefill
    the shared document again): ``shared_by`` counts them."""
    from sglang_vc.vericache.worker import shared_by

    doc = list(range(1000))
    waiting = [doc + [5, 6], doc[:600] + [7] * 500, list(range(1, 1001)), doc[:400]]
    assert shared_by(doc + [1, 2], waiting) == 2  # the first two share >= 501 tokens
    assert shared_by([9] * 10, waiting) == 0
