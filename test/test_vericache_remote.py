"""VeriCache's remote prefix caching, path P1: a remote server drafts from the KIVI 4-bit
storage copy of a stored prefix and a local server verifies every round.

Default suite: one two-server test on SGLang's ``file`` storage backend. The local
server computes the context (its storage copies go to the store) and is the full-KV
reference; the remote server (``VERICACHE_REMOTE``) loads the compressed copy, answers a
batch that mixes lossy-prefix requests and exact ones, token for token as the local
server does, and fails a request cleanly once the local server is gone.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.server import ServerProcess

CTX = 400  # tokens of the stored prefix


def _common(store) -> list[str]:
    return ["--dtype", "float32", "--max-total-tokens", "4096", "--enable-hierarchical-cache",
            "--hicache-ratio", "2", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--radix-cache-backend", "evicpress", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(store)}),
            "--evicpress-no-profiler", "--evicpress-auto-context-tokens", "0",
            "--evicpress-host-bandwidth", "10", "--evicpress-disk-bandwidth", "1",
            "--evicpress-decompress-bandwidth", "5", "--evicpress-prefill-tokens-per-s", "200"]


def _post(url, body, timeout=300):
    return requests.post(url + "/generate", json=body, timeout=timeout)


def test_remote_server_drafts_from_the_compressed_copy_and_the_local_server_verifies(tmp_path, tokenizer):
    from conftest import real_text_passages

    store = tmp_path / "store"
    passages = real_text_passages(6, words=500)
    ctx_ids = tokenizer(passages[0])["input_ids"][:CTX]
    questions = ["\n\nQuestion: What is this text about?\nAnswer:", "\n\nSummarize the text above in one line:",
                 "\n\nThe most important word in this text is"]
    lossy_prompts = [ctx_ids + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    exact_prompts = [tokenizer(p[:300])["input_ids"] for p in passages[3:5]]  # no stored prefix
    n_new = 24

    local = ServerProcess(_common(store), log_path=tmp_path / "local.log", timeout=420)
    try:
        epx.api(local, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": ctx_ids})
        local.generate(input_ids=lossy_prompts[0], max_new_tokens=1)  # computes it: copies go to the store
        described = epx.api(local, "GET", "/evicpress/contexts/doc")
        assert described["storage_copies"] == ["full", "kivi@4b"], described
        # the full-KV reference, from the local server
        ref = {i: local.generate(input_ids=p, max_new_tokens=n_new) for i, p in enumerate(lossy_prompts + exact_prompts)}
        before_local = local.server_info()["sglang_vc"]["counters"].get("evicpress", {})

        remote_args = _common(store) + [
            "--speculative-algorithm", "VERICACHE_REMOTE", "--speculative-num-draft-tokens", "4",
            "--vc-remote-verifier", local.url, "--vc-remote-timeout", "30",
            "--evicpress-load-copy", "kivi@4b", "--evicpress-storage-copies", "none"]
        with ServerProcess(remote_args, log_path=tmp_path / "remote.log", timeout=420) as remote:
            epx.api(remote, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": ctx_ids})
            # one batch mixing lossy-prefix and exact requests, in both orders
            order = [0, 3, 1, 4, 2]
            outs: dict[int, dict] = {}

            def ask(i):
                p = (lossy_prompts + exact_prompts)[i]
                outs[i] = _post(remote.url, {"input_ids": p, "sampling_params": {"temperature": 0,
                                                                                  "max_new_tokens": n_new}}).json()

            threads = [threading.Thread(target=ask, args=(i,)) for i in order]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in order:
                got, want = outs[i], ref[i]
                assert got["output_ids"] == want["output_ids"], (i, got["output_ids"], want["output_ids"])
                assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], i
            info = remote.server_info()["sglang_vc"]["counters"]
            rv, ep = info["vericache_remote"], info["evicpress"]
            # the compressed copy, not the full KV, came over the remote's link
            ctx_remote = epx.api(remote, "GET", "/evicpress/contexts/doc")
            assert ep.get("shared_found") == 1 and ctx_remote["placement"]["config"] == "kivi@4b", ctx_remote
            assert 0 < ep["bytes_loaded_disk"] < 0.4 * CTX * 46080, ep  # float32 KV: 46080 B/token
            # every lossy request's tokens were verified on the local server
            assert rv["first_tokens_verified"] >= 3 and rv["verify_rounds"] >= 3 * (n_new // 4), rv
            assert rv["verify_calls"] == rv["first_tokens_verified"] + rv["verify_rounds"], rv
            assert rv.get("verify_call_failures", 0) == 0 and rv["exact_rows"] > 0, rv
            assert rv["accepted"] < rv["drafted"], rv  # the copy is lossy: drafts were rejected
            for i in range(3):
                meta = outs[i]["meta_info"]["sglang_vc_vericache"][0]
                assert meta["remote_verifier"] == local.url and meta["committed"] >= n_new, meta  # the last round may overshoot
            for i in (3, 4):
                assert not any(outs[i]["meta_info"].get("sglang_vc_vericache") or []), outs[i]["meta_info"]  # exact: never verified
            # ... counted on the local side too: the verify requests hit its tree
            after_local = local.server_info()["sglang_vc"]["counters"].get("evicpress", {})
            assert after_local.get("hits_device", 0) - before_local.get("hits_device", 0) >= rv["verify_calls"], (
                before_local, after_local)

            # a local server that is gone: the lossy request fails with 503, never unverified tokens
            local.stop()
            r = _post(remote.url, {"input_ids": lossy_prompts[1], "sampling_params": {"temperature": 0,
                                                                                      "max_new_tokens": n_new}})
            assert "remote verify failed" in r.text, r.text[:500]
            # an exact request is still served
            assert _post(remote.url, {"input_ids": exact_prompts[0], "sampling_params": {
                "temperature": 0, "max_new_tokens": n_new}}).json()["output_ids"] == ref[3]["output_ids"]
            # sampling is refused, not silently greedy
            r = _post(remote.url, {"input_ids": lossy_prompts[0], "sampling_params": {"temperature": 0.7}})
            assert r.status_code == 400 and "greedy tokens only" in r.text, r.text
    finally:
        local.stop()


@pytest.mark.parametrize("argv, message", [
    (["--vc-remote-verifier", "local:30000"], "http(s) URL"),
    (["--vc-remote-verifier", "http://h:1", "--vc-remote-timeout", "0"], "--vc-remote-timeout"),
])
def test_remote_flag_values_are_usage_errors(argv, message, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_remote_algorithm_needs_a_verifier_and_evicpress_and_resolves_its_flags():
    from sglang_vc.config import ConfigError
    from sglang_vc.launch_server import parse_args
    from sglang_vc.vericache import remote_spec

    storage = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    _, sa = parse_args(["--speculative-algorithm", "VERICACHE_REMOTE", "--radix-cache-backend", "evicpress", *storage])
    with pytest.raises(ConfigError, match="--vc-remote-verifier"):
        remote_spec.validate_server_args(sa)
    _, sa = parse_args(["--speculative-algorithm", "VERICACHE_REMOTE", "--vc-remote-verifier", "http://h:1"])
    with pytest.raises(ConfigError, match="--radix-cache-backend evicpress"):
        remote_spec.validate_server_args(sa)
    _, sa = parse_args(["--speculative-algorithm", "VERICACHE_REMOTE", "--vc-remote-verifier", "http://h:1",
                        "--radix-cache-backend", "evicpress", "--evicpress-load-copy", "kivi@4b", *storage])
    remote_spec.validate_server_args(sa)
    remote_spec.handle_server_args(sa)
    assert sa.speculative_num_draft_tokens == sa.speculative_num_steps == 8  # the default X
    assert sa.disable_overlap_schedule and sa.speculative_eagle_topk == 1 and not sa.enable_mixed_chunk
    assert sa.radix_cache_backend == "evicpress" and sa.attention_backend != "vc_verify"


def test_the_launcher_refuses_a_remote_server_without_a_verifier():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sglang_vc.launch_server", "--speculative-algorithm",
                        "VERICACHE_REMOTE"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and "--vc-remote-verifier" in r.stderr, r.stderr[-2000:]
