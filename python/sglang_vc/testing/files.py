"""Waiting for a storage backend's asynchronous writes (HiCache's ``file`` backend writes
one file per page in its own threads), shared by the tests and the benchmarks."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for_files(folder: Path, at_least: int, timeout: float = 60.0, quiet_s: float = 1.0) -> int:
    """Wait until ``folder`` holds at least ``at_least`` files and its count has held
    still for ``quiet_s``; the count. A timeout is an error."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = sum(1 for _ in folder.iterdir())
        if n != last:
            last, since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - since > quiet_s:
            return n
        time.sleep(0.2)
    raise RuntimeError(f"{folder} holds {last} files after {timeout} s, expected at least {at_least}")
