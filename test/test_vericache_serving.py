"""VeriCache serving: ``--speculative-algorithm VERICACHE`` drafts from the compressed KV
and verifies against the full KV; greedy output must equal full-KV decoding. At the end,
under SGLang's overlap scheduler: iterations in which nothing drafts overlap, the others
run synchronously.

One VERICACHE server per draft length (1, 4, 16, 40; SnapKV at 0.25 by default); the
other drafters (StreamingLLM, K-norm, KVzip, KIVI 2-bit) are exercised through the lossy
runtime's per-request override (``custom_params``), which VeriCache inherits. The shared
plain server is the full-KV reference.
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest
import requests

from conftest import assert_refused_then_serves, bad_token_requests, real_text_passages, release_after_last_use
from sglang_vc.testing.client import concurrently, generate, stream_generate, stream_with_pool_snapshot
from sglang_vc.testing.reference import compare, finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess

RATIO = 0.25
# these servers' pools hold every request: without this they would not compress (the default
# --vc-compress-when memory-binds; its own test is test_full_kv_until_memory_binds)
ALWAYS = ("--vc-compress-when", "always")
META = "sglang_vc_vericache"
LENGTHS = (40, 150, 300)  # mixed prompt lengths in one concurrent batch


DRAFT_LENGTHS = (1, 4, 16, 40)
DRAFTERS = {
    "snapkv": None,  # the server's default
    "streamingllm": {"vc_compressor": "streamingllm"},
    "knorm": {"vc_compressor": "knorm"},
    "kvzip": {"vc_compressor": "kvzip"},
    "kivi2": {"vc_compressor": "kivi", "vc_kv_bits": 2},
}


def _server(tmp_path_factory, x: int, *extra: str) -> ServerProcess:
    """A VERICACHE server (staggered schedule unless ``extra`` says otherwise) that
    writes its per-iteration schedule trace next to its log."""
    folder = tmp_path_factory.mktemp(f"vericache{x}")
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000", "--enable-metrics",
         "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", str(x), *ALWAYS,
         "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO),
         "--vc-schedule-trace", str(folder / "trace.jsonl"), *extra],
        log_path=folder / "server.log",
        # host syncs and launches per iteration into the trace (the overlap tests read
        # them); outside writes to the runtime and the attention backend counted (the last test)
        env={"SGLANG_VC_COUNT_SYNCS": "sites", "SGLANG_VC_WATCH_WRITES": "1"},
    )
    proc.trace_path = folder / "trace.jsonl"
    return proc


@pytest.fixture(scope="module")
def vc4(tmp_path_factory):
    """The X = 4 server: the default run's, and the slow tests' at X = 4."""
    proc = _server(tmp_path_factory, 4)
    yield proc
    proc.stop()


_X_SERVERS: dict[int, ServerProcess] = {}  # X -> its server (X != 4), one at a time


@pytest.fixture(scope="module")
def x_servers():
    yield _X_SERVERS
    for proc in _X_SERVERS.values():
        proc.stop()
    _X_SERVERS.clear()


@pytest.fixture
def vc_x(request, tmp_path_factory, x_servers):
    """(server, X): one server per X, kept by X (pytest's own fixture cache keys a
    parameter by its index in each test's list, so two tests over the same X restarted
    it); X = 4 is the shared ``vc4``. One at a time: the tests of one X run together
    (``conftest.GROUPED_PARAMS``)."""
    x = request.param
    if x == 4:
        return request.getfixturevalue("vc4"), 4
    if x not in x_servers:
        for other in list(x_servers):
            x_servers.pop(other).stop()
        x_servers[x] = _server(tmp_path_factory, x)
        release_after_last_use(request, x_servers[x])  # (after the module's last test over X)
    return x_servers[x], x


def prompts(tokenizer, offset: int) -> list[list[int]]:
    passages = real_text_passages(12, words=400)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tokenizer(passages[offset + i])["input_ids"][:n]
        assert len(ids) == n
        out.append(ids)
    return out


def flush_cache(server, attempts: int = 120):
    """Flush the radix cache; SGLang refuses while requests run, so retry until idle."""
    import time

    for _ in range(attempts):
        if requests.post(server.url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.5)
    raise AssertionError("the server never became idle enough to flush its cache")


def vc_counters(server):
    return requests.get(server.url + "/server_info", timeout=60).json()["sglang_vc"]


# ----------------------------------------------------------------------------- flags


def test_vericache_without_compressor_drafts_with_specache_2bit():
    """No ``--vc-compressor``: the default drafter (SpeCache 2-bit), recorded for
    /server_info; an explicit compressor wins, and bits without a compressor stay an error."""
    from sglang_vc.launch_server import parse_args

    vc, _ = parse_args(["--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4"])
    assert (vc.vc_compressor, vc.vc_kv_bits, vc.vc_compression_ratio) == ("specache", 2, None)
    assert vc.resolved["vericache_drafter"] == {"compressor": "specache", "kv_bits": 2, "default": True}
    vc, _ = parse_args(["--speculative-algorithm", "VERICACHE", "--vc-compressor", "snapkv",
                        "--vc-compression-ratio", "0.25"])
    assert vc.vc_compressor == "snapkv" and "vericache_drafter" not in vc.resolved
    vc, _ = parse_args([])  # no VERICACHE: no drafter
    assert vc.vc_compressor is None


@pytest.mark.slow  # a launcher process; the in-process checks are in test_cli / test_specache_serving
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
    """VERICACHE's outputs on ``ids_list``, sent concurrently, checked by
    :func:`_assert_identical`."""
    outs = concurrently(lambda ids: generate(vc, ids, max_new, custom), [(i,) for i in ids_list])
    _assert_identical(server, model_dir, ids_list, outs, max_new, custom)
    return outs


def _assert_identical(server, model_dir, ids_list, outs, max_new, custom=None):
    """Same tokens, length and finish reason as the plain (full-KV) server; where the
    tokens differ, the divergence must be at a near-tie of the full-KV reference
    (docs/architecture.md, "identical output")."""
    full = concurrently(lambda ids: generate(server, ids, max_new), [(i,) for i in ids_list])
    for ids, ref, out in zip(ids_list, full, outs):
        assert finish_type(out) == finish_type(ref) == "length", (out["meta_info"], ref["meta_info"])
        assert len(out["output_ids"]) == len(ref["output_ids"]) == max_new, (len(out["output_ids"]), max_new)
        if out["output_ids"] != ref["output_ids"]:
            result = compare(greedy_reference(model_dir, ids, max_new), out["output_ids"], finish_type(out))
            assert result.identical, (len(ids), custom, result, out["output_ids"], ref["output_ids"])


# A token-dropping drafter (default run) and KIVI 2-bit (slow run): prompts of 300 and 400
# tokens (KIVI quantizes 160 and 256 of them: residual 128, groups of 32).
# SpeCache's 1-bit copy as the drafter (residual 64: 224 and 320 rows quantized), with 4
# rows per layer and KV head fetched from the host copy each draft step.
SPECACHE_DRAFTER = {"vc_compressor": "specache", "vc_kv_bits": 1, "specache_topk": 4}
DEFAULT_DRAFTERS = {"snapkv": (None, 0.75), "kivi2": (DRAFTERS["kivi2"], 0.6),
                    "specache1": (SPECACHE_DRAFTER, 0.75)}


@pytest.mark.parametrize("drafter", [  # each drafter family; kivi2 (a second quantizer) in the slow run
    "snapkv", "kivi2", "specache1"])
def test_greedy_identity_from_a_lossy_drafter(server, model_dir, tokenizer, vc4, drafter):
    """VERICACHE at X = 4 gives the plain (full-KV) server's tokens, and the drafter was
    really lossy: some drafts were rejected, and while a request decodes the device pool
    holds its compressed footprint, not its full KV. A drafter that read the full KV
    would accept every draft (same argmax as the verifier) and keep every slot. The
    SpeCache drafter also fetched its rows: 4 per KV head, layer and draft token."""
    custom, min_saving = DEFAULT_DRAFTERS[drafter]
    passages = real_text_passages(12, words=400)
    ids_list = [tokenizer(passages[5])["input_ids"][:300], tokenizer(passages[6])["input_ids"][:400]]
    assert [len(i) for i in ids_list] == [300, 400]
    before = vc_counters(vc4)["counters"].get("vericache", {})
    outs = _check_identical(server, vc4, model_dir, ids_list, 24, custom)
    after = vc_counters(vc4)["counters"].get("vericache", {})
    fetched = after.get("specache_rows_fetched", 0) - before.get("specache_rows_fetched", 0)
    if drafter == "specache1":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        per_draft = 4 * cfg["num_key_value_heads"] * cfg["num_hidden_layers"]
        assert fetched > 0 and fetched % per_draft == 0, (fetched, per_draft)
        assert after.get("specache_fetch_misses", 0) == before.get("specache_fetch_misses", 0)
    else:
        assert fetched == 0
    infos = [out["meta_info"][META][-1] for out in outs]
    drafted, accepted = sum(i["drafted"] for i in infos), sum(i["accepted"] for i in infos)
    rounds = sum(i["verify_rounds"] for i in infos)
    # staggered: ADMIT anchors each run of drafts at X = 4 and may shorten or lengthen it
    assert 0 < rounds <= drafted <= (2 * 4 - 1) * rounds
    assert accepted < drafted, infos  # drafts were rejected somewhere
    # reloads started ahead of their verify landed in pool slots taken then, all back by now
    ahead = after.get("reloads_ahead", 0) - before.get("reloads_ahead", 0)
    assert ahead > 0, after
    pool = vc_counters(vc4)["counters"]["kv_pool"]
    assert pool["reload_ahead_peak_bytes"] > 0 and pool["reload_ahead_bytes"] == 0, pool
    # the host rows were views of the store's slabs (test_vericache_host_slabs), none apart
    assert pool["host_slabs"] >= 1 and pool["host_rows_outside_slabs"] == 0, pool

    # footprint while decoding, one request alone: full KV would hold every prompt token
    ids = ids_list[1]
    flush_cache(vc4)
    last, kv = stream_with_pool_snapshot(vc4, ids, 24, custom)
    used = kv["total_tokens"] - kv["available_tokens"] - kv["evictable_tokens"]
    # the verify headroom held back in the pool (its longest compressed span, for the
    # batch's verifies) is counted apart; its own: prompt rows kept + the tokens decoded so
    # far + the round's X + 1 verify slots (x2)
    headroom = kv["verify_headroom_tokens"]
    assert 0 < headroom <= len(ids), kv
    assert used - headroom <= (1 - min_saving) * len(ids) + 24 + 2 * 5, (kv, used)
    assert last["output_ids"] == outs[1]["output_ids"]


def _trace(server) -> list[dict]:
    return [json.loads(line) for line in server.trace_path.read_text().splitlines()]


def test_full_kv_requests_before_drafters_in_one_batch(server, model_dir, tokenizer, vc4):
    """Two requests that opt out of compression (``vc_compressor: none``: they decode
    from their full KV, role ``full``) are decoding when two compressed ones join the
    batch behind them, so iterations have full-KV requests *before* drafting ones and,
    with X = 4, often no verifier. Every output equals the plain server's (tokens, length,
    finish reason), and the trace shows such an iteration: the one-token forward of
    drafters and full-KV requests must keep each request's own token, position and slot."""
    import threading

    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    full_ids = [stream[0:200], stream[1000:1250]]
    spec_ids = [stream[2000:2300], stream[3000:3350]]
    assert [len(ids) for ids in full_ids + spec_ids] == [200, 250, 300, 350]
    started = [threading.Event() for _ in full_ids]
    full_outs: dict[int, dict] = {}
    start = len(_trace(vc4))

    def run_full(k):
        full_outs[k] = stream_generate(vc4, full_ids[k], 64, {"vc_compressor": "none"}, started[k])

    threads = [threading.Thread(target=run_full, args=(k,)) for k in range(len(full_ids))]
    for t in threads:
        t.start()
    assert all(e.wait(600) for e in started)  # both decode before the compressed ones arrive
    spec_outs = concurrently(lambda ids: generate(vc4, ids, 24), [(ids,) for ids in spec_ids])
    for t in threads:
        t.join(900)
    _assert_identical(server, model_dir, full_ids, [full_outs[k] for k in range(len(full_ids))], 64)
    _assert_identical(server, model_dir, spec_ids, spec_outs, 24)

    full_rids = {full_outs[k]["meta_info"]["id"] for k in full_outs}
    spec_rids = {out["meta_info"]["id"] for out in spec_outs}
    ordered = 0
    records = _trace(vc4)[start:]
    # one model forward per iteration, drafting, full-KV and verifying requests together
    assert all(rec["phases"]["forwards"] == 1 for rec in records if rec["requests"]), records
    assert any({"draft", "verify", "full"} <= {r["role"] for r in rec["requests"]} for rec in records)
    for rec in records:
        roles = [(r["rid"], r["role"]) for r in rec["requests"]]
        if any(role == "verify" for _, role in roles):
            continue
        first_draft = next((i for i, (rid, role) in enumerate(roles) if role == "draft" and rid in spec_rids), None)
        if first_draft is not None and any(rid in full_rids and role == "full" for rid, role in roles[:first_draft]):
            ordered += 1
    assert ordered >= 1, "no iteration had a full-KV request before a drafter and no verifier"
    infos = [out["meta_info"][META][-1] for out in spec_outs]
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos  # really lossy drafts


def test_staggered_schedule_follows_admit(server, model_dir, tokenizer, vc4):
    """Six concurrent requests under the staggered schedule: their tokens equal the
    full-KV server's, and the per-iteration trace shows (1) iterations in which some
    requests draft while others verify, never the whole batch verifying in lock-step, and
    (2) each request doing what ADMIT reserved for it: it verifies exactly at its
    reserved iteration, after ``draft_len`` drafts since its admission, from a reload
    started at the first window of its reserved span."""
    passages = real_text_passages(12, words=400)
    ids_list = [tokenizer(passages[i])["input_ids"][:n] for i, n in enumerate((150, 200, 250, 300, 180, 220))]
    start = len(_trace(vc4))
    outs = _check_identical(server, vc4, model_dir, ids_list, 24)
    records = _trace(vc4)[start:]
    # a verify reloads only the rows SnapKV dropped (3/4 of the prompt), not the kept ones
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # float32
    prompt_len = {out["meta_info"]["id"]: len(ids) for out, ids in zip(outs, ids_list)}
    # a prompt may share a prefix with an earlier test's in the radix tree: the host then
    # holds only [p, n), as full rows when a kept position falls before p
    tree_prefix = {out["meta_info"]["id"]: out["meta_info"]["cached_tokens"] for out in outs}
    dropped_only = 0
    assert records, "no decode iteration was traced"
    mixed = 0
    for rec in records:
        roles = [r["role"] for r in rec["requests"]]
        if "draft" in roles and "verify" in roles:
            mixed += 1
        for r in rec["requests"]:
            if r["role"] == "verify":
                assert r["verify_at"] == rec["iteration"], rec
                assert r["verified_drafts"] == r["draft_len"] == r["verify_at"] - r["admitted_at"], rec
                assert r["reload_started_at"] == r["reload_at"] <= rec["iteration"], rec
                assert r["reload_bytes"] > 0 and 1 <= r["committed"] <= r["verified_drafts"] + 1, rec
                if r["rid"] in prompt_len:
                    p = tree_prefix[r["rid"]]
                    span_bytes = (prompt_len[r["rid"]] - p) * per_token
                    assert 0.7 * span_bytes <= r["reload_bytes"] <= (0.8 if p == 0 else 1.0) * span_bytes, (r, p)
                    dropped_only += p == 0
            elif r["role"] == "draft":
                assert r["admitted_at"] <= rec["iteration"] < r["verify_at"], rec
                assert r["drafts"] == rec["iteration"] - r["admitted_at"] + 1 and r["committed"] == 0, rec
    assert dropped_only, tree_prefix  # some verifies reloaded only the dropped 3/4
    busy = [rec for rec in records if len(rec["requests"]) >= 4]
    assert mixed >= 3, records
    # with six requests and X = 4, about 6/4 verify per iteration, not six
    assert busy and max(sum(r["role"] == "verify" for r in rec["requests"]) for rec in busy) < 6


@pytest.fixture(scope="module")
def vc_lockstep(request, tmp_path_factory):
    proc = _server(tmp_path_factory, 4, "--vc-schedule", "lockstep")
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def test_lockstep_schedule_identical_to_full_kv(server, model_dir, tokenizer, vc_lockstep):
    """The comparison mode: every request drafts X = 4 tokens and verifies every round."""
    outs = _check_identical(server, vc_lockstep, model_dir, prompts(tokenizer, 0), 24)
    for out in outs:
        info = out["meta_info"][META][-1]
        assert info["drafted"] == 4 * info["verify_rounds"] > 0


def test_lockstep_applies_penalties_grammars_and_logprobs(server, tokenizer, vc_lockstep):
    """The lock-step round's draft steps and verify apply the request features as the
    staggered iteration does: a penalised request, a regex-constrained one with logprobs
    and a plain one in one batch give the plain server's tokens, length and finish
    reason, a matching text and logprobs within 2e-3; drafts were rejected somewhere."""
    import re

    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    # (at offset 700 the plain server's own penalised output differs between this batch of
    # three and the request alone, a float near-tie: no server could match both)
    ids_list = [stream[500 + 1000 * i : 800 + 1000 * i] for i in range(3)]
    pattern = r"[A-Z][a-z]+( [a-z]+)+"
    cases = [{"sampling_params": {"frequency_penalty": 0.6, "presence_penalty": 0.3}},
             {"sampling_params": {"regex": pattern}, "return_logprob": True, "top_logprobs_num": 2},
             {"sampling_params": {}}]

    def run(srv, k):
        body = {"input_ids": ids_list[k], **cases[k], "sampling_params": {
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": k != 1, **cases[k]["sampling_params"]}}
        r = requests.post(srv.url + "/generate", json=body, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()

    order = list(range(len(cases)))
    outs = dict(zip(order, concurrently(lambda k: run(vc_lockstep, k), [(k,) for k in order])))
    refs = dict(zip(order, concurrently(lambda k: run(server, k), [(k,) for k in order])))
    for k in order:
        assert outs[k]["output_ids"] == refs[k]["output_ids"], (k, outs[k]["text"], refs[k]["text"])
        assert finish_type(outs[k]) == finish_type(refs[k]), (k, outs[k]["meta_info"])
    assert re.fullmatch(pattern, outs[1]["text"]), outs[1]["text"]
    lp = [t[0] for t in outs[1]["meta_info"]["output_token_logprobs"]]
    assert lp == pytest.approx([t[0] for t in refs[1]["meta_info"]["output_token_logprobs"]], abs=2e-3)
    infos = [outs[k]["meta_info"][META][-1] for k in order]
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos  # drafts rejected


def test_lockstep_stops_at_the_first_stop_string_of_a_run(server, vc_lockstep):
    """A lock-step round commits up to X + 1 tokens at once: SGLang's ``test_dtype_gen``
    request (stops ``[" ", "\\n"]`` after a number; ``test_vericache_finish`` has the
    other modes) ends at the newline as full KV's does, with and without its regex."""
    prompt = 'Q: What is the full name of DNS?\nA: The full names is ""\nQ: Which year was DNS invented?\nA: '
    for extra in ({"regex": r"[-+]?[0-9]+[ \n]*"}, {}):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 64, "temperature": 0, "stop": [" ", "\n"],
                                                    **extra}}
        ref, out = (requests.post(s.url + "/generate", json=body, timeout=300).json() for s in (server, vc_lockstep))
        assert ref["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}, ref
        assert (out["text"], out["output_ids"], out["meta_info"]["finish_reason"]) == (
            ref["text"], ref["output_ids"], ref["meta_info"]["finish_reason"])
        assert out["meta_info"][META][-1]["verify_rounds"] >= 1


def _x_drafter_grid() -> list:
    """Every drafter at X = 4, every X with the default drafter; the rest of the grid (and
    the X = 16 server) in the slow run: what X changes is the worker's schedule, which no
    drafter changes (suite time, docs/testing.md)."""
    grid = []
    for x in DRAFT_LENGTHS:
        for drafter in DRAFTERS:
            default = x == 4 or (drafter == "snapkv" and x != 16)
            grid.append(pytest.param(x, drafter, id=f"x{x}-{drafter}",
                                     marks=() if default else pytest.mark.slow))
    return grid


@pytest.mark.parametrize("vc_x,drafter", _x_drafter_grid(), indirect=["vc_x"])
def test_greedy_identical_to_full_kv(server, model_dir, tokenizer, vc_x, drafter):
    """A concurrent batch of mixed-length prompts: VERICACHE's tokens == the plain
    server's (full KV), for each drafter and draft length."""
    vc, x = vc_x
    flush_cache(vc)  # (an earlier test's same prompts would be cached: nothing to compress)
    outs = _check_identical(server, vc, model_dir, prompts(tokenizer, 0), 24, DRAFTERS[drafter])
    for out in outs:
        info = out["meta_info"][META][-1]
        assert info["verify_rounds"] >= 1 and info["draft_tokens"] == x
        assert info["verify_rounds"] <= info["drafted"] <= (2 * x - 1) * info["verify_rounds"]
        assert 0 <= info["accepted"] <= info["drafted"]
        # 24 tokens = 1 from the prefill + the committed tokens of the verify rounds
        assert info["committed"] >= 23


BATCH16_LENGTHS = (20, 40, 60, 90, 120, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1400, 2000)


def test_batch_of_16_mixed_lengths_identical(server, model_dir, tokenizer, vc4):
    """16 concurrent requests, prompts of 20 to 2000 tokens from the code workload (X = 4)."""
    vc = vc4
    from sglang_vc.bench.workloads import load_workload

    items = load_workload("code", tokenizer=model_dir, max_tokens=2100, n=4, lengths=[2048])
    pool = [t for item in items for t in tokenizer(item["prompt"])["input_ids"]]
    ids_list = [pool[i * 97 : i * 97 + n] for i, n in enumerate(BATCH16_LENGTHS)]
    assert [len(ids) for ids in ids_list] == list(BATCH16_LENGTHS)
    _check_identical(server, vc, model_dir, ids_list, 20)


@pytest.mark.parametrize("vc_x", [pytest.param(x, id=f"x{x}", marks=pytest.mark.slow if x == 16 else ())
                                  for x in DRAFT_LENGTHS], indirect=True)
def test_counters_in_server_info(server, tokenizer, vc_x):
    vc, x = vc_x
    ids = prompts(tokenizer, 3)[1]
    flush_cache(vc)  # (an earlier test's same prompt would be cached: nothing to compress)
    before = vc_counters(vc)["counters"].get("vericache", {})
    out = generate(vc, ids, 16)
    assert out["output_ids"] == generate(server, ids, 16)["output_ids"]
    section = vc_counters(vc)
    mech = section["mechanisms"]["vericache"]
    assert mech["draft_tokens"] == x and mech["compressor"] == "snapkv"
    # SGLang's draft-token count is the verify width (NGRAM's convention)
    assert mech["verify_width"] == x + 1 == requests.get(vc.url + "/server_info").json()["speculative_num_draft_tokens"]
    after = section["counters"]["vericache"]
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert gained["verify_rounds"] > 0 and gained["bytes_reloaded"] > 0
    # each round commits its accepted drafts plus one correction or bonus token; 16
    # tokens = 1 from the prefill + at least 15 from verify rounds
    assert gained["committed"] == gained["accepted"] + gained["verify_rounds"]
    assert gained["committed"] >= 15
    assert gained["verify_rounds"] <= gained["drafted"] <= (2 * x - 1) * gained["verify_rounds"]
    metrics = requests.get(vc.url + "/metrics", timeout=60).text
    assert "sglang_vc:vericache_verify_rounds" in metrics


def chi2_two_sample_p(table: list[list[int]]) -> float:
    """p-value of Pearson's chi-square test of homogeneity of a 2 x K count table."""
    import torch

    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = torch.tensor(float(t.shape[1] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_chi2_helper_detects_a_different_distribution():
    assert chi2_two_sample_p([[50, 50, 60], [52, 48, 60]]) > 0.5
    assert chi2_two_sample_p([[120, 20, 20], [40, 60, 60]]) < 1e-6


def test_sampling_distribution_matches_full_kv(server, tokenizer, vc4):
    """temperature 1, top-k 4: the second and third tokens (from verify rounds) of 160
    samples per server have the same distribution as full-KV sampling (two-sample
    chi-square, p > 1e-3). Committing drafts blindly (greedy drafts) would fail it."""
    vc = vc4
    ids = prompts(tokenizer, 0)[0]
    params = {"temperature": 1.0, "top_k": 4, "max_new_tokens": 3, "ignore_eos": True}

    def sample(srv, seed):
        r = requests.post(srv.url + "/generate", json={
            "input_ids": ids, "sampling_params": {**params, "sampling_seed": seed}}, timeout=900)
        assert r.status_code == 200, r.text
        return tuple(r.json()["output_ids"][1:3])

    n = 160
    full = concurrently(lambda seed: sample(server, seed), [(i,) for i in range(n)])
    spec = concurrently(lambda seed: sample(vc, seed), [(10_000 + i,) for i in range(n)])
    for pos in (0, 1):
        keys = sorted({t[pos] for t in full + spec})
        table = [[sum(t[pos] == k for t in full) for k in keys], [sum(t[pos] == k for t in spec) for k in keys]]
        if len(keys) > 1:
            p_value = chi2_two_sample_p(table)
            assert p_value > 1e-3, (pos, keys, table, p_value)
    # the distribution is not degenerate: sampling really happened on both servers
    assert len(set(full)) > 2 and len(set(spec)) > 2, (set(full), set(spec))


# ----------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("case", ["huge-id", "negative-id", "completion-token-prompt", "custom-params-not-object"])
def test_token_ids_outside_the_vocabulary_are_http_400(vc4, case):
    assert_refused_then_serves(vc4, *bad_token_requests(49152)[case])


def test_switched_off_capabilities_are_warnings_users_see(vc4):
    """What VERICACHE switches off in SGLang is in the server's log with the reason, and
    in ``/server_info``: decode and prefill CUDA graphs here (the overlap scheduler is
    already off on this CPU platform; ``test_cli`` checks that warning where it is on)."""
    log = vc4.log_path.read_text(errors="replace")
    line = ("CUDA graphs for VERICACHE's ragged verify forwards and offload drafts disabled by "
            "--speculative-algorithm VERICACHE")
    assert line in log
    off = {n["capability"]: n for n in vc_counters(vc4)["switched_off"]}
    assert set(off) == {"CUDA graphs for VERICACHE's ragged verify forwards and offload drafts", "prefill CUDA graphs"}, off
    assert all(n["reason"] for n in off.values())


# per request: (sampling parameters, custom_params); every one decodes 24 tokens unless a
# stop token ends it
PENALISED = [
    ({"frequency_penalty": 0.6}, None),
    ({"presence_penalty": 0.8, "repetition_penalty": 1.3}, None),
    ({"frequency_penalty": 0.4, "repetition_penalty": 0.9}, {"vc_compressor": "none"}),  # full KV, opted out
    ({}, None),  # no penalty, drafting beside the penalised ones
]


def _left_the_reference(model_dir, ids, out, ref, params) -> None:
    """Where VERICACHE's penalised output parts from the plain server's, the float32
    reference with the same penalties decides: VERICACHE's token is the reference's there
    (the plain server left it: SGLang's own penalised batch can, e.g. 30 for 28 at a gap of
    0.27, seen under load), or the step is a near-tie."""
    from sglang_vc.testing.reference import penalised_step

    at = next(j for j, (a, b) in enumerate(zip(out + [-1], ref + [-2])) if a != b)
    assert at < min(len(out), len(ref)), (out, ref)  # same tokens, different lengths: a real error
    token, near_tie = penalised_step(model_dir, ids, out[:at], params, tuple(params.get("stop_token_ids", ())))
    assert token == out[at] or near_tie, (at, params, out, ref, token)


def test_penalties_and_min_new_tokens_identical_to_full_kv(server, tokenizer, vc4, model_dir):
    """Frequency, presence and repetition penalties and ``min_new_tokens`` under
    VERICACHE, in one concurrent batch of compressed (drafting and verifying), opted-out
    (full-KV) and unpenalised requests, give the plain server's tokens, length and finish
    reason for the same parameters. The penalties change the output (so they were
    applied), drafts were rejected somewhere (the compressed path ran), and
    ``min_new_tokens`` holds back a stop token the plain output emits early. Where the two
    part, the float32 reference with the same penalties sides with VERICACHE (or the step
    is a near-tie)."""
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[500 + 1000 * i : 800 + 1000 * i] for i in range(len(PENALISED) + 1)]
    assert all(len(ids) == 300 for ids in ids_list)
    unpenalised = generate(server, ids_list[0], 24)["output_ids"]
    # min_new_tokens: the 3rd token of the plain output is a stop token; 12 outputs first
    stop = {"stop_token_ids": [generate(server, ids_list[-1], 24)["output_ids"][2]], "ignore_eos": False}
    cases = [*PENALISED, ({**stop, "min_new_tokens": 12}, None)]

    def run(srv, k):
        params, custom = cases[k]
        return generate(srv, ids_list[k], 24, custom if srv is vc4 else None, **params)

    for order in (range(len(cases)), reversed(range(len(cases)))):
        order = list(order)
        flush_cache(vc4)  # (the first order's prompts would be cached: nothing to compress)
        outs = dict(zip(order, concurrently(lambda k: run(vc4, k), [(k,) for k in order])))
        refs = dict(zip(order, concurrently(lambda k: run(server, k), [(k,) for k in order])))
        for k in order:
            if outs[k]["output_ids"] != refs[k]["output_ids"]:
                _left_the_reference(model_dir, ids_list[k], outs[k]["output_ids"], refs[k]["output_ids"], cases[k][0])
                continue
            assert finish_type(outs[k]) == finish_type(refs[k]), (k, outs[k]["meta_info"])
    assert refs[0]["output_ids"] != unpenalised  # the frequency penalty changed the output
    assert len(refs[len(cases) - 1]["output_ids"]) >= 12
    assert generate(server, ids_list[-1], 24, **stop)["output_ids"] != refs[len(cases) - 1]["output_ids"]
    infos = [outs[k]["meta_info"][META][-1] for k in (0, 1, 4)]
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos  # drafts rejected
    assert outs[2]["meta_info"][META][-1]["drafted"] == 0  # the opted-out one decoded full KV


def test_verifier_applies_logit_bias_and_min_p(server, tokenizer, vc4):
    """``logit_bias`` banning a token the full-KV output picks in a verify round changes
    the output, and VERICACHE gives the biased full-KV tokens; ``min_p = 1`` at
    temperature 1 keeps only the most likely token, so sampling must give the greedy
    full-KV tokens (a verifier that ignored min_p would sample something else)."""
    ids = prompts(tokenizer, 3)[2]  # 300 tokens
    plain = generate(server, ids, 16)["output_ids"]
    bias = {str(plain[3]): -100.0}
    ref = generate(server, ids, 16, logit_bias=bias)["output_ids"]
    assert ref != plain and plain[3] not in ref
    assert generate(vc4, ids, 16, logit_bias=bias)["output_ids"] == ref

    greedy_like = {"temperature": 1.0, "min_p": 1.0}
    assert generate(server, ids, 16, **greedy_like)["output_ids"] == plain
    for _ in range(2):
        assert generate(vc4, ids, 16, **greedy_like)["output_ids"] == plain


def test_sglang_spec_fields_count_vericache(tokenizer, vc4):
    """SGLang's own ``spec_*`` reply fields count what VERICACHE drafted, accepted and
    verified (the worker's own per-request counts), a request that drafted nothing (opted
    out, full KV) reports none, and the server's decode log line reports an acceptance
    rate in [0, 1] and at least one token per verify."""
    import re

    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[4000:4300], stream[4300:4600]]
    customs = [None, {"vc_compressor": "none"}]
    outs = concurrently(lambda ids, c: generate(vc4, ids, 48, c), list(zip(ids_list, customs)))
    drafted, opted_out = (out["meta_info"] for out in outs)
    info = drafted[META][-1]
    assert info["verify_rounds"] > 0 and info["drafted"] > 0, info
    assert drafted["spec_verify_ct"] == info["verify_rounds"]
    assert drafted["spec_num_proposed_drafts"] == info["drafted"]
    assert drafted["spec_num_correct_drafts"] == info["accepted"]
    assert drafted["spec_accept_rate"] == pytest.approx(info["accepted"] / info["drafted"])
    assert 0 <= drafted["spec_accept_rate"] <= 1
    assert drafted["spec_accept_length"] == pytest.approx(info["committed"] / info["verify_rounds"])
    assert sum(drafted.get("spec_correct_drafts_histogram") or []) == info["verify_rounds"], drafted
    assert opted_out[META][-1]["drafted"] == 0
    assert not [k for k in opted_out if k.startswith("spec_")], opted_out
    log = vc4.log_path.read_text(errors="replace")
    lines = re.findall(r"accept len: ([-0-9.]+), accept rate: ([-0-9.]+)", log)
    assert lines, "no decode log line"
    assert all(0 <= float(rate) <= 1 and float(length) >= 0 for length, rate in lines), lines
    metrics = requests.get(vc4.url + "/metrics", timeout=60).text
    rates = [float(v) for v in re.findall(r"^sglang:spec_accept_rate\{[^}]*\} ([-0-9.e+]+)$", metrics, re.M)]
    assert rates and all(0 <= r <= 1 for r in rates), rates


def _logprob_request(srv, ids, custom=None, **extra) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [13, 264],
            "logprob_start_len": len(ids) - 8,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, **extra}}
    if custom is not None:
        body["sampling_params"]["custom_params"] = custom
    r = requests.post(srv.url + "/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_are_full_kv_decodings(server, tokenizer, vc4):
    """``return_logprob`` with top logprobs, ``token_ids_logprob`` and input-token
    logprobs under VERICACHE, in one concurrent batch of compressed (drafting,
    verifying), opted-out (full-KV), penalised and logprob-free requests: the same tokens
    as the plain server, and every logprob within 2e-3 of the plain server's (the verify
    computes them from its full-KV logits; the plain server from a one-token decode)."""
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[250 + 1000 * i : 550 + 1000 * i] for i in range(4)]
    # (no penalty here: the plain server's overlap scheduler applies penalties one output
    # token late, with the last prompt token counted -- measured; VERICACHE applies them
    # as SGLang does without the overlap scheduler, so logprobs of a penalised request
    # differ from the plain server's by up to ~0.03 while its tokens agree)
    cases = [({}, None, True), ({}, {"vc_compressor": "none"}, True), ({"logit_bias": {"13": -2.0}}, None, True),
             ({}, None, False)]

    def run(srv, k):
        extra, custom, logprobs = cases[k]
        custom = custom if srv is vc4 else None
        return _logprob_request(srv, ids_list[k], custom, **extra) if logprobs else \
            generate(srv, ids_list[k], 24, custom, **extra)

    outs = concurrently(lambda k: run(vc4, k), [(k,) for k in range(len(cases))])
    refs = concurrently(lambda k: run(server, k), [(k,) for k in range(len(cases))])
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert out["output_ids"] == ref["output_ids"], k
        if not cases[k][2]:
            assert "output_token_logprobs" not in out["meta_info"] or not out["meta_info"]["output_token_logprobs"]
            continue
        mo, mr = out["meta_info"], ref["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert len(mo[key]) == len(mr[key]) and [t[1] for t in mo[key]] == [t[1] for t in mr[key]], (k, key)
            got = [t[0] for t in mo[key] if t[0] is not None]
            want = [t[0] for t in mr[key] if t[0] is not None]
            assert got == pytest.approx(want, abs=2e-3), (k, key)
        assert len(mo["output_token_logprobs"]) == 24
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            assert len(mo[key]) == len(mr[key]) == 24, (k, key)
            for a, b in zip(mo[key], mr[key]):
                assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=2e-3), (k, key, a, b)
    infos = [outs[k]["meta_info"][META][-1] for k in (0, 2, 3)]
    assert sum(i["verify_rounds"] for i in infos) > 0
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos  # drafts rejected


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "year": {"type": "integer"}}, "required": ["name", "year"]}


def test_structured_output_identical_to_full_kv(server, tokenizer, vc4):
    """JSON schema, regex and EBNF under VERICACHE, in one concurrent batch with a
    compressed unconstrained request and an opted-out (full-KV) constrained one: the plain
    server's tokens, length and finish reason; each constrained output matches its
    grammar (the JSON parses against the schema); drafts were rejected somewhere. The
    OpenAI ``response_format`` path gives the plain server's JSON too."""
    import re

    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    question = tokenizer("\nThe person above as JSON with a name and a year:", add_special_tokens=False)["input_ids"]
    ids_list = [stream[600 + 1000 * i : 900 + 1000 * i] + question for i in range(4)]
    cases = [({"json_schema": json.dumps(SCHEMA)}, None), ({"regex": r"(19|20)[0-9]{2}, [A-Z][a-z]+"}, None),
             ({"ebnf": 'root ::= "yes" | "no" | "maybe, " [a-z]+'}, {"vc_compressor": "none"}), ({}, None)]

    def run(srv, k):
        params, custom = cases[k]
        return generate(srv, ids_list[k], 48, custom if srv is vc4 else None, ignore_eos=False, **params)

    for order in (list(range(len(cases))), list(reversed(range(len(cases))))):
        flush_cache(vc4)  # (the first order's prompts would be cached: nothing to compress)
        outs = dict(zip(order, concurrently(lambda k: run(vc4, k), [(k,) for k in order])))
        refs = dict(zip(order, concurrently(lambda k: run(server, k), [(k,) for k in order])))
        for k in order:
            assert outs[k]["output_ids"] == refs[k]["output_ids"], (k, outs[k]["text"], refs[k]["text"])
            assert finish_type(outs[k]) == finish_type(refs[k]), (k, outs[k]["meta_info"])
    value = json.loads(outs[0]["text"])
    assert set(value) == {"name", "year"} and isinstance(value["year"], int), value
    assert re.fullmatch(r"(19|20)[0-9]{2}, [A-Z][a-z]+", outs[1]["text"]), outs[1]["text"]
    assert re.fullmatch(r"yes|no|maybe, [a-z]+", outs[2]["text"]), outs[2]["text"]
    infos = [outs[k]["meta_info"][META][-1] for k in (0, 1, 3)]
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos  # drafts rejected
    assert outs[0]["meta_info"][META][-1]["verify_rounds"] > 0  # the schema's request verified drafts

    body = {"model": "default", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": tokenizer.decode(stream[600:900]) + " Reply in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    got, want = (requests.post(srv.url + "/v1/chat/completions", json=body, timeout=900) for srv in (vc4, server))
    assert got.status_code == want.status_code == 200, (got.text, want.text)
    content = got.json()["choices"][0]["message"]["content"]
    assert content == want.json()["choices"][0]["message"]["content"]
    assert set(json.loads(content)) == {"name", "year"}


# ------------------------------------------------- under SGLang's overlap scheduler
# (vericache/overlapped.py; the units are test_vericache_overlap.py)

def _vc_counters(proc) -> dict:
    return requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]["vericache"]


def test_full_kv_iterations_overlap_and_stay_the_plain_servers(server, tokenizer, vc4):
    """Requests that opt out of lossy KV decode from their full KV, two asking for logprobs
    (top and chosen ids), two stopping at stop strings: SGLang runs the overlap loop
    (``disable_overlap_schedule`` false), their iterations are overlapped (the worker's
    counters and trace) with no read-back of what a forward computed, and the output is
    the plain server's: tokens, text, finish reasons, logprobs (a request that finished at
    the previous iteration is still in the batch SGLang launched; its token there is
    discarded, as on a plain server)."""
    info = requests.get(vc4.url + "/get_server_info", timeout=60).json()
    assert info["disable_overlap_schedule"] is False
    before = _vc_counters(vc4)
    start = len(_trace(vc4))
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[200 + 700 * i: 400 + 700 * i] for i in range(4)]

    def run(srv, k):
        params = {"temperature": 0, "max_new_tokens": 24}
        if srv is vc4:
            params["custom_params"] = {"vc_compressor": "none"}
        body = {"input_ids": ids_list[k], "sampling_params": params}
        if k < 2:
            params["ignore_eos"] = True
            body.update(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[13, 264])
        else:
            params["stop"] = [" the", "."]
        r = requests.post(srv.url + "/generate", json=body, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()

    outs = concurrently(lambda k: run(vc4, k), [(k,) for k in range(4)])
    refs = concurrently(lambda k: run(server, k), [(k,) for k in range(4)])
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"], k
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], k
        if k < 2:
            mo, mr = out["meta_info"], ref["meta_info"]
            assert [t[1] for t in mo["output_token_logprobs"]] == [t[1] for t in mr["output_token_logprobs"]]
            assert [t[0] for t in mo["output_token_logprobs"]] == pytest.approx(
                [t[0] for t in mr["output_token_logprobs"]], abs=2e-3)
            for key in ("output_top_logprobs", "output_token_ids_logprobs"):
                for a, b in zip(mo[key], mr[key]):
                    assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=2e-3), (k, key)
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[2:]), [o["meta_info"] for o in outs]

    after = _vc_counters(vc4)
    assert after.get("overlap_async", 0) - before.get("overlap_async", 0) >= 20, after
    records = [r for r in _trace(vc4)[start:] if r["requests"]]
    overlapped = [r for r in records if r["phases"].get("overlapped")]
    assert len(overlapped) >= 20, [r["phases"] for r in records]
    # what the counter sees are reads of host copies (the rows, SGLang's resolved lengths:
    # on this CPU it cannot tell them from device reads), the same few in every iteration,
    # and no read-back of what the forward computed (a drafting iteration reads its tokens)
    project = ("sglang_vc/", "vericache/", "kvruntime/")  # (SGLang's own sites are SGLang's)
    reads = [site for r in overlapped for site in r["phases"]["host_sync_sites"]
             if site.split()[0] in ("to", "item", "cpu", "numpy", "h2d") and site.split()[1].startswith(project)]
    assert not reads, reads
    assert len({r["phases"]["host_syncs"] for r in overlapped}) == 1, [r["phases"] for r in overlapped]
    # the operators the worker launches around SGLang's forward (bench.gpu_parity --trace
    # prices them) do not grow with the batch: no per-request loop over tensors
    by_batch = {}
    for r in overlapped:
        by_batch.setdefault(len(r["requests"]), set()).add(r["phases"]["launches_outside_forward"])
    assert len(by_batch) >= 2 and len(set().union(*by_batch.values())) == 1, by_batch


def test_grammar_iterations_with_nothing_drafting_overlap_and_stay_the_plain_servers(server, tokenizer, vc4):
    """Structured output where nothing drafts (full-KV requests): the iterations run
    overlapped, as a plain server's do (the grammars accept the previous tokens through
    the scheduler's grammar barrier while the forward runs), and each output is the plain
    server's, inside its grammar."""
    import re

    before = _vc_counters(vc4)
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    question = tokenizer("\nThe person above as JSON with a name and a year:", add_special_tokens=False)["input_ids"]
    ids_list = [stream[700 + 900 * i: 900 + 900 * i] + question for i in range(3)]
    regex = r"(19|20)[0-9]{2}, [A-Z][a-z]+"
    cases = [{"json_schema": json.dumps(SCHEMA)}, {"regex": regex}, {"ebnf": 'root ::= "maybe, " [a-z]+'}]

    def run(srv, k):
        custom = {"vc_compressor": "none"} if srv is vc4 else None
        return generate(srv, ids_list[k], 40, custom, ignore_eos=False, **cases[k])

    outs = concurrently(lambda k: run(vc4, k), [(k,) for k in range(3)])
    refs = concurrently(lambda k: run(server, k), [(k,) for k in range(3)])
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert out["output_ids"] == ref["output_ids"], (k, out["text"], ref["text"])
        assert finish_type(out) == finish_type(ref), (k, out["meta_info"])
    assert set(json.loads(outs[0]["text"])) == {"name", "year"}, outs[0]["text"]
    assert re.fullmatch(regex, outs[1]["text"]) and outs[2]["text"].startswith("maybe, "), [o["text"] for o in outs]
    after = _vc_counters(vc4)
    # (the regex and EBNF runs go on to the token limit: tens of iterations with a grammar)
    assert after.get("overlap_async", 0) - before.get("overlap_async", 0) >= 20, after


def test_penalised_iterations_with_nothing_drafting_overlap_and_apply_the_penalties(server, tokenizer, vc4,
                                                                                    model_dir):
    """Frequency, presence and repetition penalties and ``min_new_tokens`` where nothing
    drafts (full-KV requests): the iterations run overlapped, as a plain server's do, the
    token SGLang has not processed yet counted from the device, and each output is the
    plain server's (where the two part, the float32 reference with the same penalties
    sides with VERICACHE, as in the synchronous test above). The penalties changed the
    output and ``min_new_tokens`` held back an early stop token."""
    before = _vc_counters(vc4)
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[500 + 1000 * i: 800 + 1000 * i] for i in range(3)]  # (the penalties change these)
    unpenalised = generate(vc4, ids_list[0], 24, {"vc_compressor": "none"})["output_ids"]
    stop = {"stop_token_ids": [generate(server, ids_list[2], 24)["output_ids"][2]], "ignore_eos": False}
    cases = [{"frequency_penalty": 0.6}, {"presence_penalty": 0.8, "repetition_penalty": 1.3},
             {**stop, "min_new_tokens": 12}]
    mid = _vc_counters(vc4)

    def run(srv, k):
        return generate(srv, ids_list[k], 24, {"vc_compressor": "none"} if srv is vc4 else None, **cases[k])

    outs = concurrently(lambda k: run(vc4, k), [(k,) for k in range(3)])
    refs = concurrently(lambda k: run(server, k), [(k,) for k in range(3)])
    for k, (out, ref) in enumerate(zip(outs, refs)):
        if out["output_ids"] != ref["output_ids"]:
            _left_the_reference(model_dir, ids_list[k], out["output_ids"], ref["output_ids"], cases[k])
            continue
        assert finish_type(out) == finish_type(ref), (k, out["meta_info"])
    assert outs[0]["output_ids"] != unpenalised  # the frequency penalty was applied
    assert len(outs[2]["output_ids"]) >= 12  # min_new_tokens held back the stop token
    after = _vc_counters(vc4)
    assert mid.get("overlap_async", 0) > before.get("overlap_async", 0)
    assert after.get("overlap_async", 0) - mid.get("overlap_async", 0) >= 20, after
    assert after.get("verify_rounds", 0) == before.get("verify_rounds", 0), after  # nothing drafted


def test_drafting_iterations_run_synchronously_and_stay_lossless(server, model_dir, tokenizer, vc4):
    """Compressed requests drafting beside full-KV ones: the drafting iterations run
    synchronously, and every output (short ones with 1-3 tokens among them: SGLang's
    overlap loop leaves out of a batch what it counts as finishing) is the plain
    server's."""
    before = _vc_counters(vc4)
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    full_ids = [stream[0:120], stream[500:590]]
    spec_ids = [stream[1000 + 400 * i: 1200 + 450 * i] for i in range(3)]
    short_ids = [stream[3000:3150 + i] for i in range(3)]
    jobs = ([(ids, 40, {"vc_compressor": "none"}) for ids in full_ids] + [(ids, 32, None) for ids in spec_ids]
            + [(ids, n, None) for ids, n in zip(short_ids, (1, 2, 3))])
    outs = concurrently(lambda ids, n, custom: generate(vc4, ids, n, custom), jobs)
    refs = concurrently(lambda ids, n, custom: generate(server, ids, n), jobs)
    for (ids, n, _), out, ref in zip(jobs, outs, refs):
        assert finish_type(out) == finish_type(ref) and len(out["output_ids"]) == len(ref["output_ids"]) == n
        if out["output_ids"] != ref["output_ids"]:
            result = compare(greedy_reference(model_dir, ids, n), out["output_ids"], finish_type(out))
            assert result.identical, (len(ids), result)
    after = _vc_counters(vc4)
    assert after.get("overlap_synced", 0) > before.get("overlap_synced", 0), after
    assert after["verify_rounds"] > before.get("verify_rounds", 0), after  # the compressed path was taken
    assert sum(o["meta_info"][META][-1]["drafted"] for o in outs[2:5]) > 0


def test_a_second_turn_reuses_the_offloaded_first_turns_prompt_and_answer(server, tokenizer, vc4):
    """An offloaded request's full KV goes back into its row when it ends and the radix
    tree keeps it (#80): the second turn of the chat (first prompt, its answer, a new
    question) finds the first turn's prompt and answer in ``cached_tokens``, as on a plain
    server, and its output is the plain server's."""
    before = _vc_counters(vc4)
    passages = real_text_passages(12, words=400)
    first = tokenizer(passages[7])["input_ids"][:900]
    turn1 = generate(vc4, first, 24)
    assert turn1["output_ids"] == generate(server, first, 24)["output_ids"]
    assert turn1["meta_info"][META][-1]["mode"] == "offload", turn1["meta_info"][META]  # compressed, offloaded
    kept = _vc_counters(vc4)
    assert kept.get("finished_kv_kept", 0) == before.get("finished_kv_kept", 0) + 1, kept
    second = first + turn1["output_ids"] + tokenizer(passages[8])["input_ids"][:300]
    turn2 = generate(vc4, second, 24)
    # the prompt and the answer (the last answer token's KV is computed by this turn)
    assert turn2["meta_info"]["cached_tokens"] >= len(first) + len(turn1["output_ids"]) - 1, turn2["meta_info"]
    ref = generate(server, second, 24)
    assert turn2["output_ids"] == ref["output_ids"] and finish_type(turn2) == finish_type(ref)


def test_an_empty_prompt_in_a_batch_does_not_take_the_server_down(server, vc4):
    """SGLang refuses one empty prompt (HTTP 400) but passes one inside a batch to the
    scheduler; the compressed path once compressed its 0 tokens and the scheduler died.
    The batch gets the plain server's answer and the server goes on serving."""
    body = {"input_ids": [[5, 6, 7, 8], []], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    got, want = (requests.post(srv.url + "/generate", json=body, timeout=300) for srv in (vc4, server))
    assert got.status_code == want.status_code, (got.text, want.text)
    if got.status_code == 200:
        assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in want.json()]
    assert generate(vc4, [5, 6, 7, 8], 4)["output_ids"] == generate(server, [5, 6, 7, 8], 4)["output_ids"]


def test_nothing_parks_state_on_the_runtime_or_the_attention_backend(vc4):
    """A forward's plan travels on the forward and the worker's answers to SGLang's
    scheduler on one registered object: after this module's drafting, verifying, staging,
    penalised, grammar, logprob and overlapped full-KV iterations on this server, no
    attribute of the runtime or of the attention backend was written from outside their
    own methods (``SGLANG_VC_WATCH_WRITES``, :mod:`sglang_vc.kvruntime.writes`)."""
    counters = vc_counters(vc4)["counters"]
    vc = counters["vericache"]
    assert vc["verify_rounds"] > 0 and vc["draft_steps"] > 0 and vc.get("overlap_async", 0) > 0, vc
    assert vc.get("reloads_ahead", 0) + vc.get("reloads_at_verify", 0) > 0, vc  # staged verifies ran
    assert "state_writes" not in counters, counters["state_writes"]
