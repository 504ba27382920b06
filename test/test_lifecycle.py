"""The server stops cleanly on SIGTERM and SIGINT, leaving no process behind."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from sglang_vc.testing.server import ServerProcess


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])  # the launcher handles both the same way
def test_signal_stops_server_and_children(sig, model_dir, tmp_path):
    server = ServerProcess(["--model-path", model_dir, "--max-total-tokens", "4096"],
                           log_path=tmp_path / "server.log")
    family = [server.proc.pid] + [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)]
    assert len(family) >= 3, "launcher, scheduler and detokenizer expected"
    server.proc.send_signal(sig)
    try:
        server.proc.wait(60)
    except Exception:
        server.stop(signal.SIGKILL)
        pytest.fail(f"server did not exit on {sig.name}:\n{server.log_tail()}")
    deadline = time.time() + 20
    alive = family
    while alive and time.time() < deadline:
        alive = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
    server.stop()
    assert not alive, f"processes left behind after {sig.name}: {alive}"
