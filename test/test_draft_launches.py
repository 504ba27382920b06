"""Kernel launches of one layer of drafting for a whole batch (``pytest -k launch``).

On a GPU a drafter that loops over the requests or the KV heads in Python launches
kernels in proportion to the batch; issue #46's target is at most 10 launches per layer
for the whole drafting batch, whatever its size. :class:`LaunchCounter` counts the
operators (and ``sgl_kernel_ext``'s Triton kernels) that the same code dispatches on the
CPU, at batch 2 and 8: small shapes, the server's own drafter functions.
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


def _specache_layer(batch: int) -> int:
    import sgl_kernel_ext as ext

    from sglang_vc.bench.gpu_step import _specache_worker_step
    from sglang_vc.compress.kivi import KIVI

    g = torch.Generator().manual_seed(batch)
    kr, vr = torch.randn(N, HKV, D, generator=g), torch.randn(N, HKV, D, generator=g)
    c = KIVI().compress(0, kr, vr, 2)
    packed = ext.Payload(c.bits, c.group_size, c.value_group_size, c.k_payload, c.k_scales, c.k_zeros,
                         c.v_payload, c.v_scales, c.v_zeros, D, D)
    step = _specache_worker_step(kr, vr, c, packed, torch.randn(batch, HQ, D, generator=g), batch, 8, D ** -0.5,
                                 "cpu")
    with LaunchCounter() as counter:
        step()
    return counter.total


def test_in_pool_draft_launches_per_layer_are_few_and_batch_independent():
    counts = {b: _in_pool_layer(b) for b in (2, 8)}
    assert counts[2] == counts[8] <= 10, counts


@pytest.mark.xfail(strict=True, reason="not built (#46): the SpeCache drafter attends per request and layer")
def test_specache_draft_launches_per_layer_are_batch_independent():
    counts = {b: _specache_layer(b) for b in (2, 8)}
    assert counts[2] == counts[8] <= 10, counts
