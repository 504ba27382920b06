"""``bench.gpu_step`` on this CPU: the GPU figures' shapes, not their speed.

The step benchmark runs on a lent GPU machine without SGLang, where a shape error would
waste device time; here the same code runs on CPU tensors (the kernels' torch paths) at a
small size, and its command line refuses a machine without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vc.bench import gpu_step


def test_measure_covers_every_cost_of_the_model():
    rows = gpu_step.measure(n=256, batch=2, x=4, keep=0.25, topk=16, repeats=1, dev="cpu")
    want = {"weights_decode", "weights_verify", "full_decode_sdpa", "full_decode_paged", "draft_snapkv",
            "verify_paged", "verify_sdpa", "verify_flash", "draft_kivi2", "draft_specache",
            "draft_specache_device_only", "specache_scores_only", "specache_topk_only", "draft_in_pool",
            "in_pool_view_build", "draft_specache_worker", "draft_kivi2_worker", "draft_kivi2_batched",
            "draft_specache_batched"}
    assert want <= set(rows)
    assert all(math.isfinite(r["us"]) and r["us"] > 0 for r in rows.values())
    assert rows["weights_verify"]["tokens"] == 2 * 5 and rows["draft_snapkv"]["kept"] == 64
    # the full KV of the batch: 2 requests x 8 KV heads x 256 rows x 128 dims, K and V, float32 here
    assert rows["full_decode_sdpa"]["bytes"] == 2 * 2 * 8 * 256 * 128 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_step.main(["--json", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda(tmp_path, capsys):
    from sglang_vc.bench import gpu_check

    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def _report(tmp_path):
    """A gpu_step report of CPU-measured costs (shapes only; the figures mean nothing; float32
    weights here: 28 GB for 32 layers)."""
    rows = gpu_step.measure(n=256, batch=2, x=4, keep=0.25, topk=16, repeats=1, dev="cpu")
    rows["reload_h2d"] = {"us": 50.0, "bytes": 2 * 256 * 8 * 128 * 2, "gb_s": 55.0}
    report = {"device": "cpu", "settings": {"batch": 2, "tokens": 256, "keep": 0.25, "draft_len": 4},
              "model": {"kv_heads": 8, "head_dim": 128, "layers": 32}, "per_layer": rows,
              "gpu_mem_bytes": 80e9}
    path = tmp_path / "step.json"
    path.write_text(__import__("json").dumps(report))
    return report, path


def test_gpu_predict_uses_b1_at_the_measured_bandwidths(tmp_path):
    from sglang_vc.bench import gpu_predict
    from sglang_vc.vericache import perf_model as pm

    report, _ = _report(tmp_path)
    out = gpu_predict.predict([report], {"specache": {30: 20.0}, "snapkv": {8: 3.0}}, 80e9)
    rows = report["per_layer"]
    kv_full = 2 * 256 * 8 * 128 * 2 * 32
    for p in out["predictions"]:
        best = pm.best_feasible(weights_bytes=rows["weights_decode"]["bytes"] * 32, kv_full_bytes=kv_full,
                                compression=p["compression"], acceptance={p["draft_len"]: p["accept_len"]},
                                hbm_bw=rows["full_decode_sdpa"]["gb_s"] * 1e9, interconnect_bw=55e9,
                                gpu_mem_bytes=80e9, reload_fraction=None if p["drafter"] == "snapkv" else 1.0)
        assert p["b1_tokens_per_s"] == best.tokens_per_s and p["batch_size"] == best.batch_size
        # no drafting share where the optimum keeps every request at full KV on the device
        assert p["measured_tokens_per_s"] > 0 and 0 <= p["draft_share"] < 1
        assert (p["draft_share"] > 0) == (p["offloaded"] > 0)
    assert out["predictions"][1]["compression"] == 0.25 and "PREDICTION" in out["label"]


def test_gpu_predict_chooses_x_from_the_curve_and_prices_the_verify_by_x(tmp_path):
    from sglang_vc.bench import gpu_predict

    report, _ = _report(tmp_path)
    longer = __import__("copy").deepcopy(report)
    longer["settings"]["draft_len"] = 30
    longer["per_layer"]["verify_flash"] = {"us": 10 * report["per_layer"]["verify_flash"]["us"]}
    out = gpu_predict.predict([report, longer], {"specache": {4: 3.0, 16: 14.0, 30: 16.0}}, 80e9)
    v4, v30 = (report["per_layer"]["verify_flash"]["us"] / 2, longer["per_layer"]["verify_flash"]["us"] / 2)
    vu = out["verify_us_per_request"]
    assert vu[4] == v4 and vu[30] == v30 and vu[16] == pytest.approx(v4 + (v30 - v4) * 12 / 26)
    pts = {p["draft_len"]: p for p in out["predictions"]}
    assert out["chosen"]["specache"]["measured_costs"] == max(pts, key=lambda x: pts[x]["measured_ratio_to_full"])
    # B.1 alone at nominal figures for the two settings, at the curve's best X
    paper = out["nominal_b1"]["paper_mistral24b_rtx6000"]["specache"]
    assert paper["full_kv_batch"] == 11 and paper["draft_len"] in (16, 30) and paper["ratio_to_full"] > 1


def test_gpu_predict_prices_the_servers_batched_drafter_calls(tmp_path):
    """The server's worker drafts a batch in one call on CUDA: the prediction prices that
    row (``_batched``), and a report without it (older) the per-request one."""
    from sglang_vc.bench import gpu_predict

    report, _ = _report(tmp_path)
    step = report["per_layer"]
    step["draft_kivi2_batched"]["us"], step["draft_kivi2"]["us"] = 1.0, 1e6
    fast = gpu_predict.predict([report], {"kivi2": {8: 4.0}}, 80e9)["predictions"][0]
    del step["draft_kivi2_batched"]
    slow = gpu_predict.predict([report], {"kivi2": {8: 4.0}}, 80e9)["predictions"][0]
    assert gpu_predict.draft_row(report["per_layer"], "kivi2") == "draft_kivi2"
    assert fast["measured_tokens_per_s"] > slow["measured_tokens_per_s"]


@pytest.mark.parametrize("bad", ["specache=30", "specache=30:40", "nosuch=30:5", "specache=x:5"])
def test_gpu_predict_refuses_bad_acceptance(tmp_path, capsys, bad):
    from sglang_vc.bench import gpu_predict

    _, path = _report(tmp_path)
    with pytest.raises(SystemExit) as e:
        gpu_predict.main(["--gpu-step", str(path), "--acceptance", bad, "--json", str(tmp_path / "o.json")])
    assert e.value.code == 2 and "--acceptance" in capsys.readouterr().err
