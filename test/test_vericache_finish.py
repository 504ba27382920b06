"""Every finish condition ends a drafting VERICACHE request where full-KV decoding ends
it, with the requests real clients send: stop strings of 1-8 characters inside accepted
runs (with and without ``no_stop_trim``, a regex or a JSON schema, streamed or not),
stop tokens, EOS, ``min_new_tokens``, and SGLang's own frontend-language programs.

Two drafting servers, each against the shared plain server (full KV):
- in-pool, ``--vc-in-pool always --vc-draft-budget 32``: drafts over a sparse view, long
  accepted runs;
- offload, SnapKV at 0.25 with ``--vc-compress-when always``, X = 8.
The run-by-run check itself is proved over random runs in ``test_finish_check``.
"""

from __future__ import annotations

import json
import random

import pytest
import requests

from conftest import real_text_passages, release_after_last_use
from sglang_vc.testing.client import concurrently
from sglang_vc.testing.server import ServerProcess
from test_vericache_serving import flush_cache

META = "sglang_vc_vericache"
MODES = {
    "in_pool": ["--vc-in-pool", "always", "--vc-draft-budget", "32"],
    "offload": ["--vc-compress-when", "always", "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25",
                "--speculative-num-draft-tokens", "8"],
}
DNS = 'Q: What is the full name of DNS?\nA: The full names is ""\nQ: Which year was DNS invented?\nA: '


@pytest.fixture(scope="module", params=list(MODES))
def vc(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"finish_{request.param}")
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "20000", "--speculative-algorithm", "VERICACHE",
                          *MODES[request.param]], log_path=folder / "server.log")
    proc.mode = request.param
    release_after_last_use(request, proc)
    yield proc
    proc.stop()


def _post(server, body: dict) -> dict:
    r = requests.post(server.url + "/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict) -> dict:
    """A streamed ``/generate``: the last chunk, with ``chunks`` (each chunk's output ids)."""
    chunks, last = [], None
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=900) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
                chunks.append(last["output_ids"])
    assert last is not None
    last["chunks"] = chunks
    return last


def _same(out: dict, ref: dict, what) -> None:
    assert out["output_ids"] == ref["output_ids"], (what, out["text"], ref["text"])
    assert out["text"] == ref["text"], what
    assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], (what, out["meta_info"])
    if "output_token_logprobs" in ref["meta_info"]:
        got, want = out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in got] == [t[1] for t in want], what
        assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=2e-3), what


@pytest.mark.parametrize("constraint", ["regex", "none"])
def test_dtype_gen_stops_at_the_newline(server, vc, constraint):
    """SGLang's ``test_dtype_gen`` request, reduced (issue 78): ``sgl.gen(dtype=int)`` sends
    ``[-+]?[0-9]+[ \\n]*`` with stops ``[" ", "\\n"]``. Full KV answers ``2003`` and stops at
    the newline; a drafting server committed ``2003\\n\\n `` in one run and stopped at the
    space (or ``2003\\nQ:`` without the regex)."""
    params = {"max_new_tokens": 64, "temperature": 0, "stop": [" ", "\n"]}
    if constraint == "regex":
        params["regex"] = r"[-+]?[0-9]+[ \n]*"
    body = {"text": DNS, "sampling_params": params}
    flush_cache(vc)  # (the other constraint's run would be cached: nothing to compress or draft)
    ref, out = _post(server, body), _post(vc, body)
    assert (ref["text"], ref["output_ids"]) == ("2003", [34, 32, 32, 35, 198])
    assert ref["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}
    _same(out, ref, constraint)
    assert out["meta_info"][META][-1]["accepted"] >= 1  # a run of tokens was committed at once


SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
          "required": ["title", "summary"]}


def _cases(free: list[dict], rng: random.Random) -> list[dict]:
    """One request per free-running output: its stops cut from that output's text (1-8
    characters from a random place, so they fire inside it, often inside a run), plus a
    random short one; ``no_stop_trim``, streaming and a stop token vary by request."""
    cases = []
    for i, f in enumerate(free):
        text, body = f["text"], f["body"]
        stops = []
        for _ in range(rng.randint(1, 2)):
            n = rng.randint(1, 8)
            at = rng.randrange(max(1, len(text) - n))
            if text[at : at + n]:
                stops.append(text[at : at + n])
        stops.append(rng.choice([" the", ".", ",", "\n", "ing", "\"", "} "]))
        params = {**body["sampling_params"], "stop": stops, "no_stop_trim": i % 2 == 1}
        if i % 5 == 4:
            params["stop_token_ids"] = [f["output_ids"][rng.randrange(len(f["output_ids"]))]]
        cases.append({**body, "sampling_params": params, "stream": i % 4 >= 2, "return_logprob": i % 3 == 0})
    return cases


def test_random_stops_in_a_mixed_batch(server, vc, tokenizer):
    """12 requests decoding together: plain text, a regex and a JSON schema, each with stops
    cut from its own free-running output, some with logprobs. Text, ids, finish reason
    and logprobs are full KV's; each streamed chunk brings new tokens and none past the
    stop; drafts were accepted."""
    rng = random.Random(78)
    passages = real_text_passages(12, words=120)
    grammars = [{}, {"regex": r"[A-Za-z ,.'\n]+"}, {"json_schema": json.dumps(SCHEMA)}]
    bodies = []
    for i, passage in enumerate(passages):
        prompt = passage if i % 3 != 2 else f"{passage}\nThe passage as JSON with a title and a summary:\n"
        bodies.append({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                            **grammars[i % 3]}})
    free = concurrently(lambda b: {**_post(server, b), "body": b}, [(b,) for b in bodies])
    cases = _cases(free, rng)

    def run(srv, body):
        return _stream(srv, body) if body["stream"] else _post(srv, body)

    refs = concurrently(lambda b: run(server, b), [(b,) for b in cases])
    before = _accepted(vc)
    outs = concurrently(lambda b: run(vc, b), [(b,) for b in cases])
    stopped = 0
    for i, (case, out, ref) in enumerate(zip(cases, outs, refs)):
        _same(out, ref, (i, case["sampling_params"]))
        stopped += ref["meta_info"]["finish_reason"]["type"] == "stop"
        chunks = out.get("chunks", [])
        for chunk in chunks:
            assert chunk == ref["output_ids"][: len(chunk)], (i, chunk)
        # every chunk brings new tokens (none repeats the last while the request drafts)
        assert all(len(a) < len(b) for a, b in zip(chunks, chunks[1:])), (i, [len(c) for c in chunks])
    assert stopped >= len(cases) // 2, stopped  # the stops fired, mostly mid-output
    assert _accepted(vc) > before


@pytest.mark.parametrize("vc", ["in_pool"], indirect=True)  # (offloaded drafters run synchronously)
def test_overlapped_drafting_stops_where_full_kv_stops(server, vc, tokenizer):
    """In-pool drafters with no grammar, penalty or logprobs decode under SGLang's overlap
    loop (:mod:`sglang_vc.vericache.deferred`): 10 requests of 16-43 new tokens with stops
    cut from their own output (inside accepted runs), streamed or not, stop tokens among
    them, leaving the batch one by one while the others draft. Text, ids and
    finish reason are full KV's, and the iterations were overlapped, not synchronous.
    (Offloaded drafters run synchronously: ``test_random_stops_in_a_mixed_batch``.)"""
    rng = random.Random(74)
    # (lengths apart: requests leave the batch one by one, while the others draft on)
    bodies = [{"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": 16 + 3 * i}}
              for i, p in enumerate(real_text_passages(10, words=120))]
    free = concurrently(lambda b: {**_post(server, b), "body": b}, [(b,) for b in bodies])
    cases = [{**c, "return_logprob": False} for c in _cases(free, rng)]

    def run(srv, body):
        return _stream(srv, body) if body["stream"] else _post(srv, body)

    refs = concurrently(lambda b: run(server, b), [(b,) for b in cases])
    before = _counters(vc)
    outs = concurrently(lambda b: run(vc, b), [(b,) for b in cases])
    after = _counters(vc)
    for i, (case, out, ref) in enumerate(zip(cases, outs, refs)):
        _same(out, ref, (i, case["sampling_params"]))
    assert sum(r["meta_info"]["finish_reason"]["type"] == "stop" for r in refs) >= len(cases) // 2
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew.get("overlapped_draft_iterations", 0) >= 10 and grew.get("accepted", 0) > 0, grew


def _counters(proc) -> dict:
    return requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]["vericache"]


def test_eos_and_min_new_tokens(server, vc, tokenizer):
    """EOS ends a request (``ignore_eos`` off), ``min_new_tokens`` holds it back, and an
    EOS id given as a stop token: full KV's tokens and finish reasons, in one batch."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in three words."}],
                                         tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token_id
    bodies = [{"text": chat, "sampling_params": {"temperature": 0, "max_new_tokens": 48}},
              {"text": chat, "sampling_params": {"temperature": 0, "max_new_tokens": 48, "min_new_tokens": 20}},
              {"text": chat, "sampling_params": {"temperature": 0, "max_new_tokens": 48, "stop_token_ids": [eos],
                                                 "stop": ["!"]}}]
    refs = concurrently(lambda b: _post(server, b), [(b,) for b in bodies])
    outs = concurrently(lambda b: _post(vc, b), [(b,) for b in bodies])
    for i, (out, ref) in enumerate(zip(outs, refs)):
        _same(out, ref, i)
    assert refs[0]["meta_info"]["finish_reason"]["type"] == "stop"  # EOS reached
    assert len(refs[1]["output_ids"]) >= 20


@pytest.fixture(scope="module")
def plain_programs(server):
    from sglang_vc.testing.dsl import program_names, run_programs

    return run_programs(server.url, program_names())


@pytest.mark.slow
@pytest.mark.parametrize("vc", ["in_pool", "offload"], indirect=True)
def test_sglang_test_programs_identical(plain_programs, vc):
    """SGLang's ``sglang/test/test_programs.py`` (the programs ``sglang_vc.testing.dsl``
    does not skip, each skip with its reason), greedy: every ``/generate`` exchange (the
    request, the text, ids and finish reason; a stream's last chunk) and every program's
    outcome (passed, or the exception its own check raised on the small model) are the
    plain server's, and the server accepted drafts. Slow (2 and 4 minutes here, with
    the plain server's run): the default run has the stop-string checks above, the
    ``test_dtype_gen`` request among them."""
    from sglang_vc.testing.dsl import run_programs

    before = _accepted(vc)
    runs = run_programs(vc.url, list(plain_programs))
    for name, ref in plain_programs.items():
        # (the exception's type: its message may quote floats or chunk sizes, which differ
        # where a stream delivers accepted runs several tokens at a time)
        assert runs[name].outcome.split(":")[0] == ref.outcome.split(":")[0], (name, runs[name].outcome, ref.outcome)
        assert runs[name].key() == ref.key(), name
    assert sum(len(r.exchanges) for r in runs.values()) >= 40
    assert runs["test_dtype_gen"].outcome == "ok" and runs["test_stream"].exchanges
    assert _accepted(vc) > before


def _accepted(server) -> int:
    info = requests.get(server.url + "/server_info", timeout=60).json()["sglang_vc"]
    return info["counters"].get("vericache", {}).get("accepted", 0)  # (none before its first verify)
