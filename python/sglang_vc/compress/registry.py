"""Name -> compressor class. ``get_compressor`` returns a fresh instance (online methods
keep per-request state, so instances are not shared)."""

from __future__ import annotations

from typing import Any

from .base import Compressor
from .h2o import H2O
from .keydiff import KeyDiff
from .kivi import KIVI
from .kivi1 import KIVI1
from .knorm import KNorm
from .kvzip import KVzip
from .snapkv import SnapKV
from .specache_copy import SpeCacheCopy
from .streamingllm import StreamingLLM

_REGISTRY: dict[str, type[Compressor]] = {}


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Register a compressor class under ``cls.name`` (usable as a decorator)."""
    name = cls.name.lower()
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"compressor {name!r} is already registered ({_REGISTRY[name].__name__})")
    _REGISTRY[name] = cls
    return cls


for _cls in (StreamingLLM, KNorm, SnapKV, KeyDiff, H2O, KVzip, KIVI, KIVI1, SpeCacheCopy):
    register_compressor(_cls)


def list_compressors() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def standalone_compressors() -> list[str]:
    """Registered names whose payload is read alone (not ``needs_full_rows``): those a
    lossy server, EvicPress or the fidelity lab can serve by themselves."""
    return [n for n in list_compressors() if not _REGISTRY[n].needs_full_rows]


def get_compressor(name: str, **config: Any) -> Compressor:
    """A new compressor ``name`` (case-insensitive) built with ``config`` (its dataclass fields)."""
    cls = _REGISTRY.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(list_compressors())}")
    return cls(**config)
