"""SGLang's hierarchical cache (host-memory tier) on the CPU platform.

Slow (a server of its own): the default suite covers SGLang's host hits on this platform
through ``test_speccache_tiers`` (a prefix evicted to the host comes back, with the same
answer; and the storage tier)."""

from __future__ import annotations

import pytest

from conftest import real_text_passages
from sglang_vc.testing.server import ServerProcess

DEVICE_TOKENS = 2048


@pytest.fixture(scope="module")
def hicache_server(model_dir, tmp_path_factory):
    args = [
        "--model-path", model_dir, "--dtype", "float32",
        "--max-total-tokens", str(DEVICE_TOKENS),
        "--enable-hierarchical-cache", "--hicache-size", "1",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
    ]
    proc = ServerProcess(args, log_path=tmp_path_factory.mktemp("hicache") / "server.log")
    yield proc
    proc.stop()


@pytest.mark.slow
def test_evicted_prefix_comes_back_from_host(hicache_server, tokenizer):
    passages = real_text_passages(8, words=400)
    prompts = [tokenizer(p)["input_ids"][:500] for p in passages]
    first = hicache_server.generate(input_ids=prompts[0], max_new_tokens=8)
    # Enough other prefixes to push the first one out of the device pool.
    for ids in prompts[1:]:
        hicache_server.generate(input_ids=ids, max_new_tokens=8)
    again = hicache_server.generate(input_ids=prompts[0], max_new_tokens=8)
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] > 0, f"expected a host-tier hit, got {details}\n{hicache_server.log_tail()}"
    assert again["output_ids"] == first["output_ids"]
