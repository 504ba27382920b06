"""The outside-write watch behind ``test_nothing_parks_state_on_the_runtime_or_the_attention_backend``
(:mod:`sglang_vc.kvruntime.writes`): it counts a write from outside the object's own
methods once sealed, and nothing else."""

from __future__ import annotations

from sglang_vc import stats
from sglang_vc.kvruntime import writes


class _Backend:
    def __init__(self):
        self.metadata = None

    def init_forward_metadata(self, batch):
        self.metadata = batch  # its own: SGLang's convention


def _park(backend):
    backend.staging = "per-forward state for someone else"


def test_outside_writes_are_counted_once_sealed(monkeypatch):
    monkeypatch.setenv(writes.ENV, "1")
    monkeypatch.setattr(writes, "_sealed", False)
    monkeypatch.setattr(stats, "_counters", type(stats._counters)(stats._counters.default_factory))
    writes.watch(_Backend)
    backend = _Backend()
    _park(backend)  # start-up: not counted
    assert "state_writes" not in stats.snapshot()
    writes.seal()
    backend.init_forward_metadata(1)
    assert "state_writes" not in stats.snapshot()
    _park(backend)
    _park(backend)
    assert stats.snapshot()["state_writes"] == {"_Backend.staging by test_state_writes.py:_park": 2}
    assert backend.staging and backend.metadata == 1  # the writes themselves happen


def test_nothing_is_watched_without_the_variable(monkeypatch):
    monkeypatch.delenv(writes.ENV, raising=False)

    class Quiet:
        pass

    writes.watch(Quiet)
    assert Quiet.__setattr__ is object.__setattr__
