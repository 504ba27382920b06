"""Real English text that every CPython install carries (its license, and the docstrings
of a few stdlib modules): prompts for the tests and the small benchmarks, with nothing
downloaded."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def real_text_passages(n: int, words: int = 120) -> list[str]:
    """``n`` passages of ``words`` words each, spread over the text."""
    import argparse
    import collections
    import json as json_module
    import textwrap

    sources = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"]
    texts = [p.read_text() for p in sources if p.exists()]
    texts += [m.__doc__ for m in (argparse, collections, json_module, textwrap) if m.__doc__]
    all_words = " ".join(texts).split()
    step = max(words, len(all_words) // max(n, 1))
    return [" ".join(all_words[i * step : i * step + words]) for i in range(n)]
