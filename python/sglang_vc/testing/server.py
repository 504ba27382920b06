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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess in its own process group, so that stopping it also stops the
    scheduler and detokenizer processes SGLang spawns."""

    def __init__(
        self,
        args: list[str],
        launcher: str = "sglang-vc",
        log_path: Optional[Path] = None,
        timeout: float = 180.0,  # a start takes about 30 s on 2 cores
        env: Optional[dict] = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = LAUNCHERS[launcher] + ["--port", str(self.port), "--host", "127.0.0.1", *args]
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-vc-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before serving:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

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
