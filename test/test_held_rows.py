"""A finished offloaded request's full KV that found no pool room waits on the host and
enters SGLang's radix tree once a release frees slots (``kvruntime.held_rows``, #80), on
SGLang's own ``RadixCache``, KV pool and allocator: the next match finds the exact rows,
under the request's tenant key only."""

from __future__ import annotations

import array
import types

import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_vc import stats
from sglang_vc.kvruntime.held_rows import HeldForTree, HeldRows

H, D, LAYERS, SIZE = 2, 8, 3, 64


def _tree():
    kv = MHATokenToKVPool(SIZE, 1, torch.float32, H, D, LAYERS, "cpu", False, enable_alt_stream=False)
    alloc = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", kv, need_sort=False)
    return kv, alloc, RadixCache.create_simulated(mock_allocator=alloc)


def _key(ids, tenant=None) -> RadixKey:
    return RadixKey(array.array("q", ids), tenant)


def _rows(start: int, n: int, seed: int) -> HeldRows:
    g = torch.Generator().manual_seed(seed)
    return HeldRows(start, {l: torch.randn(n, H, D, generator=g) for l in range(LAYERS)},
                    {l: torch.randn(n, H, D, generator=g) for l in range(LAYERS)})


def _cached(kv, tree, key):
    r = tree.match_prefix(MatchPrefixParams(key=key))
    slots = tree.path_device_indices(r.last_device_node).to(torch.int64)
    return int(r.device_prefix_len), [kv.get_key_buffer(l)[slots] for l in range(LAYERS)], \
        [kv.get_value_buffer(l)[slots] for l in range(LAYERS)]


def test_held_rows_wait_for_room_then_match_exactly_under_their_tenant():
    kv, alloc, tree = _tree()
    running = alloc.alloc(SIZE - 1)  # the running requests hold the pool (slot 0 is padding)
    held = HeldForTree(limit=SIZE)
    ids = list(range(100, 140))
    rows = _rows(0, 40, seed=1)
    held.add(_key(ids, "tenant-a"), rows)
    before = stats.snapshot().get("vericache", {})
    held.insert_into(tree, kv)
    assert len(held) == 1 and _cached(kv, tree, _key(ids, "tenant-a"))[0] == 0  # no room: still held

    alloc.free(running)  # a release
    held.insert_into(tree, kv)
    assert len(held) == 0 and held.tokens == 0
    n, k, v = _cached(kv, tree, _key(ids, "tenant-a"))
    assert n == 40
    for l in range(LAYERS):
        assert torch.equal(k[l], rows.k[l]) and torch.equal(v[l], rows.v[l])
    assert _cached(kv, tree, _key(ids, "tenant-b"))[0] == 0  # another tenant finds nothing
    after = stats.snapshot()["vericache"]
    assert after["finished_kv_kept_later"] == before.get("finished_kv_kept_later", 0) + 1
    assert tree.evictable_size() == 40  # the tree's to evict, as a finished request's KV


def test_held_rows_after_a_borrowed_prefix_join_it_and_are_dropped_if_it_went():
    kv, alloc, tree = _tree()
    prefix = list(range(10))
    slots = alloc.alloc(10)
    tree.insert(InsertParams(key=_key(prefix), value=slots.to(torch.int64)))
    held = HeldForTree(limit=SIZE)
    rows = _rows(10, 6, seed=2)  # the request borrowed the 10-token prefix, owns 6 more
    held.add(_key(prefix + list(range(50, 56))), rows)
    held.insert_into(tree, kv)
    n, k, _ = _cached(kv, tree, _key(prefix + list(range(50, 56))))
    assert n == 16 and torch.equal(k[0][10:], rows.k[0])

    tree.reset()
    alloc.clear()
    before = stats.snapshot().get("vericache", {}).get("finished_kv_not_kept", 0)
    held.add(_key(prefix + [7, 7]), _rows(10, 2, seed=3))  # its prefix is no longer cached
    held.insert_into(tree, kv)
    assert len(held) == 0 and _cached(kv, tree, _key(prefix + [7, 7]))[0] == 0
    assert stats.snapshot()["vericache"]["finished_kv_not_kept"] == before + 1


def test_held_rows_past_the_bound_drop_the_oldest():
    held = HeldForTree(limit=50)
    held.add(_key(list(range(30))), _rows(0, 30, seed=4))
    held.add(_key(list(range(40, 70))), _rows(0, 30, seed=5))
    assert len(held) == 1 and held.tokens == 30
    assert list(held.held[0][0].token_ids)[:1] == [40]  # the newer one stays


def test_a_finished_requests_held_rows_are_its_full_kv_around_and_inside_the_dropped_span():
    """``FullKVRestore.held_rows``: positions before the span and after it (its decoded
    tokens) from the pool, the span's kept rows from the pool merged with the dropped
    rows from the host copy; a position outside the span without a slot gives None."""
    from test_vericache_staging import LAYERS as SLAYERS, _compressed_row, _runtime

    from sglang_vc.kvruntime import NULL_SLOT
    from sglang_vc.vericache.restore import FullKVRestore

    rt = _runtime(size=40)
    p, n, n_keep, tail = 3, 12, 4, 5
    host, full, _ = _compressed_row(rt, 1, p, n, n_keep)
    decoded = rt.allocator.alloc(tail)
    rt.req_to_token[1, n: n + tail] = decoded.to(torch.int32)
    for l in SLAYERS:
        rt.kv_pool.k[l][decoded] = torch.randn(tail, *rt.kv_pool.k[l].shape[1:])
        rt.kv_pool.v[l][decoded] = torch.randn(tail, *rt.kv_pool.v[l].shape[1:])
    restore = FullKVRestore(types.SimpleNamespace(), rt, rt.req_to_token)
    span_k, span_v = restore.full_rows(host)
    held = restore.held_rows(host, 1, n + tail, span_k, span_v)  # position 0 is a borrowed prefix
    assert held is not None and held.start == 1 and held.num_tokens == n + tail - 1
    before = rt.req_to_token[1, 1:p].to(torch.int64)
    for l in SLAYERS:
        want_k = torch.cat([rt.kv_pool.k[l][before], full[l][0], rt.kv_pool.k[l][decoded]])
        want_v = torch.cat([rt.kv_pool.v[l][before], full[l][1], rt.kv_pool.v[l][decoded]])
        assert torch.equal(held.k[l], want_k) and torch.equal(held.v[l], want_v)
    rt.req_to_token[1, n + 2] = NULL_SLOT  # a decoded position without a slot: nothing exact to hold
    assert restore.held_rows(host, 1, n + tail, span_k, span_v) is None
