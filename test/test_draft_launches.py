"""Kernel launches of one layer of drafting for a whole batch (``pytest -k launch``).

On a GPU a drafter that loops over the requests or the KV heads in Python launches
kernels in proportion to the batch; issue #46's target is at most 10 launches per layer
for the whole drafting batch, whatever its size. :class:`LaunchCounter` counts the
operators (and ``sgl_kernel_ext``'s Triton kernels, each one launch) that the same code
dispatches, at batch 2 and 8: small shapes, the server's own drafter functions, under a
stand-in CUDA platform where the Triton path is the GPU's (its kernels run in Triton's
interpreter). Every drafter family: in-pool views, SpeCache, KIVI and token dropping.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vc.kvruntime.launches import LaunchCounter

N, HQ, HKV, D = 256, 6, 2, 16


def test_launch_counter_counts_computing_operators_not_views():
    x = torch.randn(4, 8)
    with LaunchCounter() as c:
        y = x.view(8, 4).t()  # views: nothing launched
        z = (y * 2).sum(0)  # two kernels
        torch.empty(3)  # an allocation
    assert c.total == 2 and c.by_op["mul"] == 1 and c.by_op["sum"] == 1, c.by_op
    assert z.shape == (8,)


def _in_pool_layer(batch: int) -> int:
    from sglang_vc.vericache import draft_view

    g = torch.Generator().manual_seed(batch)
    k_buf, v_buf = torch.randn(batch * N + 1, HKV, D, generator=g), torch.randn(batch * N + 1, HKV, D, generator=g)
    reqs = torch.arange(batch)
    req_to_token = torch.arange(N)[None, :] + 1 + (reqs * N)[:, None]
    slots, valid = draft_view.view_slots(req_to_token, reqs, torch.full((batch,), N), torch.full((batch,), 64), 64)
    q = torch.randn(batch, HQ, D, generator=g)
    with LaunchCounter() as c:
        draft_view.attend_view(q, k_buf, v_buf, slots, valid, D ** -0.5)
    return c.total


def _specache_layer(batch: int, batched: bool) -> LaunchCounter:
    import sgl_kernel_ext as ext

    from sglang_vc.bench.gpu_step import _specache_worker_step
    from sglang_vc.compress.kivi import KIVI

    g = torch.Generator().manual_seed(batch)
    kr, vr = torch.randn(N, HKV, D, generator=g), torch.randn(N, HKV, D, generator=g)
    c = KIVI().compress(0, kr, vr, 2)
    packed = ext.Payload(c.bits, c.group_size, c.value_group_size, c.k_payload, c.k_scales, c.k_zeros,
                         c.v_payload, c.v_scales, c.v_zeros, D, D)
    step = _specache_worker_step(kr, vr, c, packed, torch.randn(batch, HQ, D, generator=g), batch, 8, D ** -0.5,
                                 "cpu", batched=batched)
    with LaunchCounter() as counter:
        step()
    return counter


def test_specache_draft_launches_per_layer_are_few_and_batch_independent(stand_in_cuda):
    """The server's SpeCache drafter on the Triton path (``attend_batch``): the payloads,
    the tails, the scores, one top-k, the fetch from the host copies, the rows and the
    merged second pass, 10 launches for the whole batch."""
    counts = {b: _specache_layer(b, batched=True) for b in (2, 8)}
    assert counts[2].by_op == counts[8].by_op and counts[8].total <= 10, {b: c.by_op for b, c in counts.items()}
    assert counts[8].by_op["triton:specache_fetch_rows"] == 1


def test_specache_per_request_path_grows_with_the_batch():
    """The CPU path (per request) for contrast: what the batched path replaced on CUDA."""
    counts = {b: _specache_layer(b, batched=False).total for b in (2, 8)}
    assert counts[8] > 3 * counts[2], counts


def _payload_decode_layer(batch: int, quantized: bool) -> LaunchCounter:
    """One layer of ``VCTorchAttnBackend.paged_decode``: drafters over their pool rows, with
    a KIVI payload each (``quantized``) or token-dropped rows only."""
    import types

    import sgl_kernel_ext as ext

    from sglang_vc.compress.kivi import KIVI
    from sglang_vc.kvruntime.backend import VCTorchAttnBackend
    from sglang_vc.kvruntime.decode_index import DecodeIndex, payload_groups
    from sglang_vc.kvruntime.index import QuantPayload
    from sglang_vc.kvruntime.runtime import KVRuntime

    g = torch.Generator().manual_seed(batch)
    k_buf, v_buf = torch.randn(batch * N + 1, HKV, D, generator=g), torch.randn(batch * N + 1, HKV, D, generator=g)
    entries = []
    for b in range(batch):
        c = KIVI().compress(0, torch.randn(N, HKV, D, generator=g), torch.randn(N, HKV, D, generator=g), 2)
        entries.append(types.SimpleNamespace(payload=QuantPayload({0: c}, c.num_quantized) if quantized else None,
                                             num_payload_rows=c.num_quantized if quantized else 0))
    runtime = types.SimpleNamespace(packed_payload=lambda e, lid: KVRuntime.packed_payload(None, e, lid))
    reqs = torch.arange(batch)
    req_to_token = (torch.arange(N)[None, :] + 1 + (reqs * N)[:, None]).to(torch.int32)
    starts = torch.full((batch,), N // 2)
    kv = ext.build_kv_indices(req_to_token, reqs, starts, torch.full((batch,), N), 0)
    idx = DecodeIndex(kv, reqs, torch.full((batch,), N - 1), payload_groups(runtime, entries, "cpu"))
    backend = types.SimpleNamespace(token_to_kv_pool=types.SimpleNamespace(get_key_buffer=lambda lid: k_buf,
                                                                           get_value_buffer=lambda lid: v_buf))
    layer = types.SimpleNamespace(layer_id=0, scaling=D ** -0.5)
    q = torch.randn(batch, HQ, D, generator=g)
    with LaunchCounter() as counter:
        VCTorchAttnBackend.paged_decode(backend, q, layer, idx)
    return counter


@pytest.mark.parametrize("quantized", [True, False], ids=["kivi", "token-dropping"])
def test_kivi_and_token_dropping_draft_launches_per_layer_are_batch_independent(stand_in_cuda, quantized):
    counts = {b: _payload_decode_layer(b, quantized) for b in (2, 8)}
    assert counts[2].by_op == counts[8].by_op and counts[8].total <= 10, {b: c.by_op for b, c in counts.items()}
    assert counts[8].by_op["triton:kivi_attention_batch"] == (1 if quantized else 0)
