"""Live counters of the mechanisms, kept per scheduler process.

A mechanism calls ``add(mechanism, key=increment, ...)``; the scheduler's internal state
(``/server_info`` -> ``internal_states``) carries a snapshot, and the launcher sums the
snapshots of all schedulers into the ``sglang_vc`` section. With ``--enable-metrics`` the
same counters are Prometheus counters ``sglang_vc:<mechanism>_<key>`` on ``/metrics``
(SGLang's multiprocess registry collects them from every process).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import defaultdict
from typing import Any

_lock = threading.Lock()
_counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))


_prometheus: dict[tuple[str, str], object] = {}


def add(mechanism: str, **increments: float) -> None:
    """Count. Cheap enough for the decode loop: a dict update, plus with ``--enable-metrics``
    a Prometheus counter increment (a write to SGLang's multiprocess files, which
    ``/metrics`` reads from every process; the scheduler is never asked at read time)."""
    with _lock:
        bucket = _counters[mechanism]
        for key, value in increments.items():
            bucket[key] += value
        if _metrics_enabled():
            _export(mechanism, increments)


@functools.cache
def _metrics_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))  # set by SGLang for --enable-metrics


def _export(mechanism: str, increments: dict[str, float]) -> None:
    from prometheus_client import Counter

    for key, value in increments.items():
        counter = _prometheus.get((mechanism, key))
        if counter is None:
            counter = _prometheus[(mechanism, key)] = Counter(
                f"sglang_vc:{mechanism}_{key}", f"sglang-vc {mechanism}: {key.replace('_', ' ')}"
            )
        if value > 0:
            counter.inc(value)


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
