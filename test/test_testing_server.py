"""The test harness's port choice: each pytest-xdist worker draws from a slice of its own,
below the range where SGLang draws the ports its scheduler binds later."""

from __future__ import annotations

import pytest

from sglang_vc.testing import server


def _slice(monkeypatch, worker, count):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    return server.port_slice()


@pytest.mark.parametrize("count", [2, 3])
def test_workers_draw_ports_from_disjoint_slices(monkeypatch, count):
    slices = [_slice(monkeypatch, f"gw{i}", str(count)) for i in range(count)]
    lo, hi = server.PORT_RANGE
    assert hi <= 22000  # SGLang's get_free_port_below_ephemeral draws from 22000-29999
    for (a, b), (c, d) in zip(slices, slices[1:]):
        assert lo <= a < b <= c < d <= hi, slices
    port = server.free_port()  # the last worker's slice
    assert slices[-1][0] <= port < slices[-1][1]


def test_one_process_draws_from_the_whole_range(monkeypatch):
    assert _slice(monkeypatch, "", "") == (server.PORT_RANGE[0], min(server.PORT_RANGE[1], server.ephemeral_low()))
    assert _slice(monkeypatch, "gw0", "1") == _slice(monkeypatch, "", "")
