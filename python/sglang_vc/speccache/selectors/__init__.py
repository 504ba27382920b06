"""Token selectors by name (``--speccache-selector``); see :mod:`.base` for the contract."""

from __future__ import annotations

from .base import Chunks, Need, SelectionInput, Selector
from .cacheblend import CacheBlend
from .simple import Epic, FullRecompute, FullReuse, Random
from .speccache import SpecCacheSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (SpecCacheSelector, CacheBlend, Epic, Random, FullReuse, FullRecompute)
}


def get_selector(name: str) -> Selector:
    cls = SELECTORS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(sorted(SELECTORS))}")
    return cls()


__all__ = ["Chunks", "Need", "SelectionInput", "Selector", "SELECTORS", "get_selector"]
