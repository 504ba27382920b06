"""Counting the kernel launches of a block of code, on any device, for tests of the hot path.

On a GPU every torch operator that computes (not a view, not an allocation) launches at
least one kernel, and every Triton kernel of ``sgl_kernel_ext`` one more. On the CPU the
same code dispatches the same operators, so :class:`LaunchCounter` counts them there
(a ``TorchDispatchMode``) beside ``sgl_kernel_ext``'s own launch counter: a per-request or
per-head Python loop over tensors shows as a count that grows with the batch or the heads.
It is a lower bound of a GPU's launches (a fused CUDA op may launch several kernels).
Under a stand-in CUDA platform the Triton kernels run in Triton's interpreter, whose own
torch operators are not counted: each kernel is one launch.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch nothing: allocations and aliasing
_FREE = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "_local_scalar_dense"}


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...`` then ``c.total`` and ``c.by_op``."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from sgl_kernel_ext import dispatch

        name = func.overloadpacket.__name__
        if not func.is_view and name not in _FREE and not dispatch.interpreting:
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "LaunchCounter":
        import sgl_kernel_ext as ext

        self._triton = dict(ext.launches)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        import sgl_kernel_ext as ext

        super().__exit__(*exc)
        for name, n in ext.launches.items():
            if n > self._triton.get(name, 0):
                self.by_op[f"triton:{name}"] += n - self._triton.get(name, 0)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
