"""VERICACHE under SGLang's overlap scheduler (``vericache/overlapped.py``,
``sglang_vc/overlap.py``): the iterations in which no request drafts overlap the host's
work as a plain server's do, the others run synchronously, and the output is the plain
server's either way.

Server tests: one VERICACHE server with its default overlap scheduling and sync counting,
against the shared plain server (full KV).
"""

from __future__ import annotations

import json
import types
from collections import deque

import pytest
import requests
import torch

from conftest import real_text_passages
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import compare, finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess

META = "sglang_vc_vericache"


# ----------------------------------------------------------------------------- units

def test_vericache_keeps_the_overlap_scheduler_other_algorithms_do_not(caplog, monkeypatch):
    import logging

    from sglang_vc import notices
    from sglang_vc.speculative import resolve_flags

    # A notice is said once per process: start from none, whatever ran before in this worker.
    monkeypatch.setattr(notices, "_all", [])
    monkeypatch.setattr(notices, "_pending", [])

    vc = types.SimpleNamespace(speculative_algorithm="VERICACHE", disable_overlap_schedule=False,
                               enable_mixed_chunk=False)
    resolve_flags(vc, "vc_verify", overlap=True)
    assert vc.disable_overlap_schedule is False
    sc = types.SimpleNamespace(speculative_algorithm="SPECACHE", disable_overlap_schedule=False,
                               enable_mixed_chunk=False)
    resolve_flags(sc, "vc_specache")
    assert sc.disable_overlap_schedule is True
    with caplog.at_level(logging.WARNING, logger="sglang_vc"):
        notices.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert any("SPECACHE" in m and "overlap scheduler" in m for m in lines), lines
    assert not any("VERICACHE" in m and "overlap scheduler" in m for m in lines), lines


def test_registered_vericache_supports_overlap():
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_vc.vericache.worker_spec import register

    register()
    assert get_spec("VERICACHE").supports_overlap is True


def test_last_tokens_relays_the_last_committed_or_the_previous():
    from sglang_vc.overlap import last_tokens

    tokens = torch.tensor([[5, 6, 7, 0], [9, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32).flatten()
    lens = torch.tensor([3, 1, 0], dtype=torch.int32)
    previous = torch.tensor([1, 2, 3])
    assert last_tokens(tokens, lens, previous).tolist() == [7, 9, 3]


def test_widen_scatters_the_running_requests_back_into_batch_order():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    from sglang_vc.overlap import RelayInput, widen

    stride, live = 2, [0, 2]
    batch = types.SimpleNamespace(reqs=[object()] * 3, seq_lens=torch.tensor([10, 20, 30]))
    out = LogitsProcessorOutput(next_token_logits=None)
    out.next_token_logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    out.next_token_top_logprobs_val = [[0.1], [0.2], [0.3], [0.4]]
    result = GenerationBatchResult(
        logits_output=out, next_token_ids=torch.tensor([1, 2, 3, 4], dtype=torch.int32),
        can_run_cuda_graph=False, accept_lens=torch.tensor([2, 1], dtype=torch.int32),
        new_seq_lens=torch.tensor([12, 31]), next_draft_input=RelayInput(draft_token_num=stride,
                                                                           new_seq_lens=torch.tensor([12, 31])),
        speculative_num_draft_tokens=stride, speculative_output_stride=stride)
    widen(result, live, batch)
    assert result.next_token_ids.tolist() == [1, 2, 0, 0, 3, 4]
    assert result.accept_lens.tolist() == [2, 0, 1]
    assert result.new_seq_lens.tolist() == [12, 20, 31]  # the finished one keeps its length
    assert result.logits_output.next_token_logprobs.tolist() == [[-1.0, -2.0], [0.0, 0.0], [-3.0, -4.0]]
    top = result.logits_output.next_token_top_logprobs_val
    assert len(top) == 6 and top[:2] == [[0.1], [0.2]] and top[4:] == [[0.3], [0.4]]
    # only the finished request asked for logprobs: SGLang still reads the batch's field
    batch.return_logprob = True
    result = GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=None), next_token_ids=torch.tensor([1, 2, 3, 4]),
        can_run_cuda_graph=False, accept_lens=torch.tensor([2, 1]), new_seq_lens=torch.tensor([12, 31]),
        next_draft_input=RelayInput(draft_token_num=stride, new_seq_lens=torch.tensor([12, 31])),
        speculative_num_draft_tokens=stride, speculative_output_stride=stride)
    assert widen(result, live, batch).logits_output.next_token_logprobs.shape == (3, 2)


def test_slots_ahead_counts_the_tokens_sglang_has_not_processed_yet():
    """SGLang allocates decode batch k before it processes the result of k - 1: a request's
    ``kv_committed_len`` lags the worker's own count by what that result committed. The
    reserve must cover the worker's count (else the forward writes past its slots)."""
    from sglang_vc.vericache.staggered import Track
    from sglang_vc.vericache.staggered_round import StaggeredRound

    track = Track("a", 7, 103)
    track.drafts = [1, 2]
    worker = types.SimpleNamespace(_staggered=types.SimpleNamespace(tracks={"a": track}))
    req = types.SimpleNamespace(rid="a", kv=types.SimpleNamespace(kv_committed_len=100, req_pool_idx=7))
    assert StaggeredRound._slots_ahead(worker, req) == 3 + 2 + 1  # committed + 6 slots in all
    req.kv.kv_committed_len = 103  # processed
    assert StaggeredRound._slots_ahead(worker, req) == 3
    req.kv.req_pool_idx = 8  # prefilled again in another row: its first token
    assert StaggeredRound._slots_ahead(worker, req) == 1


def test_finishing_requests_that_commit_nothing_stay_in_the_batch():
    from sglang_vc.hooks import _keep_requests_that_commit_nothing_yet

    a, b = types.SimpleNamespace(rid="a"), types.SimpleNamespace(rid="b")
    scheduler = types.SimpleNamespace(model_worker=types.SimpleNamespace(commits_nothing={"b"}))
    assert _keep_requests_that_commit_nothing_yet(lambda s, batch: [a, b], scheduler, None) == [a]


def test_verify_flags_are_read_in_the_order_sglang_processes_results():
    """Under the overlap scheduler the worker runs forward k before SGLang processes the
    result of k - 1: the flag of each forward is queued, not overwritten."""
    from sglang_vc.hooks import _correct_drafts_histogram

    calls = []
    req = types.SimpleNamespace(vc_verify_log=deque([False, True]), vc_verified=False, spec_verify_ct=1,
                                spec_num_correct_drafts=0)
    _correct_drafts_histogram(lambda r, n: calls.append(n), req, 0)  # k - 1: decoded from full KV
    assert calls == [] and req.spec_verify_ct == 0
    _correct_drafts_histogram(lambda r, n: calls.append(n), req, 2)  # k: a verify
    assert calls == [2]


# ----------------------------------------------------------------------------- server

@pytest.fixture(scope="module")
def vc_overlap(tmp_path_factory):
    """VERICACHE with SGLang's overlap scheduler (its default), X = 4, compressing when
    asked per request (``vc_compressor``); host syncs counted into the trace."""
    folder = tmp_path_factory.mktemp("vericache_overlap")
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000", "--speculative-algorithm", "VERICACHE",
         "--speculative-num-draft-tokens", "4", "--vc-compress-when", "always", "--vc-compressor", "snapkv",
         "--vc-compression-ratio", "0.25", "--vc-schedule-trace", str(folder / "trace.jsonl")],
        log_path=folder / "server.log", env={"SGLANG_VC_COUNT_SYNCS": "sites"})
    proc.trace_path = folder / "trace.jsonl"
    yield proc
    proc.stop()


def _trace(proc) -> list[dict]:
    with open(proc.trace_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _counters(proc) -> dict:
    return requests.get(proc.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]["vericache"]


def test_full_kv_iterations_overlap_and_stay_the_plain_servers(server, tokenizer, vc_overlap):
    """Requests that opt out of lossy KV decode from their full KV, two asking for logprobs
    (top and chosen ids), two stopping at stop strings: SGLang runs the overlap loop
    (``disable_overlap_schedule`` false), their iterations are overlapped (the worker's
    counters and trace) with no read-back of what a forward computed, and the output is
    the plain server's: tokens, text, finish reasons, logprobs (a request that finished at
    the previous iteration is still in the batch SGLang launched; its token there is
    discarded, as on a plain server)."""
    info = requests.get(vc_overlap.url + "/get_server_info", timeout=60).json()
    assert info["disable_overlap_schedule"] is False
    before = _counters(vc_overlap)
    start = len(_trace(vc_overlap))
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    ids_list = [stream[200 + 700 * i: 400 + 700 * i] for i in range(4)]

    def run(srv, k):
        params = {"temperature": 0, "max_new_tokens": 24}
        if srv is vc_overlap:
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

    outs = concurrently(lambda k: run(vc_overlap, k), [(k,) for k in range(4)])
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

    after = _counters(vc_overlap)
    assert after.get("overlap_async", 0) - before.get("overlap_async", 0) >= 20, after
    records = [r for r in _trace(vc_overlap)[start:] if r["requests"]]
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


def test_drafting_iterations_run_synchronously_and_stay_lossless(server, model_dir, tokenizer, vc_overlap):
    """Compressed requests drafting beside full-KV ones: the drafting iterations run
    synchronously, and every output (short ones with 1-3 tokens among them: SGLang's
    overlap loop leaves out of a batch what it counts as finishing) is the plain
    server's."""
    before = _counters(vc_overlap)
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    full_ids = [stream[0:120], stream[500:590]]
    spec_ids = [stream[1000 + 400 * i: 1200 + 450 * i] for i in range(3)]
    short_ids = [stream[3000:3150 + i] for i in range(3)]
    jobs = ([(ids, 40, {"vc_compressor": "none"}) for ids in full_ids] + [(ids, 32, None) for ids in spec_ids]
            + [(ids, n, None) for ids, n in zip(short_ids, (1, 2, 3))])
    outs = concurrently(lambda ids, n, custom: generate(vc_overlap, ids, n, custom), jobs)
    refs = concurrently(lambda ids, n, custom: generate(server, ids, n), jobs)
    for (ids, n, _), out, ref in zip(jobs, outs, refs):
        assert finish_type(out) == finish_type(ref) and len(out["output_ids"]) == len(ref["output_ids"]) == n
        if out["output_ids"] != ref["output_ids"]:
            result = compare(greedy_reference(model_dir, ids, n), out["output_ids"], finish_type(out))
            assert result.identical, (len(ids), result)
    after = _counters(vc_overlap)
    assert after.get("overlap_synced", 0) > before.get("overlap_synced", 0), after
    assert after["verify_rounds"] > before.get("verify_rounds", 0), after  # the compressed path was taken
    assert sum(o["meta_info"][META][-1]["drafted"] for o in outs[2:5]) > 0


def test_lagged_timer_pairs_each_forward_time_with_its_own_iteration(monkeypatch):
    """On CUDA an overlapped forward's events complete after later forwards launched: each
    time read then goes with the rows of the iteration it timed, once, never repeated."""
    from sglang_vc.vericache.overlapped import LaggedTimer

    class Event:
        clock, done = 0, set()

        def __init__(self, enable_timing=True):
            Event.clock += 1
            self.at = Event.clock

        def record(self):
            pass

        def query(self):
            return self.at in Event.done

        def elapsed_time(self, end):
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = LaggedTimer("cpu")
    timer.cuda = True
    assert timer.stop(timer.start(), "k1") == []  # events 1, 2: not complete yet
    Event.done.add(2)
    assert timer.stop(timer.start(), "k2") == [(1.0, "k1")]  # events 3, 4
    Event.done.update({4})
    assert timer.stop(timer.start(), "k3") == [(1.0, "k2")]
    assert LaggedTimer("cpu").stop(0.0, "x")[0][1] == "x"  # the CPU: this forward, now
