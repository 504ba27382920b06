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
# offloads some. The second turn (813 tokens each, and 512 more to decode) cannot all be
# cached and running at once on any server: a plain SGLang server on this pool hits 3 of 8
# (measured), under the decode helper's bar of 5. There the check is the plain server's
# hits, on the same pool, with the same requests.
BINDING_POOL, SHORT_PROMPT, LONG_ANSWER = 6000, 300, 512


@pytest.fixture(scope="module")
def binding(request, tmp_path_factory):
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", str(BINDING_POOL), "--speculative-algorithm",
                          "VERICACHE"], log_path=tmp_path_factory.mktemp("prefix_reuse_default") / "server.log")
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def plain_binding(request, tmp_path_factory):
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", str(BINDING_POOL)],
                         log_path=tmp_path_factory.mktemp("prefix_reuse_plain") / "server.log")
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def _short_prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer(" ".join(real_text_passages(40, words=400)))["input_ids"]
    prompts = [ids[400 * i: 400 * i + SHORT_PROMPT] for i in range(8)]
    assert all(len(p) == SHORT_PROMPT for p in prompts)
    return prompts


def test_sglangs_prefill_cache_hit_helper_passes_where_the_default_policy_offloads(binding, tokenizer, model_dir,
                                                                                    monkeypatch):
    from sglang.test import kl_test_utils

    prompts = _short_prompts(tokenizer)
    monkeypatch.setattr(kl_test_utils, "get_input_ids", lambda **kw: prompts)
    kl_test_utils.test_input_output_logprobs_match_prefill_cache_hit_helper(
        binding.url, {str(model_dir): {"kl_div": KL}}, str(model_dir), max_samples=8, max_new_tokens=LONG_ANSWER)


def test_decode_cache_hits_where_the_default_policy_offloads_are_the_plain_servers(binding, plain_binding, tokenizer,
                                                                                  model_dir, monkeypatch):
    """SGLang's decode cache-hit helper against both servers on the same binding pool: the
    first turn offloads on the VERICACHE server and keeps the offloaded KV; the second
    turn's cached tokens are at least the plain server's, in sum and in hits; the hits' logprobs match a fresh prefill's (KL under 1e-3)."""
    from sglang.test import kl_test_utils

    prompts = _short_prompts(tokenizer)
    monkeypatch.setattr(kl_test_utils, "get_input_ids", lambda **kw: prompts)
    monkeypatch.setenv("SGLANG_TEST_SKIP_CACHE_HIT_ASSERT", "1")  # the bar is the plain server's, below
    generate, cached = kl_test_utils._generate, {}
    for name, proc in (("vericache", binding), ("plain", plain_binding)):
        calls = []
        monkeypatch.setattr(kl_test_utils, "_generate", lambda *a, **kw: calls.append(generate(*a, **kw)) or calls[-1])
        before = _counters(proc) if name == "vericache" else None
        kl_test_utils.test_input_output_logprobs_match_decode_cache_hit_helper(
            proc.url, {str(model_dir): {"kl_div": KL}}, str(model_dir), max_samples=8, max_new_tokens=LONG_ANSWER)
        cached[name] = [r["meta_info"]["cached_tokens"] for r in calls[1]]  # the second turn's
        if before is not None:  # the first turn bound the pool: the policy offloaded, and kept the KV
            after = _counters(proc)
            assert after["offload_chosen"] > before.get("offload_chosen", 0), after
            assert after["finished_kv_kept"] > before.get("finished_kv_kept", 0), after
            assert after["verify_rounds"] > before.get("verify_rounds", 0), after
    hits = {name: sum(c > SHORT_PROMPT + 1 for c in got) for name, got in cached.items()}
    print("second-turn cached tokens:", cached)
    assert hits["plain"] >= 1, cached  # (else the comparison is vacuous)
    assert hits["vericache"] >= hits["plain"] and sum(cached["vericache"]) >= sum(cached["plain"]), cached


# Every request offloaded on a pool its 8 requests' full KV (2.9k tokens) does not fit:
# requests that end while the others hold the pool find no room for their compressed
# span, so their full KV is held on the host and enters the tree after a release
# (``kvruntime/held_rows.py``; measured: 3 held, 3 inserted later, 3/8 second-turn hits).
TIGHT_POOL, TIGHT_ANSWER = 1800, 64


@pytest.fixture(scope="module")
def tight(request, tmp_path_factory):
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", str(TIGHT_POOL), "--speculative-algorithm",
                          "VERICACHE", *ALWAYS], log_path=tmp_path_factory.mktemp("prefix_reuse_tight") / "server.log")
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def test_an_offloaded_requests_kv_with_no_room_at_its_end_is_held_and_enters_the_tree(tight, tokenizer, model_dir,
                                                                                      monkeypatch):
    """SGLang's decode cache-hit helper against a forced-offload server on a tight pool:
    some requests' full KV is held and inserted after a release (the counters), and the
    second turn's hits read exact KV (the helper's KL under 1e-3)."""
    from sglang.test import kl_test_utils

    monkeypatch.setattr(kl_test_utils, "get_input_ids", lambda **kw: _short_prompts(tokenizer))
    monkeypatch.setenv("SGLANG_TEST_SKIP_CACHE_HIT_ASSERT", "1")  # the pool cannot keep every turn
    generate, calls = kl_test_utils._generate, []
    monkeypatch.setattr(kl_test_utils, "_generate", lambda *a, **kw: calls.append(generate(*a, **kw)) or calls[-1])
    before = _counters(tight)
    kl_test_utils.test_input_output_logprobs_match_decode_cache_hit_helper(
        tight.url, {str(model_dir): {"kl_div": KL}}, str(model_dir), max_samples=8, max_new_tokens=TIGHT_ANSWER)
    after = _counters(tight)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("finished_kv_held", "finished_kv_kept_later",
                                                              "finished_kv_not_kept")}
    cached = [r["meta_info"]["cached_tokens"] for r in calls[1]]
    print("held-rows counters:", grew, "second-turn cached tokens:", cached)
    assert grew["finished_kv_held"] >= 1 and grew["finished_kv_kept_later"] >= 1, grew
    assert sum(c > SHORT_PROMPT + 1 for c in cached) >= 1, cached
