"""Who writes the attributes of the runtime and the attention backend while serving
(``SGLANG_VC_WATCH_WRITES=1``; tests).

Per-forward state travels on the forward (:mod:`sglang_vc.vericache.forward_plan`) and the
worker's answers to SGLang's scheduler on one registered object
(:mod:`.scheduler_side`); nobody parks state on the process's runtime or on the attention
backend for someone else to read. Once the server has decoded (:func:`seal`), every write
to a watched object's attribute from code that is not one of that object's own methods is
counted under ``state_writes`` in ``/server_info``, keyed ``Class.attr by file:function``.
An object's own methods (SGLang's convention of a backend keeping the metadata it built
in ``init_forward_metadata``) are not counted.
"""

from __future__ import annotations

import os
import sys

from sglang_vc import stats

ENV = "SGLANG_VC_WATCH_WRITES"

_sealed = False
_watched: set = set()


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def watch(cls) -> None:
    """Count outside writes to instances of ``cls`` (and its subclasses) once sealed."""
    if cls in _watched or not enabled():
        return
    _watched.add(cls)
    original = cls.__setattr__

    def __setattr__(self, name, value):
        if _sealed:
            frame = sys._getframe(1)
            if frame.f_locals.get("self") is not self:
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                stats.add("state_writes", **{f"{type(self).__name__}.{name} by {where}": 1})
        original(self, name, value)

    cls.__setattr__ = __setattr__


def seal() -> None:
    """Start-up is over (the first decode iteration ran): count from now on."""
    global _sealed
    _sealed = True
