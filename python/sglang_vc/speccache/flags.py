"""SpecCache's flags (``--speccache-*``), registered as a flag group.

Any of them turns SpecCache's server path on: prompts marked with the separator are
served by reusing their chunks' KV from the radix tree and recomputing the selected
tokens (the ``vc_speccache`` attention backend over the ``speccache`` radix cache, which
the launcher then selects). Other prompts are served as usual."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Optional

from sglang_vc.config import ConfigError, FlagGroup, register_flag_group

from .names import (ATTENTION_BACKEND, DEFAULT_RATIO, DEFAULT_SELECTOR, DEFAULT_SEPARATOR, DEFAULT_SPEC_MODEL,
                    GROUP, RADIX_CACHE_BACKEND)


@dataclass(frozen=True)
class SpecCacheSettings:
    selector: str = DEFAULT_SELECTOR
    ratio: float = DEFAULT_RATIO
    spec_model: str = DEFAULT_SPEC_MODEL
    separator: str = DEFAULT_SEPARATOR


def check_selector(name: str) -> str:
    from .selectors import SELECTORS

    name = str(name).lower()
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(sorted(SELECTORS))}")
    return name


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"the recompute ratio must be a number in [0, 1], got {ratio!r}")
    return float(ratio)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SpecCache (RAG chunk KV reuse with selective recompute)")
    g.add_argument("--speccache-selector", default=None,
                   help=f"SpecCache: how the recomputed chunk tokens are chosen: epic (each chunk's "
                        f"first tokens), speccache (the small model's importance, the paper's), "
                        f"cacheblend (the target's first-layer KV deviation), random, full-reuse, "
                        f"full-recompute (default {DEFAULT_SELECTOR}, measured best: docs/speccache.md)")
    g.add_argument("--speccache-ratio", type=float, default=None,
                   help=f"SpecCache: fraction of the chunk tokens recomputed (default {DEFAULT_RATIO})")
    g.add_argument("--speccache-spec-model", default=None,
                   help=f"SpecCache: built-in model that scores the tokens (default {DEFAULT_SPEC_MODEL}; "
                        "see python -m sglang_vc.models list)")
    g.add_argument("--speccache-separator", default=None,
                   help=f"SpecCache: the string that marks retrieved chunks in a prompt "
                        f"(default {DEFAULT_SEPARATOR!r})")


def from_cli_args(args: argparse.Namespace) -> Optional[dict]:
    given = {"selector": args.speccache_selector, "ratio": args.speccache_ratio,
             "spec_model": args.speccache_spec_model, "separator": args.speccache_separator}
    if all(v is None for v in given.values()):
        return None
    settings = {k: v for k, v in given.items() if v is not None}
    for key, check in (("selector", check_selector), ("ratio", check_ratio)):
        if key in settings:
            try:
                settings[key] = check(settings[key])
            except ValueError as exc:
                raise ConfigError(f"--speccache-{key}: {exc}") from None
    if "separator" in settings and not settings["separator"].strip():
        raise ConfigError("--speccache-separator must be a non-blank string")
    if "spec_model" in settings:
        from sglang_vc import models

        if settings["spec_model"] not in models.list_models():
            raise ConfigError(f"--speccache-spec-model: unknown built-in model {settings['spec_model']!r}; "
                              f"known: {', '.join(models.list_models())}")
    return settings


def settings_of(raw: Optional[dict]) -> Optional[SpecCacheSettings]:
    return None if raw is None else SpecCacheSettings(**raw)


def describe(raw: dict) -> dict:
    return asdict(SpecCacheSettings(**raw))


def backend_choice(raw: Optional[dict]):
    """SpecCache prefills with the ``vc_speccache`` attention backend over the
    ``speccache`` radix cache (a :class:`~sglang_vc.kvruntime.select.BackendChoice`)."""
    from sglang_vc.kvruntime.select import BackendChoice

    if raw is None:
        return None
    return BackendChoice(ATTENTION_BACKEND, RADIX_CACHE_BACKEND, "--speccache-* (SpecCache)")


register_flag_group(FlagGroup(GROUP, add_cli_args, from_cli_args, describe))
