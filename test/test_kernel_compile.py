"""Every ``@triton.jit`` kernel of sgl-kernel-ext compiles for CUDA ``sm_80`` and ``sm_90``,
with no GPU: each public wrapper is called as the mechanisms call it, in bfloat16, float16
and float32, through Triton's interpreter (``SGL_KERNEL_EXT_BACKEND=triton``); its launches
are recorded and compiled to cubins by ``triton.compile`` with a ``GPUTarget``
(:mod:`sgl_kernel_ext.aot`). The interpreter never checks types; the compiler does, as a
GPU would at the first launch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import sgl_kernel_ext as ext
from sgl_kernel_ext import aot, dispatch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (dtype, head_dim): every dtype at the embedded model's 64, and the GPU models' 128 in bf16
CASES = [(dtype, 64) for dtype in DTYPES] + [(torch.bfloat16, 128)]


def _payload(bits: int, n: int, h: int, d: int, dtype, gen) -> ext.Payload:
    """A KIVI payload of ``n`` tokens (groups of 32 tokens for keys, 32 channels for values),
    its scales in the model's dtype, as ``compress.kivi`` stores them."""
    per = 8 // bits
    g, gv = 32, 32
    codes = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=gen).to(dtype)  # noqa: E731
    return ext.Payload(bits, g, gv, codes(n, h, -(-d // per)), rand(n // g, h, d), rand(n // g, h, d),
                       codes(n, h, -(-d // per)), rand(n, h, d // gv), rand(n, h, d // gv), d, d)


def _exercise(dtype, d: int) -> None:
    """Each wrapper, with the argument dtypes of its call sites (SGLang's ``req_to_token``
    is int32, its batch tensors int64; q and the KV pool in the model's dtype)."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, n_slots = 6, 2, 256
    req_to_token = torch.randint(1, n_slots, (4, 128), dtype=torch.int32, generator=gen)
    req_to_token[:, ::3] = 0  # dropped rows point at the null slot
    kv = ext.build_kv_indices(req_to_token, torch.tensor([2, 0]), torch.tensor([0, 5]), torch.tensor([100, 40]), 0)
    k_buf = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
    v_buf = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    out, lse = ext.paged_attention(q, k_buf, v_buf, torch.tensor([0, 1]), torch.tensor([99, 39]), kv.indptr,
                                   kv.indices, kv.positions, d ** -0.5)
    for bits in (2, 1):
        p = _payload(bits, 64, hkv, d, dtype, gen)
        ext.kivi_attention(q, p, d ** -0.5)
        exclude = torch.zeros(hkv, 64, dtype=torch.bool)
        exclude[:, ::5] = True
        p_out, p_lse = ext.kivi_attention(q[:1], p, d ** -0.5, exclude=exclude)
        ext.payload_scores(q[0], p_lse[0], p, d ** -0.5, exclude=exclude)
        ext.payload_scores(q[0], p_lse[0], p, d ** -0.5)
    ext.copy_rows(k_buf.clone(), torch.arange(10), k_buf, torch.arange(20, 30))
    pos = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in range(hkv)])
    ext.scatter_head_rows(torch.zeros(40, hkv, d, dtype=dtype), pos, torch.randn(8, hkv, d, generator=gen).to(dtype))
    ext.position_mask(torch.tensor([3, 11, 20]), torch.tensor([0, 2, 9, 15]), num_prefix=2)
    ext.gather_head_rows(torch.randn(40, hkv, d, generator=gen).to(dtype), pos)
    # the batched drafters: payloads by address, SpeCache's scores, fetch and rows, merges
    members = [_payload(2, n, hkv, d, dtype, gen) for n in (64, 32)]
    pb = ext.payload_batch(members)
    p_out, p_lse = ext.kivi_attention_batch(q, pb, d ** -0.5)
    scores = ext.payload_scores_batch(q, p_lse, pb, d ** -0.5, lse2=lse)
    host = [torch.randn(64, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    fetched = ext.fetch_rows(scores.topk(4, dim=-1).indices, torch.tensor([[t.data_ptr()] * 2 for t in host]),
                             host[0], torch.tensor([8, 0]), torch.tensor([4, 2], dtype=torch.int32), pb.num_tokens,
                             torch.tensor([2, 0]), req_to_token, k_buf, v_buf)
    r_out, r_lse = ext.rows_attention(q, fetched, d ** -0.5)
    ext.kivi_attention_batch(q, pb, d ** -0.5, exclude=fetched.selected, merge=((r_out, r_lse), (out, lse)))
    ext.kivi_attention_batch(q, pb, d ** -0.5, merge=((out, lse),))
    ext.merge_state(p_out, p_lse, out, lse)


@pytest.fixture(scope="module")
def specs() -> list[aot.Spec]:
    if dispatch.interpreter_problem():  # the launches are recorded by running them interpreted
        pytest.skip(dispatch.interpreter_problem())
    mp = pytest.MonkeyPatch()
    mp.setenv(dispatch.ENV, "triton")
    try:
        with dispatch.recording() as recorded:
            for dtype, d in CASES:
                _exercise(dtype, d)
    finally:
        mp.undo()
    return aot.unique(recorded)


def _jit_functions() -> dict[str, object]:
    """Every ``@triton.jit`` function defined in the package, by qualified name."""
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(ext.__path__):
        module = importlib.import_module(f"{ext.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_kernel_is_launched_or_called_by_one(specs):
    """The compile test covers the whole package: every jit function is launched by a
    wrapper above, or called from a launched kernel or from a helper so called."""
    jit = _jit_functions()
    reached = {f"{s.module}.{s.kernel}" for s in specs}
    while True:  # the helpers that the reached functions call, until no new one
        sources = "\n".join(inspect.getsource(jit[name].fn) for name in reached)
        more = {name for name, fn in jit.items() if f"{fn.fn.__name__}(" in sources} - reached
        if not more:
            break
        reached |= more
    missing = sorted(set(jit) - reached)
    assert not missing, f"kernels no wrapper launched here (add them to _exercise): {missing}"


def test_launches_cover_every_dtype(specs):
    seen = {(s.name, s.signature.get("q")) for s in specs}
    for dtype in ("*bf16", "*fp16", "*fp32"):
        for name in ("paged_attention", "kivi_attention", "specache_scores"):
            assert (name, dtype) in seen, (name, dtype, seen)


@pytest.mark.parametrize("arch", [90, pytest.param(80, marks=pytest.mark.slow)])
def test_every_launch_compiles_for_cuda(specs, arch):
    """Each recorded specialization compiles to a cubin for sm_90 (H100, H200) and, in
    the slow suite, sm_80 (A100): about a minute each on two cores."""
    results = aot.compile_specs(specs, [arch])
    assert len(results) == len(specs)
    failures = [r for r in results if r.error]
    assert not failures, "\n\n".join(f"sm_{r.arch} {r.spec.name} {r.spec.signature} {r.spec.constexprs}:\n"
                                      f"{r.error[:1500]}" for r in failures)
