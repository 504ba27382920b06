"""``bench.view_step`` on this CPU: the GPU check's shapes and that its draft step reads
the views the server's ``ViewRows`` wrote, not its speed (the lent GPU machine has no
SGLang, and a shape error there wastes device time)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vc.bench import view_step


def test_the_draft_step_reads_the_view_rows_and_both_steps_run():
    r = view_step.measure(n=96, batch=3, budget=16, layers=1, dev="cpu")
    assert r["ok"] and r["view_rows"] == 3 * 16  # every request's view: sinks and window, 16 rows
    for name in ("full", "draft", "full_metadata", "draft_metadata"):
        assert math.isfinite(r[name]["us"]) and r[name]["us"] > 0
    assert math.isfinite(r["draft_with_metadata_to_full"])


def test_the_views_are_sinks_and_the_recent_window_and_the_draft_attends_over_them_only():
    from sglang_vc.vericache.draft_view import SINKS

    gen = torch.Generator().manual_seed(0)
    steps, metadata, views, (kv, q) = view_step._steps(96, 3, 16, 1, "cpu", torch.float32, gen)
    view = metadata["draft"]().indices.view(3, 16)
    full = metadata["full"]().indices.view(3, 96)
    for b in range(3):
        assert torch.equal(view[b], torch.cat([full[b, :SINKS], full[b, 96 - (16 - SINKS):]]))
    k_buf, v_buf = kv[0]

    def attention(slots):  # each request's one query over its rows, GQA
        k, v = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)  # [HKV, rows, D]
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k[None], v[None], enable_gqa=True,
                                                                scale=view_step.D ** -0.5)[:, :, 0]

    for name, rows in (("draft", view), ("full", full)):
        got = steps[name]()
        want = torch.stack([attention(rows[b])[b] for b in range(3)])
        assert torch.allclose(got, want, atol=1e-4), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        view_step.main(["--json", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
