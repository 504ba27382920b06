"""``ChainSpecWorker.sub_batch``: the one-token and verify sub-batches of VERICACHE's
staggered iteration are SGLang ``ScheduleBatch`` copies filtered to some requests. SGLang's
``filter_batch`` does not reorder a batch when asked to keep all of its requests, so a
sub-batch is only ever built in batch order, and anything else is refused."""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

from sglang_vc.spec_worker import ChainSpecWorker

ROWS = [7, 5, 3, 1]
LENS = [10, 20, 30, 40]


def _batch() -> ScheduleBatch:
    n = len(ROWS)
    reqs = [types.SimpleNamespace(rid=f"r{i}", return_logprob=False, grammar=None, return_hidden_states=False,
                                  return_hidden_states_mode=CaptureHiddenMode.NULL) for i in range(n)]
    info = SamplingBatchInfo(temperatures=torch.tensor([[0.5], [0.6], [0.7], [0.8]]), top_ps=torch.ones(n),
                             top_ks=torch.tensor([1, 2, 3, 4]), min_ps=torch.zeros(n), is_all_greedy=False,
                             is_any_greedy=True, need_top_p_sampling=False, need_top_k_sampling=True,
                             need_min_p_sampling=False, vocab_size=16, device="cpu")
    return ScheduleBatch(reqs=reqs, req_pool_indices=torch.tensor(ROWS), req_pool_indices_cpu=torch.tensor(ROWS),
                         seq_lens=torch.tensor(LENS), seq_lens_cpu=torch.tensor(LENS),
                         orig_seq_lens=torch.tensor(LENS), model_config=types.SimpleNamespace(is_encoder_decoder=False),
                         sampling_info=info, device="cpu")


def _worker() -> ChainSpecWorker:
    return object.__new__(ChainSpecWorker)  # sub_batch needs no model


def _rows(sub):
    return [r.rid for r in sub.reqs], sub.req_pool_indices.tolist(), sub.seq_lens.tolist(), sub.sampling_info.top_ks.tolist()


def test_sglang_keeps_a_whole_batch_in_its_own_order():
    """The trap: ``filter_batch`` with every index, reversed, returns the batch as it was."""
    batch = _batch()
    batch.filter_batch(keep_indices=[3, 2, 1, 0])
    assert [r.rid for r in batch.reqs] == ["r0", "r1", "r2", "r3"] and batch.seq_lens.tolist() == LENS


@pytest.mark.parametrize("indices", [[3, 2, 1, 0], [1, 0, 2, 3], [2, 0], [1, 1]])
def test_sub_batch_out_of_batch_order_is_refused(indices):
    batch = _batch()
    with pytest.raises(ValueError, match="strictly increasing"):
        _worker().sub_batch(batch, indices)
    assert _rows(batch) == (["r0", "r1", "r2", "r3"], ROWS, LENS, [1, 2, 3, 4])  # untouched


@pytest.mark.parametrize("indices", [[0, 1, 2, 3], [1, 3], [0, 2, 3], [2]])
def test_sub_batch_gives_requests_rows_lengths_and_sampling_in_order(indices):
    batch = _batch()
    sub = _worker().sub_batch(batch, indices)
    assert _rows(sub) == ([f"r{i}" for i in indices], [ROWS[i] for i in indices], [LENS[i] for i in indices],
                          [i + 1 for i in indices])
    assert _rows(batch) == (["r0", "r1", "r2", "r3"], ROWS, LENS, [1, 2, 3, 4])  # the batch is not filtered


def test_sub_batch_index_out_of_range_is_refused():
    with pytest.raises(ValueError):
        _worker().sub_batch(_batch(), [2, 4])


def test_chain_mask_is_each_requests_prefix_and_causal_chain():
    """The verify mask built on the device equals the per-request blocks it replaces:
    ``[n, s + n]`` with row ``r`` seeing the ``s`` prefix positions and chain tokens 0..r."""
    from sglang_vc.spec_worker import chain_mask

    starts, lens = [5, 0, 17, 3], [1, 4, 3, 9]
    want = torch.cat([torch.cat([torch.ones(n, s, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))],
                                1).flatten() for s, n in zip(starts, lens)])
    assert torch.equal(chain_mask(starts, lens, "cpu"), want)
    assert chain_mask([], [], "cpu").numel() == 0
