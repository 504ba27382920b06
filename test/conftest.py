"""Shared fixtures: the prepared embedded model and real servers started on it.

Servers are expensive on 2 cores (10-20 s to start), so one plain server is shared by the
whole session; tests that need other flags start their own.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from sglang_vc.testing.server import ServerProcess


@pytest.fixture(scope="session")
def model_dir() -> str:
    from sglang_vc import models

    return models.resolve(models.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """The default server: no --model-path (serves the embedded default), float32."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "20000"], log_path=log)
    yield proc
    proc.stop()


def real_text_passages(n: int, words: int = 120) -> list[str]:
    """Passages of real English text that every CPython install carries: its license,
    and the docstrings of a few stdlib modules."""
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
