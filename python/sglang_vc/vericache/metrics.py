"""Live counters of VeriCache (the server-info contract of docs/architecture.md: verify rounds, drafted, accepted,
mean acceptance length, bytes reloaded from host), safe to bump from several threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class VeriCacheMetrics:
    """Counters. Acceptance length = tokens committed per verify round (accepted drafts
    plus the correction or bonus token), so ``committed = accepted + verify_rounds``."""

    verify_rounds: int = 0  # requests verified (one round = one request's verify)
    drafted: int = 0  # draft tokens submitted to verification
    accepted: int = 0  # draft tokens the verifier accepted
    committed: int = 0  # tokens committed by verification (accepted + 1 per round)
    bytes_reloaded: int = 0  # full-KV bytes moved host -> device for verifies
    admissions: int = 0  # successful ADMIT calls (Algorithm 1)
    admissions_deferred: int = 0  # ADMIT calls that returned the request to waiting
    fallbacks: int = 0  # requests that gave up speculation and decode from full KV
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def add(self, **deltas: int) -> None:
        """Atomically add ``deltas`` to the named counters."""
        with self._lock:
            for name, value in deltas.items():
                if name.startswith("_") or not hasattr(self, name):
                    raise AttributeError(f"unknown counter {name!r}")
                setattr(self, name, getattr(self, name) + int(value))

    def record_verify(self, drafted: int, accepted: int, rounds: int = 1) -> None:
        """One verify step over ``rounds`` requests: ``drafted`` tokens proposed,
        ``accepted`` accepted; each round also commits one correction/bonus token."""
        self.add(
            verify_rounds=rounds,
            drafted=drafted,
            accepted=accepted,
            committed=int(accepted) + int(rounds),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify round (0 before the first round)."""
        with self._lock:
            return self.committed / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted (gamma of the paper, Table 2)."""
        with self._lock:
            return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self, derived: bool = True) -> dict[str, Any]:
        """Counters as a dict; ``derived=False`` keeps only the raw counters, which can
        be summed across processes (the derived ratios cannot)."""
        with self._lock:
            out: dict[str, Any] = {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }
        if derived:
            rounds, drafted = out["verify_rounds"], out["drafted"]
            out["mean_acceptance_length"] = out["committed"] / rounds if rounds else 0.0
            out["acceptance_rate"] = out["accepted"] / drafted if drafted else 0.0
        return out

    def reset(self) -> None:
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, 0)
