"""Start a real SGLang / sglang-vc server in a subprocess and wait until it serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

LAUNCHERS = {
    "sglang-vc": [sys.executable, "-m", "sglang_vc.launch_server"],
    "sglang": [sys.executable, "-m", "sglang.launch_server"],
}


# Ports are drawn below Linux's ephemeral range (32768-60999 by default): a port the
# kernel hands out for port 0 can be given again, during the ~20 s a server takes to
# start, to any outgoing connection (HTTP clients, torch.distributed's store), and then
# uvicorn cannot bind it. They also stay below 22000-29999, where SGLang draws the ports
# its scheduler binds later (the NCCL/gloo store; EvicPress's control port too).
PORT_RANGE = (10000, 22000)


def _ephemeral_low() -> int:
    """The first port the kernel hands out for port 0 (and to outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that is free now, in ``PORT_RANGE`` (below the ephemeral range)."""
    import random

    lo, hi = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low())
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now (see :func:`free_port`)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


# a test server on the embedded model in float32 grows to ~3 GiB (its three processes),
# and SGLang's CPU start-up sizes its checks from the memory free then: room for it, and
# for the other servers' growth
SERVER_MEMORY = 4 << 30


def _wait_for_memory(timeout: float = 600.0) -> None:
    """Wait (up to ``timeout``) until the machine has room for one more server: the two
    test workers start servers independently, and on a 24 GiB machine a start beside
    the other worker's servers could have the kernel kill one mid-test."""
    import psutil

    deadline = time.time() + timeout
    while psutil.virtual_memory().available < SERVER_MEMORY and time.time() < deadline:
        time.sleep(2)


class ServerProcess:
    """A server subprocess in its own process group, so that stopping it also stops the
    scheduler and detokenizer processes SGLang spawns."""

    def __init__(
        self,
        args: list[str],
        launcher: str = "sglang-vc",
        log_path: Optional[Path] = None,
        timeout: float = 420.0,  # a start takes about 30 s on 2 idle cores
        env: Optional[dict] = None,
        wait: bool = True,
        port: Optional[int] = None,
    ):
        """``wait=False`` returns once the process is spawned: call :meth:`wait_ready`
        (:func:`start_servers` starts several at once, on different ``port``s)."""
        self.port = port or free_port()
        self.timeout = timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = LAUNCHERS[launcher] + ["--port", str(self.port), "--host", "127.0.0.1", *args]
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-vc-{self.port}.log"
        self._log = open(self.log_path, "w")
        _wait_for_memory()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before serving:\n{self.log_tail()}"
                )
            if "error while attempting to bind" in self.log_tail(20):
                # uvicorn could not bind and SGLang's launcher then waits forever
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self._log.close()
                raise RuntimeError(f"server could not bind port {self.port}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not ready after {self.timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def generate(self, text=None, input_ids=None, timeout: float = 300, **sampling) -> dict:
        payload = {"sampling_params": {"temperature": 0, **sampling}}
        if text is not None:
            payload["text"] = text
        else:
            payload["input_ids"] = input_ids
        r = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def server_info(self) -> dict:
        return requests.get(self.url + "/server_info", timeout=30).json()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Signal the launcher; escalate to SIGKILL of the whole group if it hangs.

        SIGINT by default: the launcher stops its process tree at once, where SGLang's
        SIGTERM handler drains requests first and polls for that every 5 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_servers(configs: list[dict]) -> list[ServerProcess]:
    """Several servers started at once (each ``configs`` item: :class:`ServerProcess`'s
    keyword arguments): a start is mostly one process importing and loading, so two
    overlap on two cores. All are stopped if one fails to start."""
    ports = free_ports(len(configs))
    servers = []
    try:
        for config, port in zip(configs, ports):
            servers.append(ServerProcess(**config, wait=False, port=port))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop(signal.SIGKILL)
        raise
    return servers
