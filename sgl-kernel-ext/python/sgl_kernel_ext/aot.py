"""Compile recorded kernel launches for a CUDA target on a machine without a GPU.

Triton's interpreter runs a kernel's Python on numpy and never type-checks it; the
compiler does (a loop-carried variable that changes type, a store of the wrong dtype),
and so does a GPU at the first launch. ``triton.compile`` with a ``GPUTarget`` lowers a
kernel to PTX and, through the ``ptxas`` Triton ships, to a cubin, with no driver: what
a launch on that GPU would compile.

The compiles run in fresh processes, one a core (``python -m sgl_kernel_ext.aot``, jobs
as JSON on stdin): a process that has run kernels in the interpreter is left with parts
of ``triton.language`` that the compiler cannot use.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import NamedTuple

import torch

from .dispatch import Launch


class Spec(NamedTuple):
    """One kernel specialization, as the JIT would compile it for a launch."""

    name: str  # the wrapper's launch name
    module: str
    kernel: str
    signature: dict  # parameter -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict

    def key(self) -> tuple:
        return (self.module, self.kernel, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())))


class Compiled(NamedTuple):
    spec: Spec
    arch: int
    error: str | None  # None: compiled to a cubin


_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}


def spec_of(launch: Launch) -> Spec:
    """Triton's parameter types and the constexpr values of one launch, derived from its
    arguments as the JIT derives them."""
    from triton.runtime.jit import mangle_type

    fn = launch.kernel.fn
    params = launch.kernel.params
    values = dict(zip([p.name for p in params], launch.args))
    values.update(launch.kwargs)
    sig, constexprs = {}, {}
    for p in params:
        if p.name not in values:
            raise TypeError(f"{launch.name}: no value for parameter {p.name}")
        value = values[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPES:
                raise TypeError(f"{launch.name}: no Triton pointer type for {value.dtype} ({p.name})")
            sig[p.name] = "*" + _DTYPES[value.dtype]
        else:
            sig[p.name] = mangle_type(value)
    return Spec(launch.name, fn.__module__, fn.__name__, sig, constexprs)


def unique(launches: list[Launch]) -> list[Spec]:
    """One spec per (kernel, signature, constexprs): what the JIT would compile once."""
    out: dict[tuple, Spec] = {}
    for launch in launches:
        spec = spec_of(launch)
        out.setdefault(spec.key(), spec)
    return list(out.values())


def compile_specs(specs: list[Spec], archs: list[int], timeout: float = 1800,
                  processes: int | None = None) -> list[Compiled]:
    """Compile every spec for every ``sm_{arch}`` in fresh Python processes (one a core)."""
    jobs = [(s, arch) for s in specs for arch in archs]
    n = max(1, min(processes or os.cpu_count() or 1, len(jobs)))
    procs = []
    for i in range(n):
        payload = json.dumps([{"spec": s._asdict(), "arch": arch} for s, arch in jobs[i::n]])
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append((proc, payload))
    results = []
    for proc, payload in procs:
        out, err = proc.communicate(payload, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a compile process failed ({proc.returncode}):\n{err[-4000:]}")
        results += [Compiled(Spec(**r["spec"]), r["arch"], r["error"]) for r in json.loads(out)]
    return results


def _compile_one(spec: Spec, arch: int) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec.module), spec.kernel)
    try:
        triton.compile(ASTSource(kernel, spec.signature, constexprs=spec.constexprs), target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # the compiler's own message is the finding
        return Compiled(spec, arch, f"{type(exc).__name__}: {exc}")
    return Compiled(spec, arch, None)


def main() -> int:
    results = [_compile_one(Spec(**job["spec"]), job["arch"]) for job in json.load(sys.stdin)]
    json.dump([{"spec": r.spec._asdict(), "arch": r.arch, "error": r.error} for r in results], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
