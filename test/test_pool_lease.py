"""Quantized payloads take pool slots leased while their request lives
(``kvruntime.pool_lease``, ``kvruntime.payload_store``), on SGLang's own KV pool and
allocator: nothing is set aside at start-up, a lease is out of SGLang's free list while
held and back in it after, and a payload's tensors are the pool's memory."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_vc.compress.kivi import KIVI
from sglang_vc.kvruntime import pool_lease
from sglang_vc.kvruntime.payload_store import PayloadStore
from sglang_vc.kvruntime.runtime import _capacity, _without_residual

H, D, LAYERS = 2, 16, 3


def _pool(size=256, need_sort=True):
    kv = MHATokenToKVPool(size, 1, torch.float32, H, D, LAYERS, "cpu", False, enable_alt_stream=False)
    return kv, TokenToKVPoolAllocator(size, torch.float32, "cpu", kv, need_sort=need_sort)


def _in(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """``t``'s bytes lie inside ``buf``'s."""
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


@pytest.mark.parametrize("need_sort", [True, False])
def test_a_lease_is_a_contiguous_run_out_of_sglangs_free_list(need_sort):
    kv, alloc = _pool(need_sort=need_sort)
    held = alloc.alloc(100)  # SGLang hands out the lowest slots first
    lease = pool_lease.take(alloc, kv, 40)
    assert lease is not None and alloc.available_size() == 256 - 100 - 40
    assert lease.start == 256 - 40 + 1  # the highest run (slot 0 is SGLang's padding)
    got = alloc.alloc(alloc.available_size())
    assert not set(got.tolist()) & set(lease.slots().tolist()) and not set(held.tolist()) & set(lease.slots().tolist())
    lease.k[0].fill_(7.0)  # the lease's views are the pool's rows
    assert torch.equal(kv.get_key_buffer(0)[lease.start : lease.start + 40], torch.full((40, H, D), 7.0))
    assert pool_lease.take(alloc, kv, 1) is None  # nothing free
    alloc.free(got)
    pool_lease.give_back(alloc, lease)
    assert alloc.available_size() == 256 - 100


def test_no_run_is_no_lease_until_eviction_makes_one():
    kv, alloc = _pool(size=64)
    every_other = alloc.alloc(64)[::2]  # free slots, none adjacent
    alloc.free(every_other)
    assert pool_lease.take(alloc, kv, 2) is None and alloc.available_size() == 32
    evicted = []

    def evict(n):  # a radix tree giving back the slots between them
        evicted.append(n)
        alloc.free(torch.arange(2, 65, 2))

    lease = pool_lease.take(alloc, kv, 8, evict)
    assert lease is not None and evicted == [8] and lease.size == 8


def test_a_payload_lives_in_leased_pool_slots_and_reads_the_same():
    kv, alloc = _pool()
    store = PayloadStore(alloc, kv)
    kivi = KIVI(group_size=16, residual_length=0)
    k, v = torch.randn(64, H, D), torch.randn(64, H, D)
    layers = {lid: _without_residual(kivi.compress(lid, k + lid, v - lid, 2)) for lid in range(LAYERS)}
    free = alloc.available_size()
    home = store.home(layers[0], _capacity(64, 16, 0.25))
    assert home is not None and home.capacity == 80
    assert alloc.available_size() == free - home.lease.size and 0 < home.lease.size < 64  # far less than the KV
    placed = {lid: home.put(q) for lid, q in layers.items()}
    for lid, q in placed.items():
        ref_k, ref_v = KIVI.dequantize(layers[lid])
        got_k, got_v = KIVI.dequantize(q)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        assert all(_in(getattr(q, f), kv.get_key_buffer(lid)) for f in ("k_payload", "k_scales", "k_zeros"))
        assert all(_in(getattr(q, f), kv.get_value_buffer(lid)) for f in ("v_payload", "v_scales", "v_zeros"))
    # a decode tail of one group is written after it while the capacity lasts
    tail = _without_residual(kivi.compress(0, k[:16], v[:16], 2))
    grown = home.append(placed[0], tail)
    assert grown.num_quantized == 80 and grown.k_payload.data_ptr() == placed[0].k_payload.data_ptr()
    assert torch.equal(KIVI.dequantize(grown)[0][64:], KIVI.dequantize(tail)[0])
    assert not home.holds(96)
    assert store.release(home) == home.lease.size and alloc.available_size() == free and store.leased_slots == 0
