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
            "verify_paged", "verify_sdpa", "draft_kivi2", "draft_specache", "draft_specache_device_only"}
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
