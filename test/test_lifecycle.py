"""The server stops cleanly on SIGTERM and SIGINT: within 10 seconds with a request in
flight (aborted, its client answered), leaving no process behind and EvicPress's disk
tier consistent (no partial file; its entries serve the next server started on it)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
import requests

from sglang_vc.testing import evicpress as epx
from sglang_vc.testing.server import ServerProcess

from conftest import real_text_passages

STOP_S = 10.0


def _family(server: ServerProcess) -> list[int]:
    return [server.proc.pid] + [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


CRASH_LINES = ("crashed with exit code", "SIGQUIT received", "crash diagnostics")


def _stop_with_request_in_flight(server: ServerProcess, sig: int, payload: dict,
                                 group: bool = False) -> tuple[float, dict]:
    """Send ``sig`` (to the launcher, or to its whole process group as a supervisor or a
    terminal does) while ``payload`` is being generated; (seconds until every process of
    the server is gone, the in-flight request's answer). The launcher must be the last
    of them to exit, and the log must read as a stop, not a crash."""
    family = _family(server)
    assert len(family) >= 3, "launcher, scheduler and detokenizer expected"
    answer: dict = {}

    def in_flight():
        r = requests.post(server.url + "/generate", json=payload, timeout=120)
        answer.update(status=r.status_code, body=r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else r.text)

    def decode_lines() -> int:
        return server.log_tail(10**6).count("Decode batch")

    seen = decode_lines()
    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.time() + 60
    while decode_lines() == seen and time.time() < deadline:  # SGLang logs every 40 decode steps
        time.sleep(0.2)
    t = time.monotonic()
    if group:
        os.killpg(server.proc.pid, sig)
    else:
        server.proc.send_signal(sig)
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    at_launcher_exit = _alive(family[1:])  # the launcher is reaped by wait(): not in the list
    while _alive(family) and time.monotonic() - t < 30:
        time.sleep(0.1)
    took = time.monotonic() - t
    left = _alive(family)
    thread.join(30)
    server.stop(signal.SIGKILL)
    name = signal.Signals(sig).name
    assert not left, f"processes left behind after {name}: {left}\n{server.log_tail()}"
    assert not at_launcher_exit, f"the launcher exited before {at_launcher_exit} ({name})"
    log = server.log_path.read_text(errors="replace")
    assert not [line for line in CRASH_LINES if line in log], f"a stop logged as a crash:\n{server.log_tail()}"
    return took, answer


def test_sigterm_with_a_request_in_flight(model_dir, tokenizer, tmp_path):
    """An EvicPress server with a context on its disk tier gets SIGTERM (its whole process
    group, as systemd sends it) while it decodes a long answer: every process is gone
    within 10 s, the launcher last, the log reads as a stop (no crash report), the client got an aborted answer, the
    disk holds no partial file, and a new server on the same disk answers the context from
    it as the first one did."""
    disk = tmp_path / "disk"
    args = ["--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "4096",
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--radix-cache-backend", "evicpress",
            "--evicpress-disk-dir", str(disk), "--evicpress-no-profiler", "--evicpress-disk-bandwidth", "1"]
    passage = real_text_passages(3, words=300)[1]
    server = ServerProcess(args, log_path=tmp_path / "first.log", timeout=420)
    try:
        ids, _ = epx.register(server, tokenizer, "doc", passage)
        epx.ask(server, tokenizer, ids)
        epx.api(server, "POST", "/evicpress/contexts/doc/placement", {"tier": "disk"})
        epx.api(server, "POST", "/evicpress/evict_device")
        stored = epx.ask(server, tokenizer, ids)  # answered from the disk copy
        assert epx.counters(server)["hits_disk"] >= 1
        # the hit promoted it off the disk: put it back, so that the disk holds it at the stop
        epx.api(server, "POST", "/evicpress/contexts/doc/placement", {"tier": "disk"})
        assert epx.placement(server, "doc")["tier"] == "disk"
        long = {"text": real_text_passages(3, words=100)[2],
                "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
        took, answer = _stop_with_request_in_flight(server, signal.SIGTERM, long, group=True)
    finally:
        server.stop(signal.SIGKILL)
    assert took < STOP_S, f"stopped in {took:.1f} s"
    assert answer.get("status") == 200, answer
    assert answer["body"]["meta_info"]["finish_reason"]["type"] == "abort", answer
    assert not [p.name for p in disk.rglob("*") if p.name.startswith(".tmp-")], "partial files on disk"

    with ServerProcess(args, log_path=tmp_path / "second.log", timeout=420) as again:
        epx.register(again, tokenizer, "doc", passage)
        before = epx.counters(again)
        out = epx.ask(again, tokenizer, ids)
        after = epx.counters(again)
        assert after.get("hits_disk", 0) == before.get("hits_disk", 0) + 1, (before, after)
        assert out["output_ids"] == stored["output_ids"]


@pytest.mark.slow
def test_sigint_stops_server_and_children(model_dir, tmp_path):
    server = ServerProcess(["--model-path", model_dir, "--max-total-tokens", "4096"],
                           log_path=tmp_path / "server.log")
    took, answer = _stop_with_request_in_flight(server, signal.SIGINT, {
        "text": "Once upon a time", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
    assert took < STOP_S, f"stopped in {took:.1f} s"
