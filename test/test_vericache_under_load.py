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
        held = (pool["host_store_bytes"], pool["reload_staging_in_use_bytes"], pool["verify_headroom_tokens"])
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
