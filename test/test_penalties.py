"""Penalties across a verify window (``sglang_vc.penalties``): each row's logits equal,
bit for bit, what SGLang's own penalizers give full-KV decoding at that position, with
the drafts before the row counted as output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.sampling.penaltylib import (
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPenalizerOrchestrator,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_vc.penalties import apply_penalties, has_penalties, penalty_rows

V = 64
EOS = 7


def _req(output_ids, **params):
    tok = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids=None)
    return SimpleNamespace(sampling_params=SamplingParams(**params), output_ids=list(output_ids),
                           eos_token_ids={EOS}, tokenizer=tok)


class _Batch:  # the orchestrator holds its batch by weak reference
    pass


def _sglang_rows(params: dict, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Full-KV decoding with SGLang's penalizers: before producing output ``i``, the
    orchestrator has cumulated outputs ``0 .. i-1``; the sampler adds the additive
    penalties, then scales (``SamplingBatchInfo.update_penalties`` and
    ``_apply_pre_grammar_logits_transforms``). Row ``i`` of the result is position ``i``."""
    req = _req([], **params)
    batch = _Batch()
    batch.reqs, batch.device = [req], "cpu"
    orch = BatchedPenalizerOrchestrator(V, batch, {BatchedFrequencyPenalizer, BatchedPresencePenalizer,
                                                   BatchedRepetitionPenalizer, BatchedMinNewTokensPenalizer})
    out = []
    for i in range(len(logits)):
        if i:
            orch.cumulate_output_tokens(torch.tensor([tokens[i - 1]]))
        row = logits[i : i + 1].clone()
        additive = torch.zeros(1, V)
        orch.accumulate_additive_penalties(additive)
        row.add_(additive)
        scaling = orch.accumulate_scaling_penalties()
        if scaling is not None:
            apply_scaling_penalties(row, scaling)
        out.append(row)
    return torch.cat(out)


PARAMS = {
    "frequency": {"frequency_penalty": 0.3},
    "presence": {"presence_penalty": 0.7},
    "repetition": {"repetition_penalty": 1.3},
    "min_new_tokens": {"min_new_tokens": 4},
    "all": {"frequency_penalty": 0.1, "presence_penalty": -0.4, "repetition_penalty": 0.8,
            "min_new_tokens": 3, "stop_token_ids": [11]},
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_each_row_of_a_verify_window_is_full_kv_decodings(name):
    """A request with 3 committed outputs verifies 4 drafts (5 rows): row ``k`` must see
    the 3 outputs plus drafts ``0 .. k-1`` -- not the window's first state (SGLang's
    relaxed rule), which these tokens, repeated, would tell apart."""
    params = PARAMS[name]
    torch.manual_seed(0)
    tokens = [5, 9, 5, 9, 9, 5, 3, 2]  # repeats: counts change inside the window
    committed, drafts = tokens[:3], tokens[3:7]
    logits = torch.randn(8, V) * 3
    logits[:, [5, 9, EOS, 11]] += 4.0  # penalised tokens compete for the argmax
    want = _sglang_rows(params, tokens, logits)[3:8]
    req = _req(committed, **params)
    pen = penalty_rows([req], [drafts], [0] * 5, list(range(5)), V, "cpu")
    got = apply_penalties(logits[3:8], pen)
    assert torch.equal(got, want), (got - want).abs().max()
    if name != "min_new_tokens":  # 3 outputs < 4 throughout the window: no change to see
        assert not torch.equal(got, apply_penalties(logits[3:8], penalty_rows(
            [req], [drafts], [0] * 5, [0] * 5, V, "cpu"))), "drafts before a row must count"


def test_min_new_tokens_lifts_at_the_row_that_reaches_it():
    """``min_new_tokens = 4`` with 2 outputs committed: rows after 0 and 1 drafts mask
    the stop tokens, rows after 2 or more do not."""
    logits = torch.zeros(5, V)
    req = _req([1, 2], min_new_tokens=4, stop_token_ids=[11])
    got = apply_penalties(logits, penalty_rows([req], [[3, 4, 5, 6]], [0] * 5, range(5), V, "cpu"))
    masked = torch.isinf(got[:, [EOS, 11]]).all(-1).tolist()
    assert masked == [True, True, False, False, False]


def test_rows_of_other_requests_are_untouched_and_nothing_is_built_without_penalties():
    logits = torch.randn(4, V)
    plain, pen = _req([1, 2]), _req([5, 5], frequency_penalty=0.5)
    assert not has_penalties(plain.sampling_params) and has_penalties(pen.sampling_params)
    assert penalty_rows([plain, plain], [[], [3]], [0, 1, 1, 1], [0, 0, 1, 1], V, "cpu") is None
    rows = penalty_rows([plain, pen], [[], [5, 6]], [0, 1, 1, 1], [0, 0, 1, 2], V, "cpu")
    got = apply_penalties(logits, rows)
    assert torch.equal(got[0], logits[0])
    assert got[1, 5] == logits[1, 5] - 2 * 0.5 and got[2, 5] == logits[2, 5] - 3 * 0.5
    assert got[3, 6] == logits[3, 6] - 0.5 and got[2, 6] == logits[2, 6]
