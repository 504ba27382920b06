"""Shared fixtures: the prepared embedded model and real servers started on it.

Servers are expensive on 2 cores (20-40 s to start), so one plain server is shared by the
whole session (one per pytest-xdist worker); tests that need other flags start their own.

``make test`` runs two pytest-xdist workers, one test module each at a time
(``--dist loadfile``: a module's servers start once). Each worker, and every server it
starts, computes on one thread (``OMP_NUM_THREADS=1``): two workers with torch's default
thread count each (one per core) oversubscribed the 2 cores and made the suite slower,
30 min against 22 serially.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # before any server starts (they inherit it) and before this process computes
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

from sglang_vc.testing.server import ServerProcess
from sglang_vc.testing.text import real_text_passages  # noqa: F401  (tests import it from here)


# The modules whose servers decode the longest, slowest first: collected first, so that
# under ``--dist loadfile`` the two workers start them early and the short modules fill
# the end, rather than one worker finishing a long module alone.
LONG_MODULES = ("test_vericache_serving", "test_vericache_in_pool", "test_vericache_finish", "test_vericache_fallbacks", "test_vericache_remote",
                "test_vericache_under_load", "test_vericache_tiering", "test_lossy_serving",
                "test_evicpress_dropping", "test_evicpress_serving", "test_lifecycle", "test_vericache_syncs",
                "test_evicpress_tree", "test_speccache_serving", "test_specache_serving", "test_server_basic")


# Module-scoped server fixtures parametrized indirectly (one server per value): pytest keeps
# one value of a fixture at a time, so tests that alternate values start a server again
# each time they come back to one (two test functions over X = 1, 4, 40 started the X = 1
# and X = 40 servers twice).
GROUPED_PARAMS = ("vc_x",)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    first: dict[tuple, int] = {}  # (module, fixture, value) -> where the value is first used

    def key(pair):
        i, item = pair
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in GROUPED_PARAMS:
            if name in params:  # with the first test of its value, in the order collected
                return rank.get(item.path.stem, len(LONG_MODULES)), first.setdefault(
                    (item.path, name, params[name]), i), i
        return rank.get(item.path.stem, len(LONG_MODULES)), i, i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]  # in-module order kept otherwise


def pytest_collection_finish(session):
    """The last test of its module that uses each fixture, in the order the tests run
    (after every reordering: pytest groups a module fixture's parameters)."""
    for item in session.items:
        for name in item.fixturenames:
            _LAST_USE[(str(item.path), name)] = item.nodeid


# A module-scoped server stays up until its module ends, pytest's rule: a module with
# five servers, beside the other worker's, outgrew the CI machine's 24 GiB (the kernel
# killed servers mid-run). A fixture that registers its server here stops it once the
# last test of the module that uses it is done.
_LAST_USE: dict[tuple[str, str], str] = {}
_RELEASE: dict[str, list] = {}


def release_after_last_use(request, proc) -> None:
    """Stop ``proc`` (a module fixture's server) after the module's last test using it."""
    last = _LAST_USE.get((str(request.node.path), request.fixturename))
    if last is not None:
        _RELEASE.setdefault(last, []).append(proc)


def pytest_runtest_teardown(item, nextitem):
    for proc in _RELEASE.pop(item.nodeid, []):
        proc.stop()


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


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """A stand-in CUDA platform: ``sgl_kernel_ext`` takes its Triton path on CPU tensors
    (the kernels in Triton's interpreter), as it would on a GPU. Skips where the
    interpreter cannot run the kernels (``dispatch.interpreter_problem``)."""
    import sgl_kernel_ext as ext

    if ext.dispatch.interpreter_problem():
        pytest.skip(ext.dispatch.interpreter_problem())
    monkeypatch.delenv(ext.dispatch.ENV, raising=False)
    monkeypatch.setattr(ext.dispatch, "is_cuda_tensor", lambda t: True)


def bad_token_requests(vocab_size: int) -> dict[str, tuple[str, dict, str]]:
    """Requests whose token ids are not tokens of the model (or whose ``custom_params`` is
    not an object), each ``(path, body, text the 400 must name)``: every server mode
    refuses them before the scheduler sees them."""
    greedy = {"max_new_tokens": 2, "temperature": 0}
    return {
        "huge-id": ("/generate", {"input_ids": [1, 2, 1_000_000_000], "sampling_params": greedy}, "1000000000"),
        "negative-id": ("/generate", {"input_ids": [-3, 5], "sampling_params": greedy}, "-3"),
        "vocab-size-id": ("/generate", {"input_ids": [5, vocab_size], "sampling_params": greedy}, str(vocab_size)),
        "batch-id": ("/generate", {"input_ids": [[5, 6], [7, vocab_size + 9]], "sampling_params": greedy},
                     str(vocab_size + 9)),
        "completion-token-prompt": ("/v1/completions", {"model": "default", "prompt": [5, 6, -1], "max_tokens": 2},
                                    "-1"),
        "custom-params-not-object": ("/generate", {"text": "Hello", "sampling_params": {
            **greedy, "custom_params": "vc_compressor=none"}}, "custom_params"),
    }


def assert_refused_then_serves(server, path: str, body: dict, needle: str) -> None:
    """The request gets a 400 that names ``needle``, and the server answers the next one."""
    import requests

    r = requests.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, (r.status_code, r.text)
    assert needle in r.text, r.text
    ok = requests.post(server.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3, ok.text
