"""Counting the host synchronisations of a block of code, for tests of the hot path.

On a GPU, a tensor's value read on the host (``tolist``, ``item``, ``cpu``, ``numpy``, a
device-to-host ``.to``, and Python's ``int``/``float``/``bool``/``index`` of a tensor)
waits for every kernel queued before it. The decode hot path may make a fixed number of
them per iteration, never one per request or per layer. On the CPU nothing waits, but
the calls are the same code, so they are counted here: :class:`SyncCounter` patches those
``torch.Tensor`` methods while it is active and counts the calls the entering thread
makes (a copy thread's calls are its own). A ``.to`` counts when its target is written
as ``"cpu"`` (the project writes device-to-host copies that way, and host-to-device ones
with the request's device).

``SGLANG_VC_COUNT_SYNCS=1`` makes the VERICACHE worker count each decode iteration and
write the count into its schedule trace (``--vc-schedule-trace``).

Calls made directly by SGLang's ``torch_native`` attention backend are counted apart
(``by_kind["stand_in"]``, not in :attr:`SyncCounter.total`): it is the full-KV backend
only on the CPU, where SGLang runs its per-request loop; on CUDA the full-KV backend is
FlashInfer, FA3 or Triton, whose metadata is built from host-known lengths.
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
# the CPU's full-KV backend (SGLang's own code): see the module docstring
STAND_IN_FILES = ("sglang/srt/layers/attention/torch_native_backend.py",)
STAND_IN = "stand_in"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.total`` and ``c.by_kind``."""

    _lock = threading.Lock()

    def __init__(self):
        self.by_kind: collections.Counter = collections.Counter()
        self._thread: Optional[int] = None
        self._saved: dict = {}

    @property
    def total(self) -> int:
        return sum(n for kind, n in self.by_kind.items() if kind != STAND_IN)

    def _wrap(self, name, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            if threading.get_ident() == counter._thread and (name != "to" or _to_cpu(args, kwargs)):
                caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
                counter.by_kind[STAND_IN if caller.endswith(STAND_IN_FILES) else name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> "SyncCounter":
        self._lock.acquire()  # one counter patches torch.Tensor at a time
        self._thread = threading.get_ident()
        for name in (*_READS, "to"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        self._lock.release()
