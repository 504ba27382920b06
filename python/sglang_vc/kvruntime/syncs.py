"""Counting the host synchronisations of a block of code, for tests of the hot path.

On a GPU, a tensor's value read on the host (``tolist``, ``item``, ``cpu``, ``numpy``, a
device-to-host ``.to``, and Python's ``int``/``float``/``bool``/``index`` of a tensor)
waits for every kernel queued before it. The decode hot path may make a fixed number of
them per iteration, never one per request or per layer. On the CPU nothing waits, but
the calls are the same code, so they are counted here: :class:`SyncCounter` patches those
``torch.Tensor`` methods while it is active and counts the calls the entering thread
makes (a copy thread's calls are its own). A ``.to`` counts when its target is written
as ``"cpu"`` (the project writes device-to-host copies that way, and host-to-device ones
with the request's device), unless it is ``non_blocking``: then the read of the copy,
after its event, is the wait, and is counted.

Blocking host-to-device copies wait too (a copy from pageable memory, or any copy without
``non_blocking``), and are counted as ``by_kind["h2d"]``: ``torch.tensor`` and
``torch.as_tensor`` of host data (a list, a number, a NumPy array) with an explicit
``device``, and a ``.to(device)`` whose target is a device other than the string
``"cpu"`` without ``non_blocking=True``. On the CPU every device is the host, so the
counter cannot tell a real copy from a ``.to`` that would be a no-op on a GPU: it counts
both, which over-counts and never hides a copy. A staging copy written the GPU's way
(``pin_memory`` then ``.to(device, non_blocking=True)``) is not counted: it does not wait.

``SGLANG_VC_COUNT_SYNCS=1`` makes the VERICACHE worker count each decode iteration and
write the count into its schedule trace (``--vc-schedule-trace``); ``=sites`` adds where
each call was made (``host_sync_sites``: "kind file:line" -> calls), to find the one
that grows with the batch.

Calls made directly by SGLang's ``torch_native`` attention backend are counted apart
(``by_kind["stand_in"]``, not in :attr:`SyncCounter.total`): it is the full-KV backend
only on the CPU, where SGLang runs its per-request loop; on CUDA the full-KV backend is
FlashInfer, FA3 or Triton, whose metadata is built from host-known lengths. So are the
reads of ``sgl_kernel_ext``'s dispatch, which probes Triton's interpreter once (the
stand-in CUDA platform of a CPU server run with ``SGL_KERNEL_EXT_BACKEND=triton``).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Optional

import torch

ENV = "SGLANG_VC_COUNT_SYNCS"
_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
_FACTORIES = ("tensor", "as_tensor")  # torch.<name>(data, device=...)
H2D = "h2d"
# the CPU's full-KV backend (SGLang's own code), and the Triton interpreter's one-time
# probe (a stand-in CUDA platform on the CPU): see the module docstring
STAND_IN_FILES = ("sglang/srt/layers/attention/torch_native_backend.py", "sgl_kernel_ext/dispatch.py")
STAND_IN = "stand_in"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def with_sites() -> bool:
    return os.environ.get(ENV, "") == "sites"


def _to_target(args, kwargs):
    target = kwargs.get("device", args[0] if args else None)
    return target if isinstance(target, (str, torch.device)) else None


def _to_kind(args, kwargs):
    """What a ``.to`` call is: ``"to"`` (device-to-host), :data:`H2D` (a blocking copy to
    a device) or None (a dtype change, or a non-blocking copy)."""
    target = _to_target(args, kwargs)
    if target is None:
        return None
    non_blocking = kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True)
    if isinstance(target, str) and target.split(":")[0] == "cpu":
        # (a non-blocking copy to the host does not wait: the read of its result, after
        # its event, is the synchronisation, and is counted there)
        return None if non_blocking else "to"
    return None if non_blocking else H2D


def _factory_kind(args, kwargs):
    data = args[0] if args else kwargs.get("data")
    host_data = not isinstance(data, torch.Tensor)
    return H2D if host_data and kwargs.get("device") is not None else None


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.total`` and ``c.by_kind``."""

    _lock = threading.Lock()

    def __init__(self):
        self.by_kind: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()  # "kind file:line" -> calls
        self._thread: Optional[int] = None
        self._saved: dict = {}
        self._saved_torch: dict = {}

    @property
    def total(self) -> int:
        return sum(n for kind, n in self.by_kind.items() if kind != STAND_IN)

    def _count(self, kind) -> None:
        if kind is not None and threading.get_ident() == self._thread:
            frame = sys._getframe(2)
            caller = frame.f_code.co_filename.replace("\\", "/")
            kind = STAND_IN if caller.endswith(STAND_IN_FILES) else kind
            self.by_kind[kind] += 1
            self.by_site[f"{kind} {'/'.join(caller.split('/')[-2:])}:{frame.f_lineno}"] += 1

    def _wrap(self, name, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            counter._count(_to_kind(args, kwargs) if name == "to" else name)
            return original(tensor, *args, **kwargs)

        return counted

    def _wrap_factory(self, original):
        counter = self

        def counted(*args, **kwargs):
            counter._count(_factory_kind(args, kwargs))
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> "SyncCounter":
        self._lock.acquire()  # one counter patches torch.Tensor at a time
        self._thread = threading.get_ident()
        for name in (*_READS, "to"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        for name in _FACTORIES:
            self._saved_torch[name] = getattr(torch, name)
            setattr(torch, name, self._wrap_factory(self._saved_torch[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in self._saved_torch.items():
            setattr(torch, name, original)
        self._saved.clear()
        self._saved_torch.clear()
        self._lock.release()
