"""An offloaded request's KV stays reusable (#80): SGLang's own logprob-consistency
helpers (``sglang/test/kl_test_utils.py``: the prefill cache hit and the decode cache hit)
against VERICACHE servers that offload every request, with real-text prompts in place of
the helpers' dataset (no hub here).

Slow (two servers, each helper flushes the cache and prefills everything twice): run with
``pytest -m slow test/test_vericache_prefix_reuse.py``. The default run's check is
``test_vericache_serving::test_a_second_turn_reuses_the_offloaded_first_turns_prompt_and_answer``.
"""

from __future__ import annotations

import pytest
import requests

from conftest import real_text_passages, release_after_last_use
from sglang_vc.testing.server import ServerProcess
from test_vericache_serving import ALWAYS, META

pytestmark = pytest.mark.slow

# the helpers' average-KL bound (#80 asks < 1e-3)
KL = 1e-3


@pytest.fixture(scope="module", params=["snapkv", "specache"])
def offloading(request, tmp_path_factory):
    """A server that offloads every request: a token-dropping drafter (SnapKV 0.25) and
    the default one (SpeCache 2-bit)."""
    drafter = (["--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25"] if request.param == "snapkv" else [])
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "40000", "--speculative-algorithm", "VERICACHE",
                          "--speculative-num-draft-tokens", "4", *ALWAYS, *drafter],
                         log_path=tmp_path_factory.mktemp(f"prefix_reuse_{request.param}") / "server.log")
    release_after_last_use(request, proc)
    yield proc, request.param
    proc.stop()


def _prompts(tokenizer) -> list[list[int]]:
    """8 prompts of 1.5k-2.9k tokens of real text, each from its own place in it (no two
    share a prefix)."""
    ids = tokenizer(" ".join(real_text_passages(40, words=400)))["input_ids"]
    ids = ids * (1 + 8 * 3000 // len(ids))
    return [ids[600 * i: 600 * i + 1500 + 200 * i] for i in range(8)]


def _counters(proc) -> dict:
    return requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]["vericache"]


@pytest.mark.parametrize("helper", ["prefill_cache_hit", "decode_cache_hit"])
def test_sglangs_cache_hit_helpers_pass_under_offload(offloading, tokenizer, model_dir, monkeypatch, helper):
    from sglang.test import kl_test_utils

    proc, drafter = offloading
    monkeypatch.setattr(kl_test_utils, "get_input_ids", lambda **kw: _prompts(tokenizer))
    before = _counters(proc)
    fn = getattr(kl_test_utils, f"test_input_output_logprobs_match_{helper}_helper")
    fn(proc.url, {str(model_dir): {"kl_div": KL}}, str(model_dir), max_samples=8, max_new_tokens=64)
    after = _counters(proc)
    # the requests were compressed and their full KV went to the tree when they finished
    assert after["finished_kv_kept"] > before.get("finished_kv_kept", 0), after
    if helper == "decode_cache_hit":  # the first turn drafted (a prefill-only request drafts nothing)
        assert after["verify_rounds"] > before.get("verify_rounds", 0), after


# Default flags: the policy offloads only where memory binds. 8 prompts of 300 tokens that
# decode 512 tokens each need 6.5k tokens at full KV, more than this pool, so the policy
# offloads some; their prompts and answers (6.5k) nearly fit it, so the tree can keep most
# for the helpers' second pass. (8 prompts of 1.5-2.9k tokens on a pool that binds cannot:
# measured 0/8 and 1/8 hits on 14k tokens, the prompts alone being 17.6k.)
BINDING_POOL, SHORT_PROMPT, LONG_ANSWER = 6000, 300, 512


@pytest.fixture(scope="module")
def binding(request, tmp_path_factory):
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", str(BINDING_POOL), "--speculative-algorithm",
                          "VERICACHE"], log_path=tmp_path_factory.mktemp("prefix_reuse_default") / "server.log")
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


@pytest.mark.parametrize("helper", ["prefill_cache_hit", pytest.param("decode_cache_hit", marks=pytest.mark.xfail(
    strict=True, reason="not built (#80): an offloaded request's full KV goes back into its device row when it ends, "
    "and on a pool that binds there is likely no room while the others run (3/8 hits measured); HiCache host "
    "nodes would keep it on the host"))])
def test_sglangs_cache_hit_helpers_pass_where_the_default_policy_offloads(binding, tokenizer, model_dir, monkeypatch,
                                                                           helper):
    from sglang.test import kl_test_utils

    ids = tokenizer(" ".join(real_text_passages(40, words=400)))["input_ids"]
    prompts = [ids[400 * i: 400 * i + SHORT_PROMPT] for i in range(8)]
    assert all(len(p) == SHORT_PROMPT for p in prompts)
    monkeypatch.setattr(kl_test_utils, "get_input_ids", lambda **kw: prompts)
    before = _counters(binding)
    fn = getattr(kl_test_utils, f"test_input_output_logprobs_match_{helper}_helper")
    fn(binding.url, {str(model_dir): {"kl_div": KL}}, str(model_dir), max_samples=8, max_new_tokens=LONG_ANSWER)
    after = _counters(binding)
    if helper == "decode_cache_hit":  # the first turn bound the pool: the policy offloaded, and kept the KV
        assert after["finished_kv_kept"] > before.get("finished_kv_kept", 0), after
        assert after["verify_rounds"] > before.get("verify_rounds", 0), after
