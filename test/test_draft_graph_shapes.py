"""Drafting launches that one CUDA graph per shape can capture (issue #46, item 3).

A CUDA graph replays the kernels it captured with their grids, constants, scalar
arguments and buffer shapes. So a drafting layer that one graph serves for many batches
must launch the same work whatever the requests' lengths: sized by the batch size and
bucketed sizes (powers of two), the true lengths read by the kernels from the device.
Here, under a stand-in CUDA platform (the Triton kernels in Triton's interpreter):

* the server's SpeCache drafting layer (``SpeCacheDrafter.attend_batch``) and the KIVI /
  token-dropping one (``paged_decode`` over the index the backend builds) record the same
  operators and kernels, argument by argument (:class:`LaunchShapes`), for two batches of
  different lengths in one bucket, and different ones for a batch in another bucket;
* a batch whose captured tables are overwritten by another's (``SpeCacheBatch.load``, what
  a graph replay reads) drafts the other's requests exactly.

The capture itself needs a GPU: ``bench.gpu_check`` runs it (``bench.draft_graph``).
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang_vc.bench.draft_graph import Requests, build, eager_load_matches
from sglang_vc.kvruntime.launches import LaunchShapes

# two batches of three in one bucket (payload rows <= 256, tails <= 64 rows in all, top-k <= 8)
A = Requests(payload=[96, 160, 224], tail=[5, 9, 3], topk=[8, 4, 6])
B = Requests(payload=[256, 128, 192], tail=[17, 2, 30], topk=[5, 8, 2])
OTHER = Requests(payload=[288, 96, 96], tail=[5, 9, 3], topk=[8, 4, 6])  # 512 payload rows


@pytest.fixture
def stand_in_cuda(monkeypatch):
    import sgl_kernel_ext as ext

    if ext.dispatch.interpreter_problem():
        pytest.skip(ext.dispatch.interpreter_problem())
    monkeypatch.delenv(ext.dispatch.ENV, raising=False)
    monkeypatch.setattr(ext.dispatch, "is_cuda_tensor", lambda t: True)


def _record(fn) -> tuple:
    with LaunchShapes() as shapes:
        fn()
    return shapes.record


def test_specache_drafting_launches_depend_on_the_bucket_not_the_lengths(stand_in_cuda):
    fx = build([A, B, OTHER], "cpu")
    a, b, other = fx.batches
    assert a.shape == b.shape != other.shape
    records = [_record(lambda: fx.drafter.attend_batch(q, sb, fx.layer)) for q, sb in zip(fx.queries, fx.batches)]
    ops, kernels = records[0]
    assert [k[0] for k in kernels].count("specache_fetch_rows") == 1 and ops  # the fetching path, recorded
    assert records[0] == records[1]
    assert records[0] != records[2]


def test_a_loaded_batch_drafts_the_other_batchs_requests(stand_in_cuda):
    fx = build([A, B], "cpu")
    a, b = fx.batches
    before = fx.drafter.attend_batch(fx.queries[1], a, fx.layer)
    want = fx.drafter.attend_batch(fx.queries[1], b, fx.layer)
    assert float((before - want).abs().max()) > 1e-3  # the tables decide the output
    assert eager_load_matches(fx) == 0.0


def test_loading_a_batch_of_another_shape_is_refused(stand_in_cuda):
    fx = build([A, OTHER], "cpu")
    with pytest.raises(ValueError, match="shape"):
        fx.batches[0].load(fx.batches[1])


def _decode_index_layer(lengths: list[int], payload_rows: list[int]):
    """One layer of KIVI drafting (``paged_decode``) over the index that
    ``VCTorchAttnBackend._build_decode_index`` builds for requests of ``lengths`` tokens,
    each with a KIVI payload of ``payload_rows``: returns the call and the shapes of the
    index's tables (what a replay would load into the captured ones)."""
    import sgl_kernel_ext as ext

    from sglang_vc.compress.kivi import KIVI
    from sglang_vc.kvruntime.backend import VCTorchAttnBackend
    from sglang_vc.kvruntime.index import QuantPayload
    from sglang_vc.kvruntime.runtime import KVRuntime

    g = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    hq, hkv, d = 4, 2, 16
    slots = sum(lengths) + 1
    k_buf, v_buf = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    req_to_token = torch.zeros(len(lengths), max(lengths), dtype=torch.int32)
    entries, free = [], 1
    for b, (n, rows) in enumerate(zip(lengths, payload_rows)):
        c = KIVI(residual_length=0).compress(0, torch.randn(rows, hkv, d, generator=g),
                                             torch.randn(rows, hkv, d, generator=g), 2)
        req_to_token[b, rows:n] = torch.arange(free, free + n - rows, dtype=torch.int32)
        free += n - rows
        entries.append(types.SimpleNamespace(payload=QuantPayload({0: c}, c.num_quantized),
                                             num_payload_rows=c.num_quantized, row_start=c.num_quantized))
    runtime = types.SimpleNamespace(packed_payload=lambda e, lid: KVRuntime.packed_payload(None, e, lid))
    seq_lens = torch.tensor(lengths)
    backend = types.SimpleNamespace(
        runtime=runtime, req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=types.SimpleNamespace(get_key_buffer=lambda lid: k_buf, get_value_buffer=lambda lid: v_buf))
    fb = types.SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=seq_lens, req_pool_indices=torch.arange(len(lengths)))
    idx = VCTorchAttnBackend._build_decode_index(backend, fb, types.SimpleNamespace(entries=entries), [])
    q = torch.randn(len(lengths), hq, d, generator=g)
    layer = types.SimpleNamespace(layer_id=0, scaling=d ** -0.5)
    assert isinstance(idx.kv, ext.KVIndices)
    tables = [*idx.kv, idx.q_req, idx.q_pos, *(t for p in idx.payloads for t in (p.table.ptrs, p.table.num_tokens))]
    shapes = ([tuple(t.shape) for t in tables], [p.table.max_tokens for p in idx.payloads])
    return (lambda: VCTorchAttnBackend.paged_decode(backend, q, layer, idx)), shapes


def test_kivi_drafting_launches_depend_on_the_bucket_not_the_lengths(stand_in_cuda):
    layers = [_decode_index_layer([300, 410, 290], [256, 384, 256]),
              _decode_index_layer([350, 270, 330], [320, 224, 288]),
              _decode_index_layer([900, 410, 290], [864, 384, 256])]  # other buckets
    (same, same_tables), (again, again_tables), (other, other_tables) = [(_record(f), t) for f, t in layers]
    assert [k[0] for k in same[1]].count("kivi_attention_batch") == 1
    assert same == again and same_tables == again_tables
    assert same != other and same_tables != other_tables


def test_the_gpu_checks_two_batches_share_one_shape(stand_in_cuda):
    """``bench.gpu_check``'s capture replays one batch's graph for the other: on small
    shapes, the two batches it builds have one launch shape and different requests."""
    from sglang_vc.bench.draft_graph import gpu_sets

    sets = gpu_sets(batch=4, tokens=1024)
    assert sets[0].payload != sets[1].payload and max(sets[0].payload) == 1024
    fx = build(sets, "cpu")
    assert fx.batches[0].shape == fx.batches[1].shape


def _in_pool_layer(lengths: list[int], budget: int):
    from sglang_vc.vericache import draft_view

    g = torch.Generator().manual_seed(sum(lengths))
    n, hq, hkv, d = len(lengths), 4, 2, 16
    k_buf, v_buf = torch.randn(n * 1024 + 1, hkv, d, generator=g), torch.randn(n * 1024 + 1, hkv, d, generator=g)
    req_to_token = torch.arange(1024)[None, :] + 1 + (torch.arange(n) * 1024)[:, None]
    q = torch.randn(n, hq, d, generator=g)
    lengths_t = torch.tensor(lengths)

    def layer():
        slots, valid = draft_view.view_slots(req_to_token, torch.arange(n), lengths_t, torch.full((n,), budget),
                                             budget)
        return draft_view.attend_view(q, k_buf, v_buf, slots, valid, d ** -0.5)

    return layer


def test_in_pool_drafting_launches_depend_on_the_budget_not_the_lengths():
    """In-pool drafting's view (a token budget: ``--vc-draft-budget 512``) is as wide as
    the budget whatever the lengths, padded and masked below it."""
    same = [_record(_in_pool_layer([700, 90, 1000], 256)), _record(_in_pool_layer([300, 1020, 512], 256))]
    assert same[0] == same[1]
    assert same[0] != _record(_in_pool_layer([300, 1020, 512], 128))
