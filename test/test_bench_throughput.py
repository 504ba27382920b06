"""The throughput benchmark's own logic, without servers: schedules per VERICACHE
configuration, the trace summary and its cost fit, appendix B.1's GPU prediction, and
bad arguments refused with a message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_vc.bench import throughput as tp
from sglang_vc.bench import throughput_model as tm


def test_each_vericache_config_runs_under_each_schedule():
    cfgs = tp.with_schedules([tp.parse_config("full"), tp.parse_config("vericache:snapkv@0.25:4")],
                             ["lockstep", "staggered"])
    assert [c["name"] for c in cfgs] == ["full", "vericache:snapkv@0.25:4 [lockstep]",
                                         "vericache:snapkv@0.25:4 [staggered]"]
    assert cfgs[0]["schedule"] is None
    assert cfgs[2]["flags"][-2:] == ["--vc-schedule", "staggered"]


def test_trace_summary_costs_per_drafting_request_and_per_verified_token():
    """One forward per iteration whose time is built from known costs (20 ms fixed, 3 ms
    per drafting request, 5 ms per verified token): the fit gives them back."""
    records = []
    for it in range(20):
        drafting, verifies, drafts = 2 + it % 5, it % 3, 2 + it % 4
        reqs = [{"role": "draft", "verified_drafts": None}] * drafting + \
               [{"role": "verify", "verified_drafts": drafts}] * verifies
        phases = {"forward_s": 0.02 + 0.003 * drafting + 0.005 * verifies * (drafts + 1)}
        records.append({"iteration": it, "seconds": 0.01 + sum(phases.values()), "phases": phases,
                        "requests": reqs})
    out = tp.trace_summary(records)
    assert out["cost"]["fixed_s"] == pytest.approx(0.02)
    assert out["cost"]["draft_s_per_request"] == pytest.approx(0.003)
    assert out["cost"]["verify_s_per_token"] == pytest.approx(0.005)
    assert out["cost"]["fit_iterations"] == 20
    assert out["max_verifies_per_iteration"] == 2 and len(out["verifies_per_iteration"]) == 20
    assert out["mean_verifies_per_iteration"] == pytest.approx(sum(it % 3 for it in range(20)) / 20)


def test_gpu_prediction_uses_the_measured_acceptance_length():
    rows = [{"config": "full", "kind": "full"},
            {"config": "v", "kind": "vericache", "draft_tokens": 4, "kept": 0.25, "mean_acceptance_length": 3.0},
            {"config": "w", "kind": "vericache", "draft_tokens": 4, "kept": 0.25, "mean_acceptance_length": 1.5}]
    pred = tm.gpu_prediction(rows, "h100")
    assert "not a measurement" in pred["label"]
    assert pred["configs"]["v"]["tokens_per_s"] > pred["configs"]["w"]["tokens_per_s"] > 0
    assert pred["full"]["batch_size"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "sideways"], "--schedule"),
    (["--from-json", "/nonexistent.json"], "--from-json needs --predict-gpu"),
    (["--from-json", "/nonexistent.json", "--predict-gpu", "h100"], "not a throughput report"),
])
def test_bad_arguments_are_refused(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, "-m", "sglang_vc.bench.throughput", "--json",
                           str(tmp_path / "out.json"), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_predict_gpu_from_an_earlier_report(tmp_path):
    report = {"results": [{"config": "v", "kind": "vericache", "draft_tokens": 4, "kept": 0.25,
                           "mean_acceptance_length": 2.5}]}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "-m", "sglang_vc.bench.throughput", "--json", str(tmp_path / "gpu.json"),
                           "--from-json", str(src), "--predict-gpu", "h100"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert out["gpu_prediction"]["configs"]["v"]["accept_len"] == 2.5
    assert "PREDICTION" in proc.stderr


def test_specache_config_flags():
    cfg = tp.parse_config("specache:1bit:k16")
    assert cfg["kind"] == "specache" and cfg["compressor"] == "kivi1"
    assert cfg["flags"] == ["--speculative-algorithm", "SPECACHE", "--specache-kv-bits", "1", "--specache-topk", "16"]
    assert tp.parse_config("specache")["flags"][-1] == "2"
    for bad in ("specache:3", "specache:1bit:16"):
        with pytest.raises(ValueError, match="specache"):
            tp.parse_config(bad)


def test_decode_phase_is_the_span_outside_every_prefill_window():
    """Three requests: prefills [0, 2] and [1, 3] overlap (batched), [6, 7] comes later;
    the last reply at 10. Prefill time is the union (4 s), decode time the rest of the
    span from the first forward (6 s), decoded tokens all but each request's first."""
    from sglang_vc.bench import phases

    times = [phases.RequestTimes(0.0, 2.0, 5.0, 11), phases.RequestTimes(1.0, 3.0, 9.0, 21),
             phases.RequestTimes(6.0, 7.0, 10.0, 31)]
    split = phases.split(times)
    assert split.prefill_s == pytest.approx(4.0) and split.decode_s == pytest.approx(6.0)
    assert split.decode_tokens == 60 and split.decode_tokens_per_s == pytest.approx(10.0)
    assert phases.split([times[0], None]) is None  # a request without its window: no figure
    meta = {"forward_entry_time": 100.0, "prefill_finished_time": 100.5, "completion_tokens": 8}
    assert phases.RequestTimes.of(meta, 104.0) == phases.RequestTimes(100.0, 100.5, 104.0, 8)
    assert phases.RequestTimes.of({"completion_tokens": 8}, 104.0) is None


def test_in_pool_config_flags_and_the_fits_regime():
    cfg = tp.parse_config("inpool:reselect@256:6")
    assert cfg["kind"] == "vericache" and cfg["budget"] == 256 and cfg["draft_tokens"] == 6
    assert cfg["flags"] == ["--speculative-algorithm", "VERICACHE", "--vc-in-pool", "always", "--vc-draft-budget",
                            "256", "--vc-draft-view", "reselect", "--speculative-num-draft-tokens", "6"]
    assert tp.parse_config("vericache")["flags"] == ["--speculative-algorithm", "VERICACHE"]
    assert tp.parse_config("vericache:always")["flags"] == ["--speculative-algorithm", "VERICACHE",
                                                            "--vc-compress-when", "always"]
    assert tp.parse_config("vericache:uniform")["flags"] == ["--speculative-algorithm", "VERICACHE",
                                                             "--vc-in-pool-verify", "uniform"]
    for bad in ("inpool:window", "inpool:sparse@512", "inpool:window@x", "inpool:window@512:y"):
        with pytest.raises(ValueError, match="inpool"):
            tp.parse_config(bad)


def test_in_pool_prediction_refits_the_policy_costs_from_the_trace():
    """Iterations timed by fixed 50 ms + 2 ms a token + 10 us a row: the trace's fit finds
    those costs, and the prediction is perf_model's in-pool speedup at them."""
    from sglang_vc.vericache.perf_model import RowCosts, in_pool_speedup

    timed = [{"forward_s": 0.05 + 0.002 * t + 1e-5 * r + 1e-6 * qr, "regressors": [t, r, qr, 0]}
             for t, r, qr in [(8, 5000 + 900 * i, 7000 + 500 * i * i) if i % 2 else (12 + i % 3, 9000 + 700 * i, 30000 - i)
                              for i in range(12)]]
    costs = tp._row_costs(timed)
    assert (costs["fixed"], costs["token"], costs["row"], costs["query_row"]) == pytest.approx(
        (0.05, 0.002, 1e-5, 1e-6), rel=1e-5)
    # the in-pool run's own iterations, and (from another traced row) full-KV ones
    fit_rows = [[t["forward_s"], *t["regressors"], False] for t in timed]
    full = [[0.05 + 0.002 * 8 + 1e-5 * r + 1e-6 * r, 8, r, r, 0, True] for r in (32000, 33000)]
    row = {"config": "c", "trace": {"fit_rows": fit_rows[:6]}, "mode_iterations": {"in-pool": 40},
           "mean_acceptance_length": 3.0, "requests": 8, "draft_tokens": 4}
    other = {"config": "d", "trace": {"fit_rows": fit_rows[6:] + full}, "mode_iterations": {}}
    pred = tp.in_pool_predictions([row, other], {"c": {"budget": 256}}, ctx_tokens=4224, prompt_tokens=4096)
    assert pred["c"]["costs"]["full_kv_iterations"] == 2 and pred["c"]["costs"]["fit_iterations"] == 8
    assert pred["c"]["ratio_to_full"] == pytest.approx(in_pool_speedup(RowCosts(0.05, 0.002, 1e-5, 1e-6), 3.0, 4160, 8, 4, 256),
                                                       rel=1e-4)


def test_in_pool_prediction_takes_the_steady_windows_acceptance():
    """The decode figure is the steady window's, so the model is fed the A and X of the
    verifies inside it, not the run's mean (the 16k preset: A 5.75 in the window, 3.40 over
    the run, where the slow requests verify most in the tail)."""
    from sglang_vc.bench import decode_window

    def rec(wall, *reqs):
        return {"wall": wall, "requests": [{"role": r, "committed": c, "draft_len": x} for r, c, x in reqs]}

    records = [rec(1.0, ("verify", 2, 9)), rec(2.0, ("verify", 8, 7), ("draft", 0, 7)),
               rec(3.0, ("verify", 4, 5), ("full", 1, None)), rec(9.0, ("verify", 1, 13))]
    got = decode_window.iterations_in(records, decode_window.Window(1.5, 3.0, 13, 2))
    assert got == {"iterations": 2, "mean_batch": 2.0, "verifies": 2, "acceptance": 6.0, "draft_len": 6}
    timed = [[0.05 + 0.002 * t + 1e-5 * r, t, r, r, 0, t == 8] for t, r in
             [(8, 30000), (8, 31000), (20, 9000), (24, 9500), (16, 12000), (28, 8000), (8, 33000), (18, 10000)]]
    row = {"config": "c", "trace": {"fit_rows": timed}, "mode_iterations": {"in-pool": 40},
           "mean_acceptance_length": 3.0, "requests": 8, "draft_tokens": 4, "steady_window": got}
    pred = tp.in_pool_predictions([row], {"c": {"budget": 256, "draft_tokens": None}}, ctx_tokens=4224,
                                  prompt_tokens=4096)["c"]
    assert (pred["acceptance"], pred["draft_len"], pred["acceptance_from"]) == (6.0, 6, "steady window")
    del row["steady_window"]
    pred = tp.in_pool_predictions([row], {"c": {"budget": 256, "draft_tokens": None}}, ctx_tokens=4224,
                                  prompt_tokens=4096)["c"]
    assert (pred["acceptance"], pred["draft_len"], pred["acceptance_from"]) == (3.0, 4, "run")
