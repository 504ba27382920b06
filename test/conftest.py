"""Shared fixtures: the prepared embedded model and real servers started on it.

Servers are expensive on 2 cores (10-20 s to start), so one plain server is shared by the
whole session; tests that need other flags start their own.
"""

from __future__ import annotations

import pytest

from sglang_vc.testing.server import ServerProcess
from sglang_vc.testing.text import real_text_passages  # noqa: F401  (tests import it from here)


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
