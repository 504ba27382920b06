"""VERICACHE's fallbacks, each on a server of its own: a failed reload and a full host
store, a fault that ends one request and not the server, verifies with no pool room,
the batch growing to the compressed footprint, and full KV until memory binds. Every
output is the plain server's (the shared full-KV reference), token by token.

The module is split from ``test_vericache_serving`` (its helpers are imported from it) so
that the two pytest-xdist workers of the default run share its time.
"""

from __future__ import annotations

import json

import pytest
import requests

from conftest import real_text_passages, release_after_last_use
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.server import ServerProcess
from test_vericache_serving import (ALWAYS, DRAFTERS, META, RATIO, _assert_identical, _check_identical,
                                    flush_cache, prompts, vc_counters)


# ----------------------------------------------------------------------------- fallbacks


@pytest.fixture(scope="module")
def vc_constrained(request, tmp_path_factory):
    """A host store that holds the replaced KV of one 150-token prompt (46 KB/token for
    the embedded model in float32); every copy of the first reload fails, and the first
    staged copy of the second (retried)."""
    log = tmp_path_factory.mktemp("vericache_constrained") / "server.log"
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "3", *ALWAYS,
         "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO),
         "--vc-host-kv-gb", "0.008", "--skip-server-warmup"],  # warm-up would take the failure
        log_path=log, env={"SGLANG_VC_FAIL_WHOLE_RELOADS": "1", "SGLANG_VC_FAIL_RELOADS": "1"},
    )
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def _identical_to_full(server, model_dir, ids, out, n):
    _assert_identical(server, model_dir, [ids], [out], n)


def test_failed_reload_and_full_host_store_keep_output_identical(server, model_dir, tokenizer, vc_constrained):
    """1. A compressed 150-token prompt whose first reload fails every retry: its full KV
    is restored on the device from the host store and it decodes from it (counted as a
    reload fallback), with the full-KV tokens.
    2. Two overlapping 150-token prompts: the first is compressed and verified from host
    reloads (its first staged copy fails and is retried); the second arrives while the first still decodes (after its first streamed
    token, with 40 to go), finds the host store full and decodes from full KV. Both must
    still produce the full-KV tokens."""
    import threading

    from sglang_vc.vericache.reload import SYNC_RETRIES

    ids_f = prompts(tokenizer, 0)[2][:150]  # 150 tokens of a third passage
    ids_a, ids_b = prompts(tokenizer, 0)[1], prompts(tokenizer, 3)[1]
    before = vc_counters(vc_constrained)["counters"].get("vericache", {})
    out_f = generate(vc_constrained, ids_f, 16)
    _identical_to_full(server, model_dir, ids_f, out_f, 16)
    mid = vc_counters(vc_constrained)["counters"]["vericache"]
    assert mid.get("reload_fallbacks", 0) - before.get("reload_fallbacks", 0) == 1, mid
    assert mid["reload_failures"] - before.get("reload_failures", 0) == 1 + SYNC_RETRIES, mid

    first_token = threading.Event()
    result: dict = {}

    def stream_a():
        params = {"temperature": 0, "max_new_tokens": 41, "ignore_eos": True}
        with requests.post(vc_constrained.url + "/generate", json={"input_ids": ids_a, "stream": True,
                           "sampling_params": params}, stream=True, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    result["a"] = json.loads(line[5:])
                    first_token.set()
        first_token.set()

    thread = threading.Thread(target=stream_a)
    thread.start()
    assert first_token.wait(600)
    out_b = generate(vc_constrained, ids_b, 16)
    thread.join(900)
    assert result["a"]["meta_info"]["finish_reason"]["type"] == "length"
    for ids, out, n in ((ids_a, result["a"], 41), (ids_b, out_b, 16)):
        _identical_to_full(server, model_dir, ids, out, n)
    after = vc_counters(vc_constrained)["counters"]["vericache"]
    gained = {k: after.get(k, 0) - mid.get(k, 0) for k in after}
    assert gained["host_store_full"] >= 1 and gained["fallbacks"] >= 1, gained
    assert gained["reload_failures"] >= 1 and gained.get("reload_fallbacks", 0) == 0, gained
    assert gained["bytes_reloaded"] > 0, gained  # the compressed one verified from host reloads


def test_a_fault_ends_one_request_not_the_server(server, model_dir, tokenizer, tmp_path):
    """Faults of one request inside VERICACHE's decode finish that request with an HTTP 500
    and the reason, count it, and leave the server serving: the first request's host entry
    is lost before its verify; the second one's reload fails every retry and the pool has
    no room to restore its full KV (both injected: ``reload.faults``). The third is served
    as the plain server serves it."""
    log = tmp_path / "server.log"
    env = {"SGLANG_VC_LOSE_HOST_ENTRIES": "1", "SGLANG_VC_FAIL_WHOLE_RELOADS": "2", "SGLANG_VC_NO_RESTORE_ROOM": "1"}
    ids = [prompts(tokenizer, k)[1][:150] for k in range(3)]
    with ServerProcess(["--dtype", "float32", "--max-total-tokens", "12000", "--speculative-algorithm", "VERICACHE",
                        "--speculative-num-draft-tokens", "3", *ALWAYS, "--vc-compressor", "snapkv",
                        "--vc-compression-ratio", str(RATIO), "--skip-server-warmup"], log_path=log, env=env) as proc:
        body = lambda i: {"input_ids": ids[i], "sampling_params": {"temperature": 0, "max_new_tokens": 16,  # noqa: E731
                                                                     "ignore_eos": True}}
        lost = requests.post(proc.url + "/generate", json=body(0), timeout=600)
        assert lost.status_code == 500 and "not on the host" in lost.text, lost.text
        failed = requests.post(proc.url + "/generate", json=body(1), timeout=600)
        assert failed.status_code == 500 and "no free slots to restore" in failed.text, failed.text
        assert requests.get(proc.url + "/health", timeout=30).status_code == 200
        served = generate(proc, ids[2], 16)
        counters = vc_counters(proc)["counters"]["vericache"]
    assert counters["request_faults"] == 2, counters
    _identical_to_full(server, model_dir, ids[2], served, 16)


def test_batch_grows_to_the_compressed_footprint(server, model_dir, tokenizer, tmp_path_factory):
    """At a KV pool that holds three full 700-token requests, six concurrent VERICACHE
    requests (SnapKV at 0.25) decode more than three at a time: SGLang's admission counts
    a running request at the slots it holds, and compression gave the dropped ones back
    (the trace shows the decode batch of each iteration). The pool also holds the verify
    headroom (one request's full KV, staging.VerifyHeadroom) and a new request's whole
    prompt, which is prefilled before it is compressed: with two full requests' room
    that left none for a third. Output stays identical."""
    folder = tmp_path_factory.mktemp("vericache_admission")
    budget = 3 * (700 + 24) + 64
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", str(budget), "--speculative-algorithm", "VERICACHE", *ALWAYS,
         "--speculative-num-draft-tokens", "4", "--vc-compressor", "snapkv", "--vc-compression-ratio",
         str(RATIO), "--vc-schedule-trace", str(folder / "trace.jsonl")],
        log_path=folder / "server.log",
    )
    try:
        stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
        ids_list = [stream[i * 700 : (i + 1) * 700] for i in range(6)]
        assert all(len(ids) == 700 for ids in ids_list), len(stream)
        _check_identical(server, proc, model_dir, ids_list, 24)
        records = [json.loads(line) for line in (folder / "trace.jsonl").read_text().splitlines()]
        assert max(len(rec["requests"]) for rec in records) >= 4, [len(r["requests"]) for r in records]
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def vc_no_pool_room(request, tmp_path_factory):
    """A server whose verifies never take the allocator's free slots, only the verify
    headroom (``SGLANG_VC_STAGE_IN_HEADROOM_ONLY``: the path a full KV pool takes)."""
    log = tmp_path_factory.mktemp("vericache_no_pool_room") / "server.log"
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4", *ALWAYS,
         "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO), "--skip-server-warmup"],
        log_path=log, env={"SGLANG_VC_STAGE_IN_HEADROOM_ONLY": "1"},
    )
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def test_verifies_without_pool_room_keep_output_identical(server, model_dir, tokenizer, vc_no_pool_room):
    """When the pool has no free slots to stage a verifier's full KV, the verify runs in
    the headroom held back for it (still SGLang's attention over pool slots); verifiers
    that find it taken wait an iteration. A token-dropping and two KIVI drafters,
    concurrently, give the full-KV tokens; every verify was staged in the headroom; once
    idle the server holds nothing back (the pool is whole again), and nothing was set
    aside beside the pool for reloads (``kv_pool`` shows their cap)."""
    ids_list = prompts(tokenizer, 0)
    before = vc_counters(vc_no_pool_room)["counters"].get("vericache", {})
    outs = concurrently(lambda ids, custom: generate(vc_no_pool_room, ids, 16, custom),
                        [(ids_list[0], None), (ids_list[1], DRAFTERS["kivi2"]), (ids_list[2], DRAFTERS["kivi2"])])
    _assert_identical(server, model_dir, ids_list[:1], outs[:1], 16)
    _assert_identical(server, model_dir, ids_list[1:], outs[1:], 16, DRAFTERS["kivi2"])
    info = vc_counters(vc_no_pool_room)["counters"]
    after = info["vericache"]
    rounds = after["verify_rounds"] - before.get("verify_rounds", 0)
    assert rounds > 0 and after["staged_in_headroom"] - before.get("staged_in_headroom", 0) == rounds, after
    assert after["accepted"] - before.get("accepted", 0) < after["drafted"] - before.get("drafted", 0)
    flush_cache(vc_no_pool_room)
    pool = vc_counters(vc_no_pool_room)["counters"]["kv_pool"]
    assert pool["verify_headroom_tokens"] == 0 and pool["available_tokens"] == pool["total_tokens"], pool
    # reloads started ahead of a verify are capped, with nothing set aside beside the pool
    assert pool["reload_ahead_cap_bytes"] > 0 and pool["reload_ahead_bytes"] == 0, pool
    assert "kv_budget_bytes" not in pool and "reload_staging_budget_bytes" not in pool, pool


def test_full_kv_until_memory_binds(server, model_dir, tokenizer, tmp_path_factory):
    """The default ``--vc-compress-when memory-binds`` at a pool that holds two full
    600-token requests: one request alone keeps its full KV (its reply says why, and
    nothing is drafted: as fast as the plain server); four at once, and the pool could
    not hold the waiting ones at full KV: the mode policy offloads one to measure what an
    offload costs (snapkv's step has no probe) and keeps the others at full KV until it
    has; the offloaded one drafts (drafts rejected somewhere), the others say why not. Every output is the plain server's. No ``--speculative-num-draft-tokens``: X is chosen from data (from 4, up to
    32; too few verifies here to move it)."""
    folder = tmp_path_factory.mktemp("vericache_memory_binds")
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", str(2 * (600 + 24) + 64), "--speculative-algorithm",
         "VERICACHE", "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO), "--skip-server-warmup"],
        log_path=folder / "server.log",
    )
    try:
        stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
        ids_list = [stream[i * 600 : (i + 1) * 600] for i in range(4)]
        assert all(len(ids) == 600 for ids in ids_list), len(stream)
        before = vc_counters(proc)["counters"].get("vericache", {})
        # (a prompt of its own: the four below would find it cached, and keep their full KV)
        alone_ids = stream[4 * 600 : 5 * 600]
        alone = generate(proc, alone_ids, 24)
        mid = vc_counters(proc)["counters"].get("vericache", {})
        info = alone["meta_info"]["sglang_vc_compression"][0]
        assert info["compressor"] == "none" and "room for its full KV" in info["full_kv_reason"], info
        assert mid.get("drafted", 0) == before.get("drafted", 0), "a request with room drafted"
        assert mid.get("full_kv_memory_free", 0) == before.get("full_kv_memory_free", 0) + 1
        _assert_identical(server, model_dir, [alone_ids], [alone], 24)
        # one batch request: the four reach the scheduler together, so the pool's room is
        # judged with the others waiting (four HTTP requests could reach it apart: the first
        # two then kept their full KV, and SGLang's admission, which does not count a
        # speculative request's per-step reserve, retracted one)
        outs = generate(proc, ids_list, 24)
        _assert_identical(server, model_dir, ids_list, outs, 24)
        kinds = [o["meta_info"]["sglang_vc_compression"][0]["compressor"] for o in outs]
        assert kinds.count("snapkv") == 1, kinds
        reasons = [o["meta_info"]["sglang_vc_compression"][0].get("full_kv_reason", "") for o in outs]
        assert any("offload costs not measured yet" in r for r in reasons), reasons
        infos = [(o["meta_info"].get(META) or [{}])[-1] for o in outs]
        drafted, accepted = sum(i.get("drafted", 0) for i in infos), sum(i.get("accepted", 0) for i in infos)
        assert 0 < accepted < drafted, infos  # the compressed ones drafted, some drafts rejected
        assert {i["draft_len_mode"] for i in infos if i} == {"auto"}
        resolved = vc_counters(proc)["mechanisms"]["vericache"]
        assert resolved["draft_len_auto"] and resolved["draft_tokens"] == 32, resolved
        # the verify headroom leaves the batch's decode room: no request was retracted (a
        # headroom that took it made SGLang retract, prefill and compress one again and again)
        log = (folder / "server.log").read_text(errors="replace")
        assert "Retract requests" not in log, [line for line in log.splitlines() if "Retract" in line][:3]
    finally:
        proc.stop()
