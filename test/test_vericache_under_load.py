"""VERICACHE under load: SGLang retracting drafting, verifying and reloading requests
when the pool binds mid-decode, clients dropping their streams and ``/abort_request``
during drafts and reloads. Every request that finishes is the plain server's, token for
token; once the server is idle its pool is whole and nothing is held for a request that
left (host store bytes, staged-reload arena blocks, verify headroom)."""

from __future__ import annotations

import json
import threading
import time

import requests

from conftest import real_text_passages
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess

META = "sglang_vc_vericache"
RATIO = 0.25


def _prompts(tokenizer, n: int, tokens: int, offset: int = 0) -> list[list[int]]:
    stream = [t for text in real_text_passages(24, words=400) for t in tokenizer(text)["input_ids"]]
    out = [stream[offset + i * (tokens + 40) : offset + i * (tokens + 40) + tokens] for i in range(n)]
    assert all(len(ids) == tokens for ids in out), len(stream)
    return out


def _vc_server(tmp_path, *extra) -> ServerProcess:
    return ServerProcess(["--dtype", "float32", "--speculative-algorithm", "VERICACHE",
                          "--speculative-num-draft-tokens", "4", "--vc-compress-when", "always",
                          "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO), "--skip-server-warmup",
                          *extra], log_path=tmp_path / "server.log")


def _identical(server, model_dir, ids_list, outs, n, **sampling):
    """Each output is the plain server's for the same request (same tokens, length and
    finish reason), or parts from it only at a near-tie of the float32 reference."""
    refs = concurrently(lambda ids: generate(server, ids, n, **sampling), [(i,) for i in ids_list])
    for ids, ref, out in zip(ids_list, refs, outs):
        if out["output_ids"] == ref["output_ids"]:
            assert finish_type(out) == finish_type(ref) in ("length", "stop"), (out["meta_info"], ref["meta_info"])
            continue
        reference = greedy_reference(model_dir, ids, n)
        at = next(j for j, (a, b) in enumerate(zip(out["output_ids"] + [-1], ref["output_ids"] + [-2])) if a != b)
        assert at < len(reference.tokens) and reference.is_near_tie(at), (at, out["output_ids"], ref["output_ids"])


def assert_idle_and_whole(proc, timeout: float = 60) -> dict:
    """Once the server is idle: every pool slot is free or held by the radix cache, and
    nothing is held for requests that left: no host store bytes, no staged-reload arena
    block, no verify headroom."""
    deadline = time.time() + timeout
    while True:
        counters = requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]
        pool = counters["kv_pool"]
        whole = pool["available_tokens"] + pool["evictable_tokens"] == pool["total_tokens"]
        held = (pool["host_store_bytes"], pool["reload_ahead_bytes"], pool["verify_headroom_tokens"])
        if whole and held == (0, 0, 0):
            return counters
        assert time.time() < deadline, pool
        time.sleep(0.5)


def test_retracted_requests_are_identical_and_leave_nothing_held(server, model_dir, tokenizer, tmp_path):
    """Eight compressed requests in a pool that binds mid-decode (admitted optimistically:
    they may stop at EOS, and ``--schedule-conservativeness 0.05``): their verifies starve
    for staging room, so SGLang is made to retract some while they draft, verify and reload
    (without that nothing committed and the server stalled: drafts take one slot an
    iteration, as decoding does), and prefills them again. Every output is the plain
    server's, drafts were rejected somewhere, and the idle server holds nothing for them."""
    n, new = 8, 160
    ids_list = _prompts(tokenizer, n, 300)
    with _vc_server(tmp_path, "--max-total-tokens", "1300", "--schedule-conservativeness", "0.05") as proc:
        outs = concurrently(lambda ids: generate(proc, ids, new, ignore_eos=False), [(i,) for i in ids_list])
        counters = assert_idle_and_whole(proc)
    assert sum(o["meta_info"].get("num_retractions", 0) for o in outs) > 0, "nothing was retracted"
    _identical(server, model_dir, ids_list, outs, new, ignore_eos=False)
    infos = [(o["meta_info"].get(META) or [{}])[-1] for o in outs]
    assert 0 < sum(i.get("accepted", 0) for i in infos) < sum(i.get("drafted", 0) for i in infos), infos
    assert counters["vericache"]["bytes_reloaded"] > 0, counters["vericache"]


def _stream(proc, ids, new, rid, chunks_before_drop=None, on_first=None):
    """A streamed greedy request; with ``chunks_before_drop`` the client closes the
    connection after that many chunks. Returns the last chunk read."""
    body = {"input_ids": ids, "rid": rid, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
    last, seen = None, 0
    with requests.post(proc.url + "/generate", json=body, stream=True, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            last, seen = json.loads(line[5:]), seen + 1
            if seen == 1 and on_first is not None:
                on_first()
            if chunks_before_drop is not None and seen >= chunks_before_drop:
                break  # the client goes away mid-stream
    return last


def test_dropped_streams_and_aborts_release_everything(server, model_dir, tokenizer, tmp_path):
    """Six compressed requests stream at once: two clients drop their streams after three
    chunks, one request is aborted by ``/abort_request`` after its first chunk (it was
    drafting or reloading then). The three others finish with the plain server's tokens;
    the aborted one says so; the idle server holds nothing for any of them."""
    n, new = 6, 48
    ids_list = _prompts(tokenizer, n, 300, offset=20)
    with _vc_server(tmp_path, "--max-total-tokens", "6000") as proc:
        aborted = threading.Event()

        def abort():
            requests.post(proc.url + "/abort_request", json={"rid": "abort-me"}, timeout=60)
            aborted.set()

        plans = [("keep-0", None, None), ("keep-1", None, None), ("keep-2", None, None),
                 ("drop-0", 3, None), ("drop-1", 3, None), ("abort-me", None, abort)]
        outs = concurrently(lambda ids, plan: _stream(proc, ids, new, plan[0], plan[1], plan[2]),
                            list(zip(ids_list, plans)))
        assert aborted.is_set()
        assert finish_type(outs[5]) == "abort", outs[5]
        _identical(server, model_dir, ids_list[:3], outs[:3], new)
        assert_idle_and_whole(proc)
        # and it serves on
        assert len(generate(proc, ids_list[3], 8)["output_ids"]) == 8


# ----------------------------------------------------------------------------- load

LOAD_NEW = 16


def _load_requests(tokenizer) -> list[tuple[str, dict]]:
    """64 requests of 80-200 prompt tokens, of every kind a client sends: plain greedy,
    streamed, stop strings (set later, from the plain server's text), ``n=2``, seeded
    temperature > 0, penalties, a regex, and requests opted out of compression."""
    stream = [t for text in real_text_passages(40, words=400) for t in tokenizer(text)["input_ids"]]
    kinds = (["greedy"] * 14 + ["stream"] * 10 + ["stop"] * 10 + ["n2"] * 6 + ["seeded"] * 8
             + ["penalised"] * 8 + ["regex"] * 4 + ["opted_out"] * 4)
    out, at = [], 0
    for i, kind in enumerate(kinds):
        n = (80, 140, 200)[i % 3]
        at = at + n if at + 2 * n < len(stream) else 0
        params = {"temperature": 0, "max_new_tokens": LOAD_NEW, "ignore_eos": True}
        body: dict = {"input_ids": stream[at : at + n]}
        if kind == "n2":
            params["n"] = 2
        elif kind == "seeded":
            params.update(temperature=0.8, top_k=20, sampling_seed=1000 + i)
        elif kind == "penalised":
            # no repetition_penalty: SGLang 0.5.23's own decode on CPU departs from its
            # formula there (docs/vericache.md, "Penalties"), VERICACHE follows the formula
            params.update(frequency_penalty=0.5, presence_penalty=0.2)
        elif kind == "regex":
            params.update(regex=r"( [a-z]+){3,}\.", ignore_eos=False)
        elif kind == "opted_out":
            params["custom_params"] = {"vc_compressor": "none"}
        body["sampling_params"] = params
        out.append((kind, body))
    return out


def _post(proc, body: dict) -> list[dict]:
    """The reply (a list: ``n=2`` gives two) of ``/generate``; a streamed request's is its
    last chunk, with the text joined from every chunk."""
    if not body.get("stream"):
        r = requests.post(proc.url + "/generate", json=body, timeout=900)
        assert r.status_code == 200, r.text
        got = r.json()
        return got if isinstance(got, list) else [got]
    last, text = None, ""
    with requests.post(proc.url + "/generate", json=body, stream=True, timeout=900) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
                text = last["text"]  # cumulative, as SGLang streams it by default
    assert last is not None
    return [{**last, "text": text}]


def _near_tie(ref: dict, step: int) -> bool:
    """The plain server's two best tokens at ``step`` are within float32 noise of each other."""
    tops = ref["meta_info"]["output_top_logprobs"][step]
    return len(tops) > 1 and abs(tops[0][0] - tops[1][0]) < 2e-3


def _penalised_choice(model_dir, body: dict, prefix: list[int]) -> tuple[int, bool]:
    """After ``prefix`` (the output both servers share): the token a float32 reference
    picks with the request's frequency and presence penalties applied by SGLang's formula,
    and whether its two best are a near-tie there."""
    import torch

    from sglang_vc.testing.reference import NEAR_TIE_REL, load_hf_model

    sp = body["sampling_params"]
    with torch.inference_mode():
        logits = load_hf_model(model_dir)(torch.tensor([body["input_ids"] + prefix])).logits[0, -1].float()
    counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=logits.numel()).float()
    logits = logits - sp.get("frequency_penalty", 0.0) * counts - sp.get("presence_penalty", 0.0) * (counts > 0)
    top = torch.topk(logits, 2)
    return int(top.indices[0]), float(top.values[0] - top.values[1]) < NEAR_TIE_REL * abs(float(top.values[0]))


def test_sixty_four_mixed_requests_on_a_binding_pool_are_the_plain_servers(server, model_dir, tokenizer, tmp_path):
    """64 concurrent requests of every kind on a pool that binds, prefilled in chunks of
    256: every greedy reply (streamed, stopped by a stop string, ``n=2``, penalised,
    regex-constrained, opted out) has the plain server's tokens, text and finish reason,
    parting from it only where the plain server's own two best tokens tie within float32
    noise, or, for a penalised request, where the plain server leaves SGLang's penalty
    formula and VERICACHE takes the formula's token (a float32 reference's); seeded temperature > 0 replies have the length and finish reason sampling
    gives; drafts were rejected somewhere, and the idle server holds nothing.

    The pool binds at admission (requests wait for room), not by retraction: SGLang's
    penalizers count a request's output again from zero when it is retracted and
    prefilled again (``penaltylib``'s ``_prepare``), so a retracted penalised request is
    not the unretracted plain server's even on a plain server. Retraction has the test
    above, on greedy requests."""
    reqs = _load_requests(tokenizer)

    def run(proc, bodies, logprobs=False):
        extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
        return concurrently(lambda b: _post(proc, {**b, **extra}), [(b,) for b in bodies])

    def plain(body):  # the plain server refuses compression options it would ignore
        params = {k: v for k, v in body["sampling_params"].items() if k != "custom_params"}
        return {**body, "sampling_params": params}

    # stop strings: a word from the middle of what the plain server writes for them
    stops = [i for i, (k, _) in enumerate(reqs) if k == "stop"]
    for i, got in zip(stops, run(server, [plain(reqs[i][1]) for i in stops])):
        words = [w for w in got[0]["text"][len(got[0]["text"]) // 3 :].split() if len(w) >= 3]
        assert words, got[0]["text"]
        reqs[i][1]["sampling_params"]["stop"] = [words[0]]
    for kind, body in reqs:
        if kind == "stream":
            body["stream"] = True

    refs = run(server, [plain(b) for _, b in reqs], logprobs=True)
    with _vc_server(tmp_path, "--max-total-tokens", "5000", "--chunked-prefill-size", "256",
                    "--schedule-conservativeness", "1.5") as proc:
        outs = run(proc, [b for _, b in reqs])
        counters = assert_idle_and_whole(proc)
        assert requests.get(proc.url + "/health", timeout=60).status_code == 200

    plain_departs = []  # penalised requests where the plain server left the formula
    for (kind, body), ref_list, out_list in zip(reqs, refs, outs):
        assert len(out_list) == len(ref_list) == (2 if kind == "n2" else 1), (kind, len(out_list))
        for ref, out in zip(ref_list, out_list):
            if kind == "seeded":
                assert len(out["output_ids"]) == LOAD_NEW and finish_type(out) == "length", out["meta_info"]
                continue
            assert finish_type(out) in ("length", "stop"), (kind, out["meta_info"])
            if out["output_ids"] == ref["output_ids"]:
                assert out["text"] == ref["text"] and out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], (
                    kind, out["text"], ref["text"], out["meta_info"]["finish_reason"], ref["meta_info"]["finish_reason"])
                continue
            at = next(j for j, (a, b) in enumerate(zip(out["output_ids"] + [-1], ref["output_ids"] + [-2])) if a != b)
            if kind == "penalised" and at < len(ref["output_ids"]):
                # the plain server's own penalised decode departs from SGLang's formula in
                # some batches (docs/vericache.md, "Penalties"); VERICACHE must not
                choice, tie = _penalised_choice(model_dir, body, ref["output_ids"][:at])
                assert tie or out["output_ids"][at] == choice != ref["output_ids"][at], (
                    at, choice, out["output_ids"], ref["output_ids"])
                plain_departs.append(at)
                continue
            assert at < len(ref["output_ids"]) and _near_tie(ref, at), (
                kind, at, out["output_ids"], ref["output_ids"], out["meta_info"].get("num_retractions"))
    # every kind above shared the server's batches with compressed drafting
    assert sum(o["meta_info"].get("num_retractions", 0) for got in outs for o in got) == 0
    infos = [(o["meta_info"].get(META) or [{}])[-1] for got in outs for o in got]
    assert 0 < sum(i.get("accepted", 0) for i in infos) < sum(i.get("drafted", 0) for i in infos), infos
    assert counters["vericache"]["bytes_reloaded"] > 0, counters["vericache"]
    stopped = [o for i in stops for o in outs[i]]
    assert sum(finish_type(o) == "stop" for o in stopped) >= len(stops) // 2, [o["meta_info"]["finish_reason"] for o in stopped]
    print(f"penalised replies where the plain server departs from the formula: {len(plain_departs)} (at {plain_departs})")
