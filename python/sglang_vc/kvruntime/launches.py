"""Counting the kernel launches of a block of code, on any device, for tests of the hot path.

On a GPU every torch operator that computes (not a view, not an allocation) launches at
least one kernel, and every Triton kernel of ``sgl_kernel_ext`` one more. On the CPU the
same code dispatches the same operators, so :class:`LaunchCounter` counts them there
(a ``TorchDispatchMode``) beside ``sgl_kernel_ext``'s own launch counter: a per-request or
per-head Python loop over tensors shows as a count that grows with the batch or the heads.
It is a lower bound of a GPU's launches (a fused CUDA op may launch several kernels).
Under a stand-in CUDA platform the Triton kernels run in Triton's interpreter, whose own
torch operators are not counted: each kernel is one launch.

:class:`LaunchShapes` records what a CUDA graph fixes at capture: each operator with its
arguments' shapes, strides and scalars; each Triton kernel with its grid, constants,
scalars and its tensors' shapes, strides and dtypes (but a tensor the kernel reads only
for its type, an argument named ``like*`` such as a payload table's first member, by
strides and dtype: it may differ in size). Allocations are not recorded; the buffers
they make are, where an operator or kernel takes them. Two calls with equal records
launch the same work over buffers of the same shapes, so one captured graph can serve
both.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch nothing: allocations and aliasing
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh", "alias", "_local_scalar_dense"}


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


def _signature(x, shapes: bool = True):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape) if shapes else None, tuple(x.stride()), str(x.dtype))
    if isinstance(x, (list, tuple)):
        return tuple(_signature(y, shapes) for y in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v, shapes)) for k, v in sorted(x.items()))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)  # a dtype, a device, a layout


def _kernel_args(launch) -> tuple:
    """A Triton launch's arguments: tensors by shape, strides and dtype, except those the
    kernel reads only for their type (named ``like*``: a payload table's first member, a
    host copy), by strides and dtype."""
    names = getattr(getattr(launch.kernel, "fn", launch.kernel), "arg_names", None) or getattr(
        launch.kernel, "arg_names", [])
    return tuple(_signature(a, shapes=not (i < len(names) and names[i].startswith("like")))
                 for i, a in enumerate(launch.args))


class LaunchShapes(TorchDispatchMode):
    """``with LaunchShapes() as s: ...`` then ``s.record``: every computing operator
    (name, argument signatures) and every ``sgl_kernel_ext`` kernel (name, grid,
    argument signatures, constants), in order of each kind; ``s.syncs``: the host reads
    of device values (``.item()``, ``.tolist()``), which no CUDA graph captures."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.kernels: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from sgl_kernel_ext import dispatch

        name = func.overloadpacket.__name__
        # a read of a device value on the host is recorded too: a graph cannot capture it
        if not func.is_view and (name not in _FREE or name == "_local_scalar_dense") and not dispatch.interpreting:
            self.ops.append((name, _signature(args), _signature(kwargs or {})))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "LaunchShapes":
        from sgl_kernel_ext import dispatch

        self._recording = dispatch.recording()
        self._launches = self._recording.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._recording.__exit__(*exc)
        self.kernels = [(k.name, k.grid, _kernel_args(k), _signature(k.kwargs)) for k in self._launches]

    @property
    def syncs(self) -> int:
        return sum(op[0] == "_local_scalar_dense" for op in self.ops)

    @property
    def record(self) -> tuple:
        return tuple(self.ops), tuple(self.kernels)
