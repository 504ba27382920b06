"""Drafting launches that one CUDA graph per shape can capture (issue #46, item 3).

A CUDA graph replays the kernels it captured with their grids, constants, scalar
arguments and buffer shapes. So a drafting layer that one graph serves for many batches
must launch the same work whatever the requests' lengths: sized by the batch size and
bucketed sizes (four buckets per doubling), the true lengths read by the kernels from the device.
Here, under a stand-in CUDA platform (the Triton kernels in Triton's interpreter):

* the server's SpeCache drafting layer (``SpeCacheDrafter.attend_batch``) and the KIVI /
  token-dropping one (``kvruntime.decode_index``: its index, as the backend builds it, and
  its attention) record the same operators and kernels, argument by argument
  (:class:`LaunchShapes`), for two batches of different lengths in one bucket, and
  different ones for a batch in another bucket; so do in-pool views of one budget;
* a batch whose captured tables are overwritten by another's (``load``, what a graph
  replay reads) drafts the other's requests exactly.

The capture itself needs a GPU: ``bench.gpu_check`` runs it (``bench.draft_graph``).
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang_vc.bench import draft_graph
from sglang_vc.bench.draft_graph import Requests, eager_load_matches
from sglang_vc.kvruntime.launches import LaunchShapes

# two batches of three in one bucket (payload rows <= 256, tails <= 64 rows in all, top-k <= 8)
A = Requests(payload=[96, 160, 224], tail=[5, 9, 3], topk=[8, 4, 6])
B = Requests(payload=[256, 128, 192], tail=[17, 2, 30], topk=[5, 7, 2])
OTHER = Requests(payload=[288, 96, 96], tail=[5, 9, 3], topk=[8, 4, 6])  # 512 payload rows
FAMILIES = {"specache": draft_graph.specache, "kivi": draft_graph.kivi}
# the kernel that shows each family's path was taken
KERNEL = {"specache": "specache_fetch_rows", "kivi": "kivi_attention_batch"}


def _record(fn) -> tuple:
    with LaunchShapes() as shapes:
        fn()
    assert shapes.syncs == 0  # nothing read back on the host: a graph could capture it
    return shapes.record


@pytest.mark.parametrize("family", FAMILIES)
def test_drafting_launches_depend_on_the_bucket_not_the_lengths(stand_in_cuda, family):
    fx = FAMILIES[family]([A, B, OTHER], "cpu")
    a, b, other = fx.batches
    assert a.shape == b.shape != other.shape
    records = [_record(lambda: fx.layer(q, t)) for q, t in zip(fx.queries, fx.batches)]
    ops, kernels = records[0]
    assert [k[0] for k in kernels].count(KERNEL[family]) == 1  # the family's path, recorded
    assert records[0] == records[1]
    assert records[0] != records[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loaded_batch_drafts_the_other_batchs_requests(stand_in_cuda, family):
    fx = FAMILIES[family]([A, B], "cpu")
    a, b = fx.batches
    before = fx.layer(fx.queries[1], a)
    want = fx.layer(fx.queries[1], b)
    assert float((before - want).abs().max()) > 1e-3  # the tables decide the output
    assert eager_load_matches(fx) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_a_batch_of_another_shape_is_refused(stand_in_cuda, family):
    fx = FAMILIES[family]([A, OTHER], "cpu")
    with pytest.raises(ValueError, match="shape"):
        fx.batches[0].load(fx.batches[1])


def test_the_backend_builds_its_decode_index_with_bucketed_lists(stand_in_cuda):
    """``vc_torch``'s batched decode (and VERICACHE's KIVI drafters) index through
    :func:`decode_index.build`: lists of a bucketed capacity, not the lengths' sum."""
    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    req_to_token = torch.arange(1, 3 * 400 + 1, dtype=torch.int32).view(3, 400)
    seq_lens = torch.tensor([300, 10, 290])
    backend = types.SimpleNamespace(runtime=None, req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token))
    fb = types.SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=seq_lens, req_pool_indices=torch.arange(3))
    idx = VCTorchAttnBackend._build_decode_index(backend, fb, types.SimpleNamespace(entries=[None] * 3), [])
    assert idx.kv.indices.numel() == 640 and int(idx.kv.indptr[-1]) == 600  # 600 rows: the 640 bucket


def test_the_gpu_checks_two_batches_share_one_shape(stand_in_cuda):
    """``bench.gpu_check``'s capture replays one batch's graph for the other: on small
    shapes, the two batches it builds have one launch shape and different requests."""
    first, second = draft_graph.gpu_sets(batch=8, tokens=1024)
    assert max(first.payload) == 1024 and 512 < min(second.payload) and max(second.payload) < 1024
    assert sum(first.tail) != sum(second.tail) and max(first.topk) != max(second.topk)
    sets = [first, second]
    for make in FAMILIES.values():
        fx = make(sets, "cpu")
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


def test_a_batch_of_another_payload_layout_is_another_shape(stand_in_cuda):
    """The same lengths at 2 and 4 bits compile other kernels (the bits are constants):
    another shape, and its tables are not loaded into the 2-bit batch's."""
    fx = draft_graph.specache([A, A], "cpu", bits=[2, 4])
    assert fx.batches[0].shape != fx.batches[1].shape
    with pytest.raises(ValueError, match="shape"):
        fx.batches[0].load(fx.batches[1])
