"""The CPU image end to end: ``docker/build-local.sh`` builds docker/Dockerfile.cpu, runs it,
asks one ``/generate`` and one ``/v1/chat/completions`` and stops the container.

Slow (a few minutes with the build cached, 5-20 without) and it needs a container
engine: it skips only where there is neither a ``docker`` nor a ``podman`` binary. It
shells out to the script and imports nothing of the project.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "build-local.sh"
TIMEOUT_S = 3600  # a build without cache downloads torch and the pinned set


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(lines: list[str], prefix: str) -> dict:
    found = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    assert found, f"the script printed no {prefix!r} line"
    return json.loads(found[0])


@pytest.mark.slow
def test_cpu_image_builds_serves_and_answers():
    if not (shutil.which("docker") or shutil.which("podman")):
        pytest.skip("neither docker nor podman is installed: no image can be built here")
    env = dict(os.environ, PORT=str(_free_port()))
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "OK", (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")

    generated = _answer(lines, "generate: ")
    assert generated["text"].startswith(" Paris"), generated  # greedy, 8 new tokens
    assert generated["meta_info"]["completion_tokens"] == 8, generated

    chat = _answer(lines, "chat: ")
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and "Paris" in message["content"], chat
    assert chat["model"] == "smollm2-135m", chat
    assert "stopped: exit code 0" in proc.stderr, proc.stderr[-2000:]  # a clean SIGTERM stop
