"""The project's attention reads a forward's ``req_to_token`` rows from a host copy, never
from the device tensor (#74 item 2: on a GPU such a read waits for every queued kernel,
once per forward). The device tensor is on the ``meta`` device here: reading its values
raises, so each check fails where the code reads it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc.kvruntime.runtime import KVRuntime, host_rows


def _forward_batch(mode, rows: list[int], seq_lens: list[int], host_copy: bool = True):
    return SimpleNamespace(forward_mode=mode, rids=[f"r{r}" for r in rows],
                           req_pool_indices=torch.empty(len(rows), dtype=torch.int64, device="meta"),
                           req_pool_indices_cpu=torch.tensor(rows) if host_copy else None,
                           seq_lens=torch.empty(len(rows), device="meta"), seq_lens_cpu=torch.tensor(seq_lens))


def test_host_rows_reads_the_host_copy_and_only_without_one_the_device():
    assert host_rows(_forward_batch(ForwardMode.DECODE, [3, 1], [5, 6])) == [3, 1]
    with pytest.raises(Exception):  # no host copy: the device tensor is read (meta: no values)
        host_rows(_forward_batch(ForwardMode.DECODE, [3, 1], [5, 6], host_copy=False))


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_the_runtime_views_a_forward_from_host_copies(mode):
    runtime = object.__new__(KVRuntime)  # what begin_forward reads: the index of compressed rows
    entry = SimpleNamespace(keep_full_rows=True)
    runtime.index, runtime.plans, runtime.batch = {1: entry}, {}, None
    view = runtime.begin_forward(_forward_batch(mode, [3, 1], [5, 6]))
    assert view.entries == [None, entry]


def test_the_verify_forward_reads_rows_from_the_host_copy():
    from sglang_vc.vericache.attention import VeriCacheAttnBackend

    class Seen(Exception):
        pass

    asked = []

    def entry_for_row(row):
        asked.append(row)
        if len(asked) == 2:
            raise Seen  # past the rows: what the forward builds next needs a model runner
        return None

    backend = object.__new__(VeriCacheAttnBackend)
    backend.staging, backend.runtime = None, SimpleNamespace(entry_for_row=entry_for_row)
    fb = _forward_batch(ForwardMode.TARGET_VERIFY, [3, 1], [5, 6])
    fb.spec_info = SimpleNamespace(draft_token_num=2, num_tokens_per_req=2, ragged_verify_layout=None)
    with pytest.raises(Seen):
        backend._build_verify_forward(fb)
    assert asked == [3, 1]
