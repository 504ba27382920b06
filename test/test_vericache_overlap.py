"""VERICACHE under SGLang's overlap scheduler (``vericache/overlapped.py``,
``sglang_vc/overlap.py``): the iterations in which no request drafts overlap the host's
work as a plain server's do, the others run synchronously, and the output is the plain
server's either way.

The server tests run on ``test_vericache_serving``'s X = 4 server (its default overlap
scheduling, host syncs and launches counted into its trace), against the shared plain
server: ``test_full_kv_iterations_overlap_and_stay_the_plain_servers`` and
``test_drafting_iterations_run_synchronously_and_stay_lossless``.
"""

from __future__ import annotations

import types
from collections import deque

import torch


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
    # its overlapped iterations take SGLang's grammar barrier: grammar batches overlap too
    assert get_spec("VERICACHE").supports_grammar_overlap() is True
    assert get_spec("SPECACHE") is None or get_spec("SPECACHE").supports_grammar_overlap() is False


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
    from sglang_vc.vericache.staggered_schedule import Track
    from sglang_vc.vericache.staggered_round import StaggeredRound

    track = Track("a", 7, 103)
    track.drafts = [1, 2]
    round = StaggeredRound(types.SimpleNamespace())
    round._schedule = types.SimpleNamespace(tracks={"a": track})
    req = types.SimpleNamespace(rid="a", kv=types.SimpleNamespace(kv_committed_len=100, req_pool_idx=7))
    assert round.slots_ahead(req) == 3 + 2 + 1  # committed + 6 slots in all
    req.kv.kv_committed_len = 103  # processed
    assert round.slots_ahead(req) == 3
    req.kv.req_pool_idx = 8  # prefilled again in another row: its first token
    assert round.slots_ahead(req) == 1


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


def _penalised_req(prompt: int, output: list[int], **penalties):
    sp = types.SimpleNamespace(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=None,
                               min_new_tokens=0, stop_token_ids=None)
    for k, v in penalties.items():
        setattr(sp, k, v)
    return types.SimpleNamespace(origin_input_ids=list(range(prompt)), output_ids=list(output), sampling_params=sp,
                                 eos_token_ids=None, tokenizer=None)


def test_an_overlapped_penalty_counts_the_token_sglang_has_not_processed():
    """Under overlap, the previous result's token is in no ``output_ids`` yet: the
    penalised logits of an overlapped iteration are those of the full history, with that
    token taken from the forward's input on the device (``bonus_tokens``); a request
    that misses more than that one token is refused (``needs_sync`` runs it
    synchronously)."""
    from sglang_vc.penalties import apply_penalties, penalty_rows
    from sglang_vc.vericache.overlapped import _penalised, unseen

    vocab = 16
    reqs = [_penalised_req(5, [3, 4], frequency_penalty=0.7),  # SGLang processed up to 4; 9 unseen
            _penalised_req(4, [2, 2, 6], presence_penalty=0.5, repetition_penalty=1.3),  # nothing unseen
            _penalised_req(3, [])]  # unpenalised, its first token unseen
    committed = [5 + 2, 4 + 3 - 1, 3]  # the KV rows: prompt and output, less the input token
    assert [unseen(r, n) for r, n in zip(reqs, committed)] == [1, 0, 1]
    bonus = torch.tensor([9, 6, 1])
    logits = torch.randn(3, vocab)
    got = _penalised(logits, types.SimpleNamespace(reqs=reqs), committed, bonus)
    # the same request with the unseen token processed, penalised synchronously
    full = [_penalised_req(5, [3, 4, 9], frequency_penalty=0.7), reqs[1], reqs[2]]
    want = apply_penalties(logits, penalty_rows(full, [[], [], []], range(3), [0, 0, 0], vocab, logits.device))
    assert torch.equal(got, want)
    # without the device token the penalty differs (token 9's count): the test sees it
    stale = apply_penalties(logits, penalty_rows(reqs, [[], [], []], range(3), [0, 0, 0], vocab, logits.device))
    assert not torch.equal(got, stale)
    try:
        _penalised(logits, types.SimpleNamespace(reqs=reqs), [committed[0] + 1, *committed[1:]], bonus)
    except RuntimeError as exc:
        assert "misses 2 tokens" in str(exc)
    else:
        raise AssertionError("a request missing two tokens was penalised from one")
