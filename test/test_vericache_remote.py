"""VeriCache's remote prefix caching: a remote server drafts from the KIVI 4-bit storage
copy of a stored prefix and a local server verifies (path P1); or the full copy streams
to the remote server meanwhile, which goes on alone once it has arrived (path P2).

Default suite: one two-server test on SGLang's ``file`` storage backend (P1). The local
server computes the context (its storage copies go to the store) and is the full-KV
reference; the remote server (``VERICACHE_REMOTE``) loads the compressed copy, answers a
batch that mixes lossy-prefix requests and exact ones, token for token as the local
server does, and stays exact when its verifier fails mid-request (it reads the full
copy). The verifier is reached through a proxy in the test that fails on command, so
the failure lands at a pinned verify call, not at a time. Slow: the same with P2.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import requests

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.server import ServerProcess, free_ports

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


class VerifierProxy:
    """An HTTP proxy to the local server's ``/generate`` that answers 502 once
    ``fail_after`` more calls have passed (None: never). Counts the calls it forwarded."""

    def __init__(self, target: str):
        proxy = self
        self.fail_after: int | None = None
        self.forwarded = 0
        self.failed = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if proxy.fail_after is not None and proxy.fail_after <= 0:
                    proxy.failed += 1
                    self.send_response(502)
                    self.end_headers()
                    return
                if proxy.fail_after is not None:
                    proxy.fail_after -= 1
                r = requests.post(target + self.path, data=body, headers={"Content-Type": "application/json"},
                                  timeout=120)
                proxy.forwarded += 1
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_remote_server_drafts_from_the_compressed_copy_and_the_local_server_verifies(tmp_path, tokenizer):
    from conftest import real_text_passages

    store = tmp_path / "store"
    passages = real_text_passages(6, words=500)
    ctx_ids = tokenizer(passages[0])["input_ids"][:CTX]
    questions = ["\n\nQuestion: What is this text about?\nAnswer:", "\n\nSummarize the text above in one line:",
                 "\n\nThe most important word in this text is"]
    lossy_prompts = [ctx_ids + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    exact_prompts = [tokenizer(p[:300])["input_ids"] for p in passages[3:5]]  # no stored prefix
    # shares the context's first 40 tokens, then another text: less than half the context,
    # so no context match; the lossy copy's rows are not its to match
    overlap_prompt = ctx_ids[:40] + tokenizer(passages[5][:300], add_special_tokens=False)["input_ids"]
    prompts = lossy_prompts + exact_prompts + [overlap_prompt]
    n_new = 24

    # the two servers start together (the starts overlap); the remote one is used later
    ports = free_ports(2)
    local = ServerProcess(_common(store), log_path=tmp_path / "local.log", timeout=420, wait=False, port=ports[0])
    proxy = VerifierProxy(local.url)
    remote_args = _common(store) + [
        "--speculative-algorithm", "VERICACHE_REMOTE", "--speculative-num-draft-tokens", "4",
        "--vc-remote-verifier", proxy.url, "--vc-remote-timeout", "30", "--vc-remote-path", "p1",
        "--evicpress-load-copy", "kivi@4b", "--evicpress-storage-copies", "none"]
    remote = ServerProcess(remote_args, log_path=tmp_path / "remote.log", timeout=420, wait=False, port=ports[1])
    try:
        local.wait_ready()
        remote.wait_ready()
        epx.api(local, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": ctx_ids})
        local.generate(input_ids=lossy_prompts[0], max_new_tokens=1)  # computes it: copies go to the store
        described = epx.api(local, "GET", "/evicpress/contexts/doc")
        assert described["storage_copies"] == ["full", "kivi@4b"], described
        # the full-KV reference, from the local server
        ref = {i: local.generate(input_ids=p, max_new_tokens=n_new) for i, p in enumerate(prompts)}
        before_local = local.server_info()["sglang_vc"]["counters"].get("evicpress", {})

        with remote:
            epx.api(remote, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": ctx_ids})
            # one batch mixing lossy-prefix and exact requests, in both orders
            order = [0, 3, 1, 4, 2]
            outs: dict[int, dict] = {}

            def ask(i):
                p = prompts[i]
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
            assert rv["requests_p1"] == 3 and not rv.get("full_copies_streamed"), rv
            for i in range(3):
                meta = outs[i]["meta_info"]["sglang_vc_vericache"][0]
                assert meta["remote_verifier"] == proxy.url and meta["committed"] >= n_new, meta  # the last round may overshoot
                assert meta["path"] == "P1", meta
            for i in (3, 4):
                assert not any(outs[i]["meta_info"].get("sglang_vc_vericache") or []), outs[i]["meta_info"]  # exact: never verified
            # ... counted on the local side too: the verify requests hit its tree
            after_local = local.server_info()["sglang_vc"]["counters"].get("evicpress", {})
            assert after_local.get("hits_device", 0) - before_local.get("hits_device", 0) >= rv["verify_calls"], (
                before_local, after_local)

            # a prompt sharing the context's opening (sent once the lossy copy is on the
            # device) matches none of its rows: an exact prefill, never verified
            got = _post(remote.url, {"input_ids": overlap_prompt, "sampling_params": {
                "temperature": 0, "max_new_tokens": n_new}}).json()
            assert got["output_ids"] == ref[5]["output_ids"], (got, ref[5]["output_ids"])
            assert got["meta_info"]["cached_tokens"] == 0, got["meta_info"]
            assert not any(got["meta_info"].get("sglang_vc_vericache") or []), got["meta_info"]

            # the verifier fails mid-request (after the first token and one round): the
            # remote reads the full copy at once and the request finishes exactly
            proxy.fail_after = 2
            got = _post(remote.url, {"input_ids": lossy_prompts[1], "sampling_params": {"temperature": 0,
                                                                                        "max_new_tokens": n_new}}).json()
            assert got["output_ids"] == ref[1]["output_ids"], (got, ref[1]["output_ids"])
            assert got["meta_info"]["finish_reason"] == ref[1]["meta_info"]["finish_reason"]
            rv = remote.server_info()["sglang_vc"]["counters"]["vericache_remote"]
            assert proxy.failed >= 1 and rv["verify_fallbacks"] == 1 and rv["switched_to_local"] >= 1, rv
            assert got["meta_info"]["sglang_vc_vericache"][0]["verify_rounds"] == 1, got["meta_info"]
            assert remote.server_info()["sglang_vc"]["counters"]["evicpress"].get("storage_copies_read") == 1
            # the prefix is exact on the remote now: a new request on it is never verified
            calls = rv["verify_calls"]
            got = _post(remote.url, {"input_ids": lossy_prompts[2], "sampling_params": {"temperature": 0,
                                                                                        "max_new_tokens": n_new}}).json()
            assert got["output_ids"] == ref[2]["output_ids"]
            assert remote.server_info()["sglang_vc"]["counters"]["vericache_remote"]["verify_calls"] == calls
            # sampling is refused, not silently greedy
            r = _post(remote.url, {"input_ids": lossy_prompts[0], "sampling_params": {"temperature": 0.7}})
            assert r.status_code == 400 and "greedy tokens only" in r.text, r.text
            r = _post(remote.url, {"input_ids": lossy_prompts[0], "cache_salt": "tenant-a",
                                   "sampling_params": {"temperature": 0}})
            assert r.status_code == 400 and "cache_salt" in r.text, r.text
    finally:
        proxy.close()
        remote.stop()
        local.stop()


@pytest.mark.slow  # a second cross-server storage run (the module's docstring); P1 is in the default run
def test_p2_streams_the_full_copy_and_the_remote_server_goes_on_alone(tmp_path, tokenizer):
    """Path P2: the remote server drafts from the 4-bit copy, verified by the local
    server, while the full copy streams over its (emulated) link; once it has arrived
    the requests are retracted and decode alone on the full KV. And a verify that fails
    at a request's first token: the full copy is read at once, the first token is exact."""
    from conftest import real_text_passages

    store = tmp_path / "store"
    passages = real_text_passages(6, words=500)
    docs = [tokenizer(passages[k])["input_ids"][:CTX] for k in (0, 1)]
    questions = ["\n\nQuestion: What is this text about?\nAnswer:", "\n\nSummarize the text above in one line:",
                 "\n\nThe most important word in this text is"]
    prompts = [docs[0] + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    prompts.append(tokenizer(passages[4][:300])["input_ids"])  # no stored prefix: exact
    late = docs[1] + tokenizer(questions[0], add_special_tokens=False)["input_ids"]
    n_new = 32

    ports = free_ports(2)  # the two servers start together (the starts overlap)
    local = ServerProcess(_common(store), log_path=tmp_path / "local.log", timeout=420, wait=False, port=ports[0])
    proxy = VerifierProxy(local.url)
    remote_args = _common(store) + [
        "--speculative-algorithm", "VERICACHE_REMOTE", "--speculative-num-draft-tokens", "4",
        "--vc-remote-verifier", proxy.url, "--vc-remote-timeout", "30", "--vc-remote-path", "p2",
        # emulated, fast: the full copy (18.4 MB, 18 ms on the link) is here long before
        # a request's 8 verified rounds are done, on any machine
        "--vc-storage-read-gbps", "1.0",
        "--evicpress-load-copy", "kivi@4b", "--evicpress-storage-copies", "none"]
    remote = ServerProcess(remote_args, log_path=tmp_path / "remote.log", timeout=420, wait=False, port=ports[1])
    try:
        local.wait_ready()
        remote.wait_ready()
        for name, ids in zip(("doc", "doc2"), docs):
            epx.api(local, "POST", "/evicpress/contexts", {"id": name, "token_ids": ids})
            local.generate(input_ids=ids + [13], max_new_tokens=1)  # computes it: copies go to the store
        ref = [local.generate(input_ids=p, max_new_tokens=n_new) for p in prompts + [late]]
        with remote:
            for name, ids in zip(("doc", "doc2"), docs):
                epx.api(remote, "POST", "/evicpress/contexts", {"id": name, "token_ids": ids})
            outs: dict[int, dict] = {}

            def ask(i):
                outs[i] = _post(remote.url, {"input_ids": prompts[i], "sampling_params": {
                    "temperature": 0, "max_new_tokens": n_new}}).json()

            threads = [threading.Thread(target=ask, args=(i,)) for i in (3, 0, 1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in range(4):
                assert outs[i]["output_ids"] == ref[i]["output_ids"], (i, outs[i], ref[i]["output_ids"])
                assert outs[i]["meta_info"]["finish_reason"] == ref[i]["meta_info"]["finish_reason"], i
            counters = remote.server_info()["sglang_vc"]["counters"]
            rv, ep = counters["vericache_remote"], counters["evicpress"]
            # the first lossy prefill starts the one stream; a request prefilled after the
            # copy was installed is exact from its prefill (how many: up to the scheduler)
            p2, late_exact = rv.get("requests_p2", 0), rv.get("exact_after_install", 0)
            assert p2 >= 1 and p2 + late_exact == 3, rv
            assert rv["full_copies_streamed"] == 1 and rv["full_copies_installed"] == 1, rv
            assert rv["first_tokens_verified"] == p2 and rv["switched_to_local"] == p2, rv  # verified, then alone
            assert not rv.get("verify_fallbacks") and proxy.failed == 0, rv
            # the 4-bit copy first, then the full copy, over the remote's link
            assert ep["storage_copies_read"] == 1 and ep["bytes_read_storage_copies"] > 0.9 * CTX * 46080, ep
            assert 0 < ep["bytes_loaded_disk"] < 0.4 * CTX * 46080, ep
            metas = [m[0] for i in range(3) if (m := outs[i]["meta_info"].get("sglang_vc_vericache")) and m[0]]
            assert len(metas) == p2 and all(m["path"] == "P2" and m.get("switched_to_local") for m in metas), metas
            # the verifier fails at the first token of a request on the other context
            proxy.fail_after = 0
            got = _post(remote.url, {"input_ids": late, "sampling_params": {"temperature": 0,
                                                                            "max_new_tokens": n_new}}).json()
            assert got["output_ids"] == ref[4]["output_ids"], (got, ref[4]["output_ids"])
            assert got["meta_info"]["finish_reason"] == ref[4]["meta_info"]["finish_reason"]
            rv = remote.server_info()["sglang_vc"]["counters"]["vericache_remote"]
            assert rv["verify_fallbacks"] == 1 and proxy.failed >= 1, rv
    finally:
        proxy.close()
        remote.stop()
        local.stop()


@pytest.mark.parametrize("argv, message", [
    (["--vc-remote-verifier", "local:30000"], "http(s) URL"),
    (["--vc-remote-verifier", "http://h:1", "--vc-remote-timeout", "0"], "--vc-remote-timeout"),
    (["--vc-remote-verifier", "http://h:1", "--vc-remote-path", "p3"], "--vc-remote-path"),
])
def test_remote_flag_values_are_usage_errors(argv, message, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_remote_algorithm_needs_a_verifier_and_evicpress_and_resolves_its_flags():
    from sglang_vc.config import ConfigError
    from sglang_vc.launch_server import parse_args
    from sglang_vc.vericache.remote import spec as remote_spec

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


def test_full_copies_are_read_once_per_context_and_handed_over_when_done():
    import time as _time
    from types import SimpleNamespace

    from sglang_vc.vericache.remote.stream import FullCopies

    gate = threading.Event()
    reads = []

    def read(ctx):
        reads.append(ctx.ctx_id)
        gate.wait(5)
        return f"kv-{ctx.ctx_id}" if ctx.ctx_id != "bad" else None

    copies = FullCopies(read)
    a, b = SimpleNamespace(ctx_id="a"), SimpleNamespace(ctx_id="b")
    assert copies.stream(a) and not copies.stream(a)  # one read per context in flight
    assert copies.arrived() == [] and copies.streaming("a")
    gate.set()
    deadline = _time.monotonic() + 5
    got = []
    while not got and _time.monotonic() < deadline:
        got = copies.arrived()
    assert got == [(a, "kv-a")] and not copies.streaming("a")
    # read_now joins a read in flight rather than starting another
    gate.clear()
    copies.stream(b)
    threading.Timer(0.2, gate.set).start()
    assert copies.read_now(b) == "kv-b" and reads == ["a", "b"] and copies.arrived() == []
    assert copies.read_now(SimpleNamespace(ctx_id="bad")) is None  # a failed read: None, not an exception
    copies.close()
