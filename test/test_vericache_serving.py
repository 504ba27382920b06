"""VeriCache serving: ``--speculative-algorithm VERICACHE`` drafts from the compressed KV
and verifies against the full KV; greedy output must equal full-KV decoding.

Two servers (draft lengths 3 and 6, SnapKV at 0.25 by default); a second compressor
(StreamingLLM) is exercised through the lossy runtime's per-request override
(``custom_params.vc_compressor``), which VeriCache inherits. The shared plain server is
the full-KV reference.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import requests

from conftest import real_text_passages
from sglang_vc.testing.reference import compare, greedy_reference
from sglang_vc.testing.server import ServerProcess

RATIO = 0.25
META = "sglang_vc_vericache"
LENGTHS = (40, 150, 300)  # mixed prompt lengths in one concurrent batch


def _server(tmp_path_factory, x: int) -> ServerProcess:
    log = tmp_path_factory.mktemp(f"vericache{x}") / "server.log"
    return ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", str(x),
         "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO)],
        log_path=log,
    )


@pytest.fixture(scope="module")
def vc3(tmp_path_factory):
    proc = _server(tmp_path_factory, 3)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def vc6(tmp_path_factory):
    proc = _server(tmp_path_factory, 6)
    yield proc
    proc.stop()


def generate(server, ids, max_new, custom_params=None):
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if custom_params is not None:
        params["custom_params"] = custom_params
    r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": params},
                      timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def concurrently(fn, args_list):
    results, errors = [None] * len(args_list), []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def prompts(tokenizer, offset: int) -> list[list[int]]:
    passages = real_text_passages(12, words=400)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tokenizer(passages[offset + i])["input_ids"][:n]
        assert len(ids) == n
        out.append(ids)
    return out


def vc_counters(server):
    return requests.get(server.url + "/server_info", timeout=60).json()["sglang_vc"]


# ----------------------------------------------------------------------------- flags


def test_vericache_without_compressor_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_vc.launch_server", "--dtype", "float32",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "VERICACHE" in proc.stderr and "--vc-compressor" in proc.stderr


def test_vericache_rejects_online_compressor():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_vc.launch_server", "--dtype", "float32",
         "--speculative-algorithm", "VERICACHE", "--vc-compressor", "h2o",
         "--vc-compression-ratio", "0.5"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "online" in proc.stderr


# ----------------------------------------------------------------------------- serving


def _check_identical(server, vc, model_dir, ids_list, max_new, custom=None):
    """Same tokens as the plain (full-KV) server; where they differ, the divergence must
    be at a near-tie of the full-KV reference (DESIGN.md "identical output")."""
    full = concurrently(lambda ids: generate(server, ids, max_new)["output_ids"], [(i,) for i in ids_list])
    outs = concurrently(lambda ids: generate(vc, ids, max_new, custom), [(i,) for i in ids_list])
    for ids, ref, out in zip(ids_list, full, outs):
        if out["output_ids"] != ref:
            result = compare(greedy_reference(model_dir, ids, max_new), out["output_ids"])
            assert result.identical, (len(ids), custom, result, out["output_ids"], ref)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("which", ["vc3", "vc6"])
@pytest.mark.parametrize("custom", [None, {"vc_compressor": "streamingllm"}], ids=["snapkv", "streamingllm"])
def test_greedy_identical_to_full_kv(request, server, model_dir, tokenizer, which, custom):
    """A concurrent batch of mixed-length prompts: VERICACHE's tokens == the plain
    server's (full KV), for each compressor and draft length."""
    vc = request.getfixturevalue(which)
    x = 3 if which == "vc3" else 6
    outs = _check_identical(server, vc, model_dir, prompts(tokenizer, 0), 24, custom)
    for out in outs:
        info = out["meta_info"][META][-1]
        assert info["verify_rounds"] >= 1 and info["draft_tokens"] == x
        assert info["drafted"] == x * info["verify_rounds"]
        assert 0 <= info["accepted"] <= info["drafted"]
        # 24 tokens = 1 from the prefill + the committed tokens of the verify rounds
        assert info["committed"] >= 23


@pytest.mark.slow
def test_counters_in_server_info(server, tokenizer, vc3):
    ids = prompts(tokenizer, 3)[1]
    before = vc_counters(vc3)["counters"].get("vericache", {})
    out = generate(vc3, ids, 16)
    assert out["output_ids"] == generate(server, ids, 16)["output_ids"]
    section = vc_counters(vc3)
    mech = section["mechanisms"]["vericache"]
    assert mech["draft_tokens"] == 3 and mech["compressor"] == "snapkv"
    after = section["counters"]["vericache"]
    for key in ("verify_rounds", "drafted", "accepted", "committed", "bytes_reloaded"):
        assert after[key] >= before.get(key, 0), key
    assert after["verify_rounds"] > before.get("verify_rounds", 0)
    assert after["bytes_reloaded"] > before.get("bytes_reloaded", 0)
    assert after["drafted"] == 3 * after["verify_rounds"]
