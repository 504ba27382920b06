"""Capabilities of SGLang that a mechanism switches off, said as warnings users see.

The launcher resolves the project's flags (and SGLang calls an algorithm's
``handle_server_args``) before SGLang has configured logging, when an ``INFO`` line goes
nowhere. A switch is recorded here and logged as a ``WARNING`` with its reason once the
launcher has configured SGLang's logging (:func:`flush`); the same list is published in
``/server_info`` (``sglang_vc.switched_off``).
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("sglang_vc")


@dataclasses.dataclass(frozen=True)
class SwitchedOff:
    capability: str  # e.g. "CUDA graphs"
    by: str  # the flag or mechanism that needs it off
    reason: str

    def message(self) -> str:
        return f"{self.capability} disabled by {self.by}: {self.reason}"


_pending: list[SwitchedOff] = []
_all: list[SwitchedOff] = []


def switched_off(capability: str, by: str, reason: str) -> None:
    notice = SwitchedOff(capability, by, reason)
    if notice in _all:
        return
    _all.append(notice)
    _pending.append(notice)


def flush() -> None:
    """Log every switch recorded so far (call once logging is configured)."""
    while _pending:
        logger.warning(_pending.pop(0).message())


def all_switched_off() -> list[SwitchedOff]:
    return list(_all)
