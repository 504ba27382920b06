"""The compressed-KV runtime compiles sgl-kernel-ext's Triton kernels when it starts (at
SGLang's warm-up forward) for the pool's dtype and the rank's head shapes, and logs the
time; on the CPU nothing compiles. On the stand-in CUDA platform the kernels run in
Triton's interpreter: the launches the warm-up makes are the kernels a GPU would compile."""

from __future__ import annotations

import logging
import types

import torch

from sgl_kernel_ext import aot, dispatch

from sglang_vc import stats
from sglang_vc.kvruntime.runtime import KVRuntime
from sglang_vc.kvruntime.warmup import warm_up_kernels


def _pool_keys(dtype=torch.bfloat16, slots=64, kv_heads=2, head_dim=64) -> torch.Tensor:
    return torch.zeros(slots, kv_heads, head_dim, dtype=dtype)


# every public wrapper's launch (the helpers they call compile inside them)
WRAPPERS = {"build_kv_indices", "paged_attention", "paged_attention_reduce", "kivi_attention", "specache_scores",
            "copy_rows", "scatter_head_rows", "gather_head_rows", "position_mask", "kivi_attention_batch",
            "payload_scores_batch", "specache_fetch_rows", "specache_rows_attention", "merge_state"}


def test_warm_up_compiles_every_kernel_for_the_pool_shapes(stand_in_cuda, caplog):
    before = stats.snapshot().get("kvruntime", {}).get("kernel_warmup_ms", 0.0)
    with caplog.at_level(logging.INFO, logger="sglang_vc.kvruntime.warmup"), dispatch.recording() as recorded:
        seconds = warm_up_kernels(_pool_keys(kv_heads=2, head_dim=64), num_q_heads=64)
    assert seconds is not None and seconds > 0
    specs = aot.unique(recorded)
    assert {s.name for s in specs} == WRAPPERS
    # in the pool's dtype and head dim, and the GQA group of 64 query heads over 2 KV heads
    attn = [s for s in specs if s.name in ("paged_attention", "kivi_attention", "specache_rows_attention")]
    assert attn and all(s.signature["q"] == "*bf16" and s.constexprs["D"] == 64 for s in attn)
    assert all(s.constexprs["BLOCK_G"] == 32 for s in attn)
    assert {s.constexprs["BITS"] for s in specs if s.name == "kivi_attention"} == {1, 2}
    assert stats.snapshot()["kvruntime"]["kernel_warmup_ms"] > before
    assert any("compiled sgl-kernel-ext's Triton kernels for bfloat16, 64 query and 2 KV heads of dim 64" in r.message
               for r in caplog.records), caplog.text


def test_the_cpu_path_compiles_nothing(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    with dispatch.recording() as recorded:
        assert warm_up_kernels(_pool_keys(), num_q_heads=6) is None
    assert not recorded
    # forced onto Triton's interpreter on the CPU (the serving tests' path): still nothing
    # to compile, and a server start pays no interpreted warm-up
    monkeypatch.setenv(dispatch.ENV, "triton")
    with dispatch.recording() as recorded:
        assert warm_up_kernels(_pool_keys(), num_q_heads=6) is None
    assert not recorded


def _model_runner(kv_heads: int, q_heads: int, tp: int = 1):
    keys = [_pool_keys(kv_heads=kv_heads) for _ in range(2)]
    pool = types.SimpleNamespace(start_layer=0, layer_num=2, get_key_buffer=lambda i: keys[i],
                                 get_value_buffer=lambda i: keys[i])
    return types.SimpleNamespace(
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(4, 32, dtype=torch.int32)),
        token_to_kv_pool=pool, token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1),
        server_args=types.SimpleNamespace(tp_size=tp), model_config=types.SimpleNamespace(num_attention_heads=q_heads))


def test_the_runtime_warms_up_at_its_start_with_the_ranks_heads(stand_in_cuda):
    with dispatch.recording() as recorded:
        runtime = KVRuntime(_model_runner(kv_heads=1, q_heads=64, tp=2))
    assert runtime.kernel_warmup_s is not None
    specs = aot.unique(recorded)
    assert {s.name for s in specs} == WRAPPERS
    # 64 query heads over 2 ranks: a group of 32 over this rank's one KV head
    attn = [s for s in specs if s.name == "paged_attention"]
    assert attn and all(s.constexprs["BLOCK_G"] == 32 for s in attn)


def test_the_cpu_runtime_starts_without_a_warm_up():
    assert KVRuntime(_model_runner(kv_heads=2, q_heads=6)).kernel_warmup_s is None


def test_a_warm_up_that_fails_warns_and_the_runtime_still_starts(stand_in_cuda, monkeypatch, caplog):
    from sgl_kernel_ext import warmup

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly aborted")

    monkeypatch.setattr(warmup, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="sglang_vc.kvruntime.warmup"):
        runtime = KVRuntime(_model_runner(kv_heads=2, q_heads=6))
    assert runtime.kernel_warmup_s is None
    assert "Triton warm-up failed (RuntimeError: PTX assembly aborted)" in caplog.text
