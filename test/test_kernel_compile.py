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
from sgl_kernel_ext import aot, dispatch, warmup

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (dtype, head_dim): every dtype at the embedded model's 64, and the GPU models' 128 in bf16
CASES = [(dtype, 64) for dtype in DTYPES] + [(torch.bfloat16, 128)]


@pytest.fixture(scope="module")
def specs() -> list[aot.Spec]:
    if dispatch.interpreter_problem():  # the launches are recorded by running them interpreted
        pytest.skip(dispatch.interpreter_problem())
    mp = pytest.MonkeyPatch()
    mp.setenv(dispatch.ENV, "triton")
    try:
        with dispatch.recording() as recorded:
            for dtype, d in CASES:
                warmup.exercise(dtype, d)
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
    assert not missing, f"kernels no wrapper launched here (add them to sgl_kernel_ext.warmup.exercise): {missing}"


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
