"""Which implementation a call runs: Triton on CUDA tensors, the torch reference elsewhere.

``SGL_KERNEL_EXT_BACKEND=triton|torch`` forces one. Forced Triton on CPU tensors runs the
kernels in Triton's interpreter (what ``TRITON_INTERPRET=1`` does): slow, but the same
kernel code, which is how the kernels are tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
from collections import Counter
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

ENV = "SGL_KERNEL_EXT_BACKEND"

# Triton launches per kernel name (tests read it to prove the kernel path was taken).
launches: Counter = Counter()


class Launch(NamedTuple):
    """One kernel launch as a wrapper made it: what :mod:`.aot` compiles for a GPU."""

    name: str
    kernel: object  # the @triton.jit function
    args: tuple
    kwargs: dict
    grid: tuple = ()


_recorders: list[list[Launch]] = []
# > 0 while a kernel runs in Triton's interpreter: the torch operators it dispatches to
# emulate the kernel are not launches of their own (``sglang_vc``'s LaunchCounter)
interpreting = 0


@contextlib.contextmanager
def recording():
    """Collect every :func:`launch` made inside the block (they still run)."""
    out: list[Launch] = []
    _recorders.append(out)
    try:
        yield out
    finally:
        _recorders.remove(out)


class Backend(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"


def is_cuda_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU Triton compiles for (a seam for tests that stand in a
    CUDA platform on a CPU machine)."""
    return t.is_cuda


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(t: torch.Tensor) -> Backend:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        try:
            backend = Backend(forced)
        except ValueError:
            raise ValueError(f"{ENV} must be 'triton' or 'torch', got {forced!r}") from None
        if backend is Backend.TRITON and not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton is not installed")
        return backend
    return Backend.TRITON if is_cuda_tensor(t) and triton_available() else Backend.TORCH


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run this package's kernels here, or None.

    The kernels loop over row ranges loaded from memory (``range(tl.load(start), ...)``).
    Triton 3.6's interpreter hands such a bound to Python as a one-element array, which
    numpy >= 2.4 refuses to turn into an int (Triton 3.9 passes). A probe of exactly that
    decides, whatever the versions; compiled kernels on a GPU are not concerned."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    def probe(bounds, out):
        acc = tl.zeros([4], dtype=tl.int32)
        for i in range(tl.load(bounds), tl.load(bounds + 1)):
            acc += 1
        tl.store(out + tl.arange(0, 4), acc)

    out = torch.zeros(4, dtype=torch.int32)
    try:
        with _device_calls_interpreted():
            InterpretedFunction(probe)[(1,)](torch.tensor([1, 3], dtype=torch.int32), out)
    except Exception as e:  # noqa: BLE001 (any failure means the interpreter is unusable here)
        import numpy

        return (f"Triton {triton.__version__}'s interpreter fails on a loop bound loaded from memory with numpy "
                f"{numpy.__version__} ({type(e).__name__}: {e}); Triton 3.9 runs it")
    return None if out.tolist() == [2, 2, 2, 2] else "Triton's interpreter miscounts a loop over loaded bounds"


def _interpreted(kernel):
    return _interpreted_fn(getattr(kernel, "fn", kernel))


@functools.cache
def _interpreted_fn(fn):
    # keyed by the Python function: hashing a JITFunction computes its cache key, which
    # fails while the interpreter has patched triton.language
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def launch(name: str, kernel, grid, *args, **kwargs) -> None:
    """Launch a ``@triton.jit`` kernel; on CPU tensors through Triton's interpreter."""
    launches[name] += 1
    for out in _recorders:
        out.append(Launch(name, kernel, args, dict(kwargs), tuple(grid)))
    device_tensor = next(a for a in args if isinstance(a, torch.Tensor))
    if launches[name] == 1:
        logger.info("sgl-kernel-ext: Triton kernel %s on %s", name,
                    device_tensor.device if device_tensor.is_cuda else "the CPU (Triton interpreter)")
    if device_tensor.is_cuda:
        kernel[grid](*args, **kwargs)
        return
    from triton.runtime.interpreter import InterpretedFunction

    problem = interpreter_problem()
    if problem:
        raise RuntimeError(f"sgl-kernel-ext: cannot run {name} in Triton's interpreter on the CPU: {problem}. "
                           f"Unset {ENV} (the torch path) or upgrade Triton.")
    runner = kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel)
    global interpreting
    interpreting += 1
    try:
        with _device_calls_interpreted():
            runner[grid](*args, **kwargs)
    finally:
        interpreting -= 1


@contextlib.contextmanager
def _device_calls_interpreted():
    """Triton decides at decoration time whether a ``@triton.jit`` function is compiled or
    interpreted (``TRITON_INTERPRET``), and ``triton.language``'s own helpers (``tl.sum``,
    ``tl.cumsum``, ...) were decorated when Triton was imported. When the process did not
    start with ``TRITON_INTERPRET=1`` (a test run among others, a server), the kernel is
    interpreted here and the helpers it calls are made interpretable for the launch."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    JITFunction.__call__ = lambda self, *a, **kw: _interpreted(self)(*a, **kw)
    try:
        yield
    finally:
        JITFunction.__call__ = original


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``: itself when it is there already. A ``.to`` that would be a
    no-op on a GPU is still counted as a copy by sglang-vc's sync counter on the CPU,
    where every device is the host; a real copy between devices stays a ``.to``."""
    return t if t.device == torch.device(device) else t.to(device)


def block(n: int, least: int = 16) -> int:
    """The power-of-two block that covers ``n`` (``tl.arange`` needs powers of two)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def bucket(n: int, least: int) -> int:
    """The launch-shape bucket of a host-known size ``n``: at least ``least``, above it
    four buckets per doubling (multiples of an eighth of the power of two that covers
    ``n``), so above ``least`` a launch does at most 1.25x the work its sizes need; 0
    stays 0. Sizes
    that fall in one bucket give the same grids and buffer shapes, so one CUDA graph
    serves them all; the kernels read the true sizes from the device."""
    if n <= 0:
        return 0
    if n <= least:
        return least
    step = max(1, block(n, least=1) // 8)
    return -(-int(n) // step) * step
