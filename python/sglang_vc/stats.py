"""Live counters of the mechanisms, kept per scheduler process.

A mechanism calls ``counters(name)`` once and increments the returned dict; the
scheduler's internal state (``/server_info`` -> ``internal_states``) carries a snapshot,
and the launcher sums the snapshots of all schedulers into the ``sglang_vc`` section.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

_lock = threading.Lock()
_counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))


def add(mechanism: str, **increments: float) -> None:
    with _lock:
        bucket = _counters[mechanism]
        for key, value in increments.items():
            bucket[key] += value


def snapshot() -> dict[str, dict[str, float]]:
    with _lock:
        return {m: dict(c) for m, c in _counters.items()}


def merge(snapshots: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for snap in snapshots:
        for mechanism, values in snap.items():
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    merged[mechanism][key] += value
    return {m: dict(c) for m, c in merged.items()}
