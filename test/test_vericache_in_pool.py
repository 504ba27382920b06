"""In-pool self-speculation (``--vc-in-pool``): a VERICACHE request whose full KV stays in
the pool drafts over a sink+window view of its own rows and verifies in place; a mode per
request and cycle (full, in-pool, offload) from measured costs.

In process: the view's positions and attention, the budget flag, the policy and the
model. One server: identity with the plain server in batches that mix in-pool drafters,
full-KV requests and offloaded (compressed) ones, in two orders, with drafts rejected.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch

from conftest import real_text_passages
from sglang_vc.kvruntime.launches import LaunchCounter
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import compare, finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess
from sglang_vc.vericache import draft_view
from sglang_vc.vericache.draft_length import MIN_VERIFIES, AcceptanceCurve, DraftLength
from sglang_vc.vericache.perf_model import RowCosts, full_kv_token_time, in_pool_cycle_time, in_pool_speedup
from sglang_vc.vericache.policy import MIN_ITERATIONS, IterationRows, Mode, ModePolicy

META = "sglang_vc_vericache"


# ----------------------------------------------------------------------------- the view


def test_view_is_sinks_plus_a_sliding_window_and_everything_when_short():
    pos, valid = draft_view.view_positions(torch.tensor([3, 10, 20, 21]), torch.tensor([8, 8, 6, 6]), 8, sinks=4)
    assert pos[0, :3].tolist() == [0, 1, 2] and valid[0].tolist() == [True] * 3 + [False] * 5
    assert pos[1].tolist() == [0, 1, 2, 3, 6, 7, 8, 9] and valid[1].all()
    assert pos[2, :6].tolist() == [0, 1, 2, 3, 18, 19] and valid[2].tolist() == [True] * 6 + [False] * 2
    assert pos[3, :6].tolist() == [0, 1, 2, 3, 19, 20]  # the window slid by one with the length


def test_view_attention_equals_attention_over_the_views_rows():
    """One batched call for every drafter equals each request's softmax over exactly its
    view's rows (GQA: 6 query heads on 2 KV heads); a view covering the request is full
    attention."""
    torch.manual_seed(0)
    slots_total, hkv, hq, d = 64, 2, 6, 8
    k_buf, v_buf = torch.randn(slots_total, hkv, d), torch.randn(slots_total, hkv, d)
    req_to_token = torch.randperm(slots_total - 1)[:60].add(1).view(2, 30)
    lengths, budgets = torch.tensor([30, 9]), torch.tensor([12, 12])
    q = torch.randn(2, hq, d)
    slots, valid = draft_view.view_slots(req_to_token, torch.tensor([0, 1]), lengths, budgets, 12)
    out = draft_view.attend_view(q, k_buf, v_buf, slots, valid, scale=0.3)
    for i, positions in enumerate([[0, 1, 2, 3, *range(22, 30)], list(range(9))]):
        rows = req_to_token[i, positions]
        k = k_buf[rows].repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        v = v_buf[rows].repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * 0.3, dim=-1)
        assert torch.allclose(out[i], torch.einsum("hn,nhd->hd", w, v), atol=1e-5)


def test_draft_view_launches_and_syncs_do_not_grow_with_the_batch():
    """The in-pool draft's per-forward index build and per-layer attention run the same
    operators for 2 drafters as for 8 (fixed shapes, no per-request loop), and read nothing
    back on the host (the stand-in for CUDA launches and syncs: every aten operator is a
    kernel on a GPU; :class:`~sglang_vc.kvruntime.syncs.SyncCounter` counts host reads)."""
    from sglang_vc.kvruntime.syncs import SyncCounter

    counts = {}
    for n in (2, 8):
        g = torch.Generator().manual_seed(n)
        k_buf, v_buf = torch.randn(4096, 3, 64, generator=g), torch.randn(4096, 3, 64, generator=g)
        req_to_token = torch.randint(1, 4096, (16, 1024), generator=g)
        lengths = torch.randint(100, 1000, (n,), generator=g)
        q = torch.randn(n, 9, 64, generator=g)
        with SyncCounter() as syncs, LaunchCounter() as build:
            slots, valid = draft_view.view_slots(req_to_token, torch.arange(n), lengths,
                                                 torch.full((n,), 256), 256)
        with SyncCounter() as layer_syncs, LaunchCounter() as layer:
            draft_view.attend_view(q, k_buf, v_buf, slots, valid, scale=0.125)
        assert syncs.total == 0 and layer_syncs.total == 0, (syncs.by_kind, layer_syncs.by_kind)
        counts[n] = (build.total, layer.total)
    assert counts[2] == counts[8], counts


def test_reselected_view_is_sinks_selection_and_recent_rows_per_head():
    """Head 0 and 1 keep their own selected positions (below the recent window: nothing
    twice); a request without a selection yet gets the window view (recent = budget -
    sinks); a request within its budget sees everything."""
    selected = torch.tensor([[[10, 5], [7, 12]], [[0, 0], [0, 0]], [[0, 0], [0, 0]]])
    pos, valid = draft_view.reselect_positions(torch.tensor([30, 30, 5]), selected, torch.tensor([2, 0, 0]),
                                               torch.tensor([3, 8, 3]), 8, sinks=2)
    seen = [[sorted(p for p, ok in zip(pos[i, h].tolist(), valid[i, h].tolist()) if ok) for h in range(2)]
            for i in range(3)]
    assert seen[0] == [[0, 1, 5, 10, 27, 28, 29], [0, 1, 7, 12, 27, 28, 29]]
    assert seen[1] == [[0, 1, *range(22, 30)]] * 2  # the window view: 2 sinks + the last 8
    assert seen[2] == [list(range(5))] * 2  # 5 <= 2 sinks + 3 recent: everything


def test_selection_takes_the_rows_the_verify_attends_most():
    """Two KV heads, two query heads each, two verify queries: head 0's queries point at
    candidate rows 3 and 6, head 1's at row 1; the selection returns their positions."""
    d = 4
    k_rows = torch.zeros(8, 2, d)
    k_rows[3, 0, 0] = k_rows[6, 0, 0] = 5.0
    k_rows[1, 1, 1] = 5.0
    q = torch.zeros(2, 4, d)
    q[:, :2, 0] = 1.0  # query heads 0-1: KV head 0
    q[:, 2:, 1] = 1.0  # query heads 2-3: KV head 1
    top = draft_view.select_positions(q, k_rows, first=100, count=2, scale=1.0)
    assert sorted(top[0].tolist()) == [103, 106] and top[1, 0].item() == 101


def test_per_head_view_attention_equals_each_heads_own_rows():
    torch.manual_seed(1)
    k_buf, v_buf = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    slots = torch.tensor([[[1, 2, 3, 0], [4, 5, 6, 7]]])  # one request, head 0 sees 3 rows (last masked)
    valid = torch.tensor([[[True, True, True, False], [True, True, True, True]]])
    q = torch.randn(1, 4, 8)
    out = draft_view.attend_view(q, k_buf, v_buf, slots, valid, scale=0.5)
    for h, rows in ((0, [1, 2, 3]), (1, [4, 5, 6, 7])):
        for qh in (2 * h, 2 * h + 1):
            w = torch.softmax(k_buf[rows, h] @ q[0, qh] * 0.5, dim=0)
            assert torch.allclose(out[0, qh], w @ v_buf[rows, h], atol=1e-5)


@pytest.mark.parametrize("text, tokens, ratio", [("512", 512, None), ("0.125", None, 0.125)])
def test_draft_budget_takes_tokens_or_a_ratio(text, tokens, ratio):
    b = draft_view.DraftBudget.parse(text)
    assert (b.tokens, b.ratio) == (tokens, ratio)
    assert b.rows(4096) == 512


@pytest.mark.parametrize("text", ["0", "4", "1.5", "-3", "abc", "1"])
def test_bad_draft_budget_is_a_cli_error(text, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--speculative-algorithm", "VERICACHE", "--vc-draft-budget", text])
    assert exc.value.code == 2
    assert "--vc-draft-budget" in capsys.readouterr().err


# ----------------------------------------------------------------------------- policy and model


def test_in_pool_model_by_hand():
    """fixed 10 ms, 1 ms a token, 1 us a row; 8 requests of 8,000 tokens, X = 4, budget
    512, A = 4: full = 10/8 + 1 + 8 = 10.25 ms a token; a cycle = 5 * 1.25 + 4 * (1 +
    0.512) + 5 * 1 + 8 = 25.298 ms for 4 tokens: 1.62x."""
    c = RowCosts(fixed=0.010, token=0.001, row=1e-6)
    assert full_kv_token_time(c, 8000, 8) == pytest.approx(0.01025)
    assert in_pool_cycle_time(c, 8000, 8, 4, 512) == pytest.approx(0.025298)
    assert in_pool_speedup(c, 4.0, 8000, 8, 4, 512) == pytest.approx(4 * 0.01025 / 0.025298)


def _curve(drafts: int, accepted: int, n: int = 10) -> AcceptanceCurve:
    curve = AcceptanceCurve()
    for _ in range(n):
        curve.record(drafts, accepted)
    return curve


def _fed(policy: ModePolicy, fixed: float, row: float) -> ModePolicy:
    """Iterations timed by a known cost model (token 1 ms)."""
    for i in range(2 * MIN_ITERATIONS):
        it = IterationRows(tokens=8 + i % 5, rows=2000 * (1 + i % 7), query_rows=2000 * (1 + i % 7) * (1 + i % 4),
                           offload_drafts=0)
        policy.record(fixed + 0.001 * it.tokens + row * it.rows, it)
    full = IterationRows(tokens=8, rows=8 * 8000, query_rows=8 * 8000, offload_drafts=0)  # a full-KV sample at 8
    policy.record(fixed + 0.001 * full.tokens + row * full.rows, full, batch=8, full_only=True)
    return policy


def test_policy_prices_each_request_by_its_own_acceptance():
    """Requests over one document accept very differently (the 16k preset: five at A ~8,
    three at A ~1.7). The mode policy weighs each by its own A(x) once it has verifies
    enough (``DraftLength.curve_for``, what ``_decide_modes`` passes): a pooled curve
    would keep a slow request drafting the fast ones' long X."""
    policy = _fed(ModePolicy(lambda n: 512, 16, None), fixed=0.1, row=9e-6)
    lengths = DraftLength(None, 16, 4)
    for i in range(MIN_VERIFIES + 2):
        lengths.record_verify("window@512", "fast", 12, 12)
        lengths.record_verify("window@512", "slow", 7, i % 2)
    slow, fast = lengths.curve_for("window@512", "slow"), lengths.curve_for("window@512", "fast")
    assert slow is lengths.own["slow"] and slow.acceptance(16) == pytest.approx(1.5)
    pooled = policy.decide(16400, 8, lengths.curves["window@512"])
    own_fast, own_slow = policy.decide(16400, 8, fast), policy.decide(16400, 8, slow)
    assert pooled.mode is own_fast.mode is Mode.IN_POOL and pooled.draft_len == own_fast.draft_len == 16
    assert own_slow.draft_len == 1 or own_slow.mode is Mode.FULL, own_slow
    assert own_slow.predicted_speedup < pooled.predicted_speedup < own_fast.predicted_speedup
    # before a request has verifies enough, the drafter's pooled curve stands in
    assert lengths.curve_for("window@512", "new") is lengths.curves["window@512"]


def test_policy_fits_the_iterations_costs():
    costs = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.005, row=2e-6).costs()
    assert (costs.fixed, costs.token, costs.row) == pytest.approx((0.005, 0.001, 2e-6), rel=1e-6)


def test_policy_drafts_where_rows_dominate_and_decodes_full_kv_where_the_weights_do():
    curve = _curve(4, 4)  # every draft accepted: A(4) = 5
    kv_bound = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.005, row=2e-6)
    d = kv_bound.decide(8000, 8, curve)
    assert d.mode is Mode.IN_POOL and d.predicted_speedup > 1.05 and 1 <= d.draft_len <= 8, d
    weight_bound = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.5, row=1e-9)
    d = weight_bound.decide(8000, 8, curve)
    assert d.mode is Mode.FULL and d.predicted_speedup < 1.05, d
    assert "below" in d.reason
    # a view that rejects everything never pays
    assert kv_bound.decide(8000, 8, _curve(4, 0)).mode is Mode.FULL
    # before any acceptance is measured: explored where every draft accepted would pay,
    # not where even that would not (the weights dominate)
    assert kv_bound.decide(8000, 8, AcceptanceCurve()).mode is Mode.IN_POOL
    d = weight_bound.decide(8000, 8, AcceptanceCurve())
    assert d.mode is Mode.FULL and "no acceptance measured yet" in d.reason, d


def _fed_offload(policy: ModePolicy, fixed: float, row: float, offload_draft: float) -> ModePolicy:
    """Iterations with offload drafters among them, timed by a known cost model."""
    for i in range(2 * MIN_ITERATIONS):
        it = IterationRows(tokens=8 + i % 5, rows=2000 * (1 + i % 7), query_rows=2000 * (1 + i % 7) * (1 + i % 4),
                           offload_drafts=i % 3)
        policy.record(fixed + 0.001 * it.tokens + row * it.rows + offload_draft * it.offload_drafts, it)
    return policy


def test_offload_is_chosen_by_the_same_costs_and_capped_by_eq9():
    """Where the pool binds, a request is offloaded when the batch's tokens/s with it
    offloaded (and a waiting request admitted into its rows) beats keeping it at full KV:
    a heavy fixed cost and a cheap offload draft pay, an offload draft as dear as a
    full-KV step does not. Before any offload is measured one request is offloaded to
    measure it. Eq. 9 caps the offloaded requests by the reload's iterations."""
    from sglang_vc.vericache.perf_model import offload_gain

    curve = _curve(4, 3)
    fresh = ModePolicy(lambda n: 512, 8, None)
    assert "no decode iteration timed" in fresh.offload(4000, 3, 0, 1.0, curve, 0.001).reason
    timed = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.005, row=2e-6)  # full-KV costs, no offload yet
    assert timed.offload(4000, 3, 0, 1.0, curve, 0.001).mode is Mode.OFFLOAD  # one, to measure
    waits = timed.offload(4000, 3, 1, 1.0, curve, 0.001)
    assert waits.mode is Mode.FULL and "not measured" in waits.reason
    assert timed.offload(4000, 3, 0, 0, curve, 0.001).mode is Mode.FULL  # frees nothing usable
    # priced by this machine's draft step (draft_probe) instead: dearer than a full-KV step never pays
    priced = timed.offload(4000, 3, 0, 1.0, curve, 0.001, probe=(0.008, 0.011))
    assert priced.mode is Mode.FULL and "priced by this machine's draft step, x1.38" in priced.reason, priced
    heavy = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.2, row=1e-6)
    assert heavy.offload(4000, 3, 0, 1.0, curve, 0.001, probe=(0.004, 0.0002)).mode is Mode.OFFLOAD
    pays = _fed_offload(ModePolicy(lambda n: 512, 8, None), fixed=0.2, row=1e-6, offload_draft=0.001)
    d = pays.offload(4000, 3, 1, 1.0, curve, 0.001)
    assert d.mode is Mode.OFFLOAD and d.predicted_speedup > 1.05 and "offload draft" in d.reason, d
    costs = pays.costs()
    assert costs.offload_draft == pytest.approx(0.001, rel=1e-6)
    assert d.predicted_speedup == pytest.approx(offload_gain(costs, curve.acceptance(d.draft_len), d.draft_len,
                                                             4000, 3, 1, 1.0))
    dear = _fed_offload(ModePolicy(lambda n: 512, 8, None), fixed=0.001, row=1e-6, offload_draft=0.05)
    d = dear.offload(4000, 3, 1, 1.0, curve, 0.001)
    assert d.mode is Mode.FULL and "below" in d.reason, d
    # a reload of 100 iterations: one offloaded request keeps the link busy
    d = pays.offload(4000, 3, 1, 1.0, curve, 100.0)
    assert d.mode is Mode.FULL and "Eq. 9" in d.reason, d


def test_policy_samples_full_kv_decoding_once_per_batch_size():
    """Until an iteration in which every request of the batch decoded from full KV is in
    the fit, requests at a cycle boundary decode full KV (the fixed cost and the rows' are
    told apart by it); once recorded, they draft; a forced policy never samples; a batch
    size that never gets there is given up after a bounded number of decisions."""
    from sglang_vc.vericache import policy as pol

    curve = _curve(4, 4)
    kv_bound = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.005, row=2e-6)
    d = kv_bound.decide(8000, 6, curve)
    assert d.mode is Mode.FULL and "measuring full-KV" in d.reason, d
    kv_bound.record(0.05, IterationRows(6, 48000, 48000, 0), batch=6, full_only=True)
    assert kv_bound.decide(8000, 6, curve).mode is Mode.IN_POOL
    assert kv_bound.full_samples[6] and kv_bound.costs() is not None
    forced = ModePolicy(lambda n: 512, 8, 4, forced=Mode.IN_POOL)
    assert not forced.needs_full_sample(6)
    tries = [kv_bound.decide(8000, 3, curve).mode for _ in range(pol.SAMPLE_TRIES * 3 + 1)]
    assert tries[:-1] == [Mode.FULL] * (pol.SAMPLE_TRIES * 3) and tries[-1] is Mode.IN_POOL


def test_policy_before_data_forced_and_short_requests():
    policy = ModePolicy(lambda n: 512, 8, 4)
    assert "measuring full-KV" in policy.decide(4096, 8, AcceptanceCurve()).reason  # the first iteration
    policy.record(0.1, IterationRows(8, 8 * 4096, 8 * 4096, 0), batch=8, full_only=True)
    d = policy.decide(16384, 8, AcceptanceCurve())  # no fit yet: never an unpriced draft, however long
    assert d.mode is Mode.FULL and "no cost data yet" in d.reason, d
    fitted = _fed(ModePolicy(lambda n: 512, 8, 4), fixed=0.005, row=2e-6)
    d = fitted.decide(1500, 8, AcceptanceCurve())  # priced: explored at any length the costs allow
    assert d.mode is Mode.IN_POOL and d.draft_len == 4 and "exploring" in d.reason, d
    assert policy.decide(400, 8, _curve(4, 4)).mode is Mode.FULL  # fits the budget: nothing to skip
    forced = ModePolicy(lambda n: 512, 8, 4, forced=Mode.IN_POOL)
    assert forced.decide(1500, 8, AcceptanceCurve()) == forced.decide(1500, 1, AcceptanceCurve())
    assert forced.decide(1500, 8, AcceptanceCurve()).mode is Mode.IN_POOL
    assert ModePolicy(lambda n: 512, 8, 4, forced=Mode.FULL).decide(9000, 8, _curve(4, 4)).mode is Mode.FULL


# ----------------------------------------------------------------------------- served

NEW = 24
BUDGET = 64  # a request of 40 + 24 tokens fits it: it decodes full KV


_SERVERS: dict = {}


@pytest.fixture(scope="module")
def vc_in_pool_servers():
    yield _SERVERS
    for proc in _SERVERS.values():
        proc.stop()
    _SERVERS.clear()


def _vc_in_pool(tmp_path_factory, view: str):
    """The in-pool server of ``view``: one at a time (a server takes ~2.3 GiB of the CI
    machine's 24; the tests of one view run together, so this restarts one at most)."""
    if view not in _SERVERS:
        for other in list(_SERVERS):
            _SERVERS.pop(other).stop()
        _SERVERS[view] = _in_pool_server(tmp_path_factory, view)
    return _SERVERS[view]


def _in_pool_server(tmp_path_factory, view: str):
    """A pool that holds two 600-token requests at full KV: requests with room stay
    resident, later ones are compressed (offload). ``--vc-in-pool always``: a resident
    request longer than the budget drafts in place whatever the cost fit says (the fit's
    choice is the policy's test above; the default server's is the throughput bench's)."""
    folder = tmp_path_factory.mktemp(f"vericache_in_pool_{view}")
    return ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", str(2 * (600 + NEW) + 64), "--enable-metrics",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4",
         "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25", "--vc-in-pool", "always",
         "--vc-draft-budget", str(BUDGET), "--vc-draft-view", view, "--skip-server-warmup",
         "--vc-schedule-trace", str(folder / "trace.jsonl")],
        # (the window view's server counts its host reads per iteration: one server is enough)
        log_path=folder / "server.log", env={"SGLANG_VC_COUNT_SYNCS": "sites"} if view == "window" else None)


def _prompts(tokenizer, lengths) -> list[list[int]]:
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    return [stream[i * 700 : i * 700 + n] for i, n in enumerate(lengths)]


def _identical(server, model_dir, ids_list, outs):
    refs = concurrently(lambda ids: generate(server, ids, NEW), [(i,) for i in ids_list])
    for ids, ref, out in zip(ids_list, refs, outs):
        assert finish_type(out) == finish_type(ref) == "length"
        assert len(out["output_ids"]) == len(ref["output_ids"]) == NEW
        if out["output_ids"] != ref["output_ids"]:
            result = compare(greedy_reference(model_dir, ids, NEW), out["output_ids"], finish_type(out))
            assert result.identical, (len(ids), result)


def _counters(proc) -> dict:
    return requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"].get("vericache", {})


@pytest.mark.parametrize("view, order", [  # re-selecting first: the window's server then serves on
    ("reselect", "long-first"),
    ("shared", "long-first"),
    ("window", "long-first"),
    # the same batch in the other order: a second way to check it (slow; 70 s)
    pytest.param("window", "short-first", marks=pytest.mark.slow)])
def test_in_pool_full_and_offload_requests_in_one_batch_are_identical(server, model_dir, tokenizer, tmp_path_factory,
                                                                      vc_in_pool_servers, view, order):
    """A 600-token request alone has room: it drafts in place (its reply says in-pool and
    why). While it decodes, two more 600-token requests arrive: the pool cannot hold them
    at full KV, so the policy offloads one (to measure an offload: it drafts from the
    compressed KV) and keeps the other at full KV (in place), and a 40-token one decodes
    from full KV (it fits the draft budget). Every output equals the plain
    server's, token for token, and drafts were rejected somewhere. With a re-selected
    view (per head, or shared by all heads and layers), its verifies re-selected it; the
    window and shared views were read from view rows of ``req_to_token``."""
    vc_in_pool = _vc_in_pool(tmp_path_factory, view)
    first, *rest = _prompts(tokenizer, (600, 600, 600, 40))
    rest = rest if order == "long-first" else rest[::-1]
    before = _counters(vc_in_pool)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", generate(vc_in_pool, first, NEW)))
    t.start()
    deadline = time.time() + 120
    # until the policy has timed enough iterations to weigh an offload (before that the pool
    # binding keeps newcomers at full KV): then it offloads one to measure it
    while _counters(vc_in_pool).get("mode_iterations_in_pool", 0) < before.get("mode_iterations_in_pool", 0) + \
            MIN_ITERATIONS:
        assert time.time() < deadline and t.is_alive(), "the lone request never drafted in place"
        time.sleep(0.05)
    # one batch request: the three reach the scheduler together, so the pool's room is
    # judged with the others waiting (two HTTP requests could reach it one batch apart,
    # and the first of them then kept its full KV: a race, seen under two test workers)
    outs = generate(vc_in_pool, rest, NEW)
    t.join()
    outs = [box["out"], *outs]
    after = _counters(vc_in_pool)
    _identical(server, model_dir, [first, *rest], outs)
    infos = [(o["meta_info"].get(META) or [{}])[-1] for o in outs]
    assert infos[0]["mode"] == "in-pool" and infos[0]["mode_reason"] == "--vc-in-pool always", infos[0]
    modes = {i.get("mode") for i in infos}
    assert {"in-pool", "offload"} <= modes, infos
    short = infos[[len(ids) for ids in [first, *rest]].index(40)]
    assert short.get("mode") in ("full", "offload") and short.get("mode") != "in-pool", short
    in_pool = [i for i in infos if i.get("mode") == "in-pool"]
    drafted, accepted = sum(i["drafted"] for i in in_pool), sum(i["accepted"] for i in in_pool)
    assert 0 < accepted < drafted, in_pool  # in-pool drafts accepted and rejected
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew["mode_iterations_in_pool"] > 0 and grew["mode_iterations_offload"] > 0, grew
    assert grew["in_pool_draft_rows"] > 0, grew
    assert (grew.get("in_pool_reselections", 0) > 0) is (view != "window"), grew
    assert (grew.get("in_pool_view_rows", 0) > 0) is (view != "reselect"), grew  # SGLang's backend read the view
    # the in-pool iterations ran under SGLang's overlap loop, launched with nothing read
    # back at the project's code and settled with one read of their copy; the offloaded
    # request's ran synchronously (:mod:`sglang_vc.vericache.deferred`)
    assert grew.get("overlapped_draft_iterations", 0) > 0 and grew.get("overlap_synced", 0) > 0, grew
    if view == "window":
        _launched_without_device_reads(vc_in_pool.log_path.parent / "trace.jsonl")


def _launched_without_device_reads(trace) -> None:
    """The trace's overlapped drafting iterations read no device value at launch (the
    counter's reads there are of host copies: SGLang's resolved lengths, the rows) and
    read their result once when they settle (the host copy's ``tolist``; the second read
    is of that copy's lengths)."""
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    deferred = [r["phases"] for r in records if r.get("phases", {}).get("deferred")]
    assert deferred, [r.get("phases") for r in records[-5:]]
    project = ("sglang_vc/", "vericache/", "kvruntime/", "specache/")
    reads = [site for p in deferred for site in p["launch_host_sync_sites"]
             if site.split()[0] in ("to", "item", "cpu", "numpy", "h2d") and site.split()[1].startswith(project)]
    assert not reads, reads
    assert {p["settle_host_syncs"] for p in deferred} == {2}, [p["settle_host_sync_sites"] for p in deferred[:3]]


def test_in_pool_requests_apply_penalties_grammars_and_logprobs(server, tokenizer, tmp_path_factory,
                                                               vc_in_pool_servers):
    """The request features of an in-pool drafter (one request at a time: the pool has
    room, so it drafts over its window view): frequency and presence penalties give the
    plain server's tokens; a regex-constrained request with logprobs gives its tokens,
    a matching text, and logprobs within 2e-3; drafts were rejected somewhere."""
    import re

    vc_in_pool = _vc_in_pool(tmp_path_factory, "window")
    penalised, constrained = _prompts(tokenizer, (600, 600, 600))[1:]
    pattern = r"[A-Z][a-z]+( [a-z]+)+"
    cases = [(penalised, {"sampling_params": {"frequency_penalty": 0.5, "presence_penalty": 0.3}}),
             (constrained, {"sampling_params": {"regex": pattern}, "return_logprob": True, "top_logprobs_num": 2})]
    infos = []
    for ids, extra in cases:
        outs = []
        for srv in (vc_in_pool, server):
            body = {"input_ids": ids, **extra, "sampling_params": {
                "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True, **extra["sampling_params"]}}
            r = requests.post(srv.url + "/generate", json=body, timeout=900)
            assert r.status_code == 200, r.text
            outs.append(r.json())
        got, want = outs
        assert got["output_ids"] == want["output_ids"] and finish_type(got) == finish_type(want), extra
        info = got["meta_info"][META][-1]
        assert info["mode"] == "in-pool" and info["verify_rounds"] > 0, info
        infos.append(info)
        if "return_logprob" in extra:
            assert re.fullmatch(pattern, got["text"]), got["text"]
            lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
            assert lp == pytest.approx([t[0] for t in want["meta_info"]["output_token_logprobs"]], abs=2e-3)
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos


def test_a_request_at_the_end_of_the_context_stays_inside_its_row(server, model_dir, tokenizer, tmp_path):
    """A decode round reserves 2X slots past the committed length (X = 32 when chosen from
    data): a request whose prompt and new tokens end at the context length must not write
    past its ``req_to_token`` row (it crashed the scheduler: SGLang's headroom was X + 4)."""
    ids = _prompts(tokenizer, (490,))[0]  # 490 + 2 * 32 > 512 + 4 + 32: past the old row
    with ServerProcess(["--dtype", "float32", "--context-length", "512", "--max-total-tokens", "4000",
                        "--speculative-algorithm", "VERICACHE", "--vc-in-pool", "always", "--vc-draft-budget", "64",
                        "--skip-server-warmup"], log_path=tmp_path / "server.log") as proc:
        out = generate(proc, ids, 12)
        assert requests.get(proc.url + "/health", timeout=30).status_code == 200
    assert len(out["output_ids"]) == 12 and finish_type(out) == "length"
    ref = generate(server, ids, 12)
    assert out["output_ids"] == ref["output_ids"] or compare(greedy_reference(model_dir, ids, 12), out["output_ids"],
                                                             finish_type(out)).identical
    assert (out["meta_info"].get(META) or [{}])[-1].get("drafted", 0) > 0


def test_in_pool_never_decodes_resident_requests_from_full_kv(server, model_dir, tokenizer, tmp_path_factory):
    """``--vc-in-pool never`` (the behaviour before in-pool drafting): a long request with
    room drafts nothing. ``always`` drafts for it. Both are the plain server's output."""
    ids = _prompts(tokenizer, (600,))
    for setting, drafts in (("never", False), ("always", True)):
        folder = tmp_path_factory.mktemp(f"in_pool_{setting}")
        with ServerProcess(["--dtype", "float32", "--max-total-tokens", "4000", "--speculative-algorithm",
                            "VERICACHE", "--speculative-num-draft-tokens", "4", "--vc-in-pool", setting,
                            "--vc-draft-budget", "512", "--skip-server-warmup"],
                           log_path=folder / "server.log") as proc:
            out = generate(proc, ids[0], NEW)
            counters = _counters(proc)
        _identical(server, model_dir, ids, [out])
        info = (out["meta_info"].get(META) or [{}])[-1]
        assert (counters.get("drafted", 0) > 0) is drafts, counters
        assert info["mode"] == ("in-pool" if drafts else "full"), info


def test_drafting_never_makes_sglang_retract_where_the_plain_server_does_not(model_dir, tokenizer, tmp_path):
    """A pool that holds four 600-token requests and their 32 new tokens with 16 slots to
    spare: the plain server retracts nothing, and neither does VERICACHE drafting in place
    at X = 8, whose drafts take one slot an iteration (as decoding does) and never run past
    a request's last token (:mod:`sglang_vc.vericache.decode_slots`). SGLang's uniform
    speculative reserve (2X slots past each committed length) made it retract one here.
    Output identical to the plain server's, drafts rejected somewhere."""
    n, new = 4, 32
    prompts = _prompts(tokenizer, (600,) * n)
    pool = ["--dtype", "float32", "--max-total-tokens", str(n * (600 + new) + 16), "--max-running-requests", str(n),
            "--skip-server-warmup"]
    runs = {}
    for name, flags in (("vericache", ["--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "8",
                                       "--vc-in-pool", "always", "--vc-draft-budget", str(BUDGET)]), ("plain", [])):
        log = tmp_path / f"{name}.log"
        with ServerProcess([*pool, *flags], log_path=log) as proc:
            outs = concurrently(lambda ids: generate(proc, ids, new), [(p,) for p in prompts])
        retracted = [o["meta_info"].get("num_retractions") for o in outs]
        assert retracted == [0] * n and "Retract requests" not in log.read_text(), (name, retracted)
        runs[name] = outs
    for ids, out, ref in zip(prompts, runs["vericache"], runs["plain"]):
        assert finish_type(out) == finish_type(ref) == "length" and len(out["output_ids"]) == new
        if out["output_ids"] != ref["output_ids"]:
            result = compare(greedy_reference(model_dir, ids, new), out["output_ids"], finish_type(out))
            assert result.identical, result
    infos = [(o["meta_info"].get(META) or [{}])[-1] for o in runs["vericache"]]
    assert all(i.get("mode") == "in-pool" for i in infos), infos
    assert 0 < sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos


def test_the_mode_policy_refits_every_refit_iterations_and_at_a_new_batch_sizes_sample(monkeypatch):
    """``ModePolicy.costs`` solves its least squares once per ``REFIT_EVERY`` iterations
    (not at every request's cycle boundary), and at once when a batch size's first
    full-KV sample arrives (the fit needs it to tell the fixed cost from the rows')."""
    from sglang_vc.vericache import policy as pol
    from sglang_vc.vericache.draft_length import REFIT_EVERY

    fits = []
    real = pol.nonnegative_fit
    monkeypatch.setattr(pol, "nonnegative_fit", lambda *a: fits.append(1) or real(*a))
    policy = _fed(ModePolicy(lambda n: 512, 8, None), fixed=0.005, row=2e-6)
    assert policy.costs() is not None and len(fits) == 1
    for i in range(REFIT_EVERY - 1):
        policy.record(0.005 + 0.001 * 8 + 2e-6 * 4000, IterationRows(8, 4000, 4000, 0))
        policy.costs()
    assert len(fits) == 1
    policy.record(0.01, IterationRows(8, 4000, 4000, 0))
    policy.costs()
    assert len(fits) == 2
    policy.record(0.05, IterationRows(6, 48000, 48000, 0), batch=6, full_only=True)  # a new batch size
    policy.costs()
    assert len(fits) == 3
    policy.record(0.05, IterationRows(6, 48000, 48000, 0), batch=6, full_only=True)  # not new
    policy.costs()
    assert len(fits) == 3
