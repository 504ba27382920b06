"""A verify forward's full KV in SGLang's KV pool (:mod:`sglang_vc.vericache.staging`),
on SGLang's own token allocator: slots reserved per verifying request, its row pointed
at them and back, each layer's full rows written there (a token-dropping drafter's kept
rows merged with the reloaded dropped ones), the headroom held back in the pool taken
when the allocator has no room, no room at all refused without taking anything,
and a failed reload adopting the staged slots for good."""

from __future__ import annotations

import types

import pytest

import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sglang_vc.kvruntime import NULL_SLOT
from sglang_vc.vericache.reload import HostEntry, Span
from sglang_vc.vericache.staging import PoolStaging, VerifyHeadroom

LAYERS = (0, 1)
H, D = 2, 4


class _Pool:
    def __init__(self, size):
        self.k = {l: torch.zeros(size + 1, H, D) for l in LAYERS}
        self.v = {l: torch.zeros(size + 1, H, D) for l in LAYERS}

    def get_key_buffer(self, l):
        return self.k[l]

    def get_value_buffer(self, l):
        return self.v[l]


def _runtime(size=40):
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort=False)
    dropped = []
    return types.SimpleNamespace(req_to_token=torch.zeros(4, 32, dtype=torch.int32), allocator=allocator,
                                 kv_pool=_Pool(size), drop_compressed_index=dropped.append, dropped=dropped)


def _compressed_row(rt, row, p, n, n_keep):
    """A token-dropping drafter's row: [0, p) and [p, p + n_keep) live, the rest of
    [p, n) null; the full KV of [p, n) per layer, the kept positions per head."""
    own = rt.allocator.alloc(p + n_keep)
    rt.req_to_token[row, : p + n_keep] = own.to(torch.int32)
    rt.req_to_token[row, p + n_keep : n] = NULL_SLOT
    full = {l: (torch.randn(n - p, H, D), torch.randn(n - p, H, D)) for l in LAYERS}
    kept = torch.stack([torch.randperm(n - p)[:n_keep].sort().values for _ in range(H)])  # [H, n_keep]
    dropped = torch.stack([torch.tensor([j for j in range(n - p) if j not in set(kept[h].tolist())]) for h in range(H)])
    for l in LAYERS:
        for h in range(H):
            rt.kv_pool.k[l][own[p:], h] = full[l][0][kept[h], h]
            rt.kv_pool.v[l][own[p:], h] = full[l][1][kept[h], h]
    host = HostEntry("r%d" % row, row, p, n)
    spans = {l: Span(p, n, torch.stack([full[l][0][dropped[h], h] for h in range(H)], 1),
                     torch.stack([full[l][1][dropped[h], h] for h in range(H)], 1), kept, dropped)
             for l in LAYERS}
    return host, full, spans


def test_staged_rows_hold_the_full_kv_during_the_forward_and_the_mapping_comes_back():
    rt = _runtime()
    host0, full0, spans0 = _compressed_row(rt, 1, p=2, n=10, n_keep=3)
    host1, full1, spans1 = _compressed_row(rt, 3, p=0, n=6, n_keep=2)
    before = rt.req_to_token.clone()
    free = rt.allocator.available_size()
    staging = PoolStaging(rt, lambda l: {0: spans0[l], 5: spans1[l]})
    assert staging.reserve(0, host0) and staging.reserve(5, host1)
    assert rt.allocator.available_size() == free - 8 - 6
    staging.point()
    for k, host, full in ((0, host0, full0), (5, host1, full1)):
        row = rt.req_to_token[host.req_pool_idx]
        assert torch.equal(row[host.p : host.n].long(), staging.requests[k].slots)
        assert torch.equal(row[: host.p], before[host.req_pool_idx, : host.p])  # the tree prefix untouched
    for l in LAYERS:
        staging.write_layer(l, rt.kv_pool.k[l], rt.kv_pool.v[l])
        for k, host, full in ((0, host0, full0), (5, host1, full1)):
            at = rt.req_to_token[host.req_pool_idx, host.p : host.n].long()
            assert torch.equal(rt.kv_pool.k[l][at], full[l][0]) and torch.equal(rt.kv_pool.v[l][at], full[l][1])
    staging.restore()
    assert torch.equal(rt.req_to_token, before)
    assert rt.allocator.available_size() == free and not rt.dropped


def test_no_room_takes_the_headroom_then_defers_and_takes_nothing():
    """The allocator full: the first verifier's span is staged in the headroom's slots
    (held back in the pool, counted as used by SGLang), a second one finds no room and
    takes nothing (its verify waits); after the forward the headroom's slots are free for
    the next one, and nothing went back to the allocator."""
    rt = _runtime(size=24)
    host0, full0, spans0 = _compressed_row(rt, 1, p=0, n=10, n_keep=3)
    host1, _, spans1 = _compressed_row(rt, 2, p=0, n=8, n_keep=2)
    headroom = VerifyHeadroom(rt.allocator)
    headroom.fit(10)  # the longest span
    assert headroom.size == 10 and rt.allocator.available_size() == 24 - 5 - 10
    rt.allocator.alloc(rt.allocator.available_size())  # the rest of the pool taken by others
    staging = PoolStaging(rt, lambda l: {0: spans0[l]}, headroom)
    assert staging.reserve(0, host0) and staging.requests[0].from_headroom
    assert not staging.reserve(1, host1) and 1 not in staging  # no room left: it waits
    staging.point()
    for l in LAYERS:
        staging.write_layer(l, rt.kv_pool.k[l], rt.kv_pool.v[l])
        at = rt.req_to_token[1, 0:10].long()
        assert torch.equal(rt.kv_pool.k[l][at], full0[l][0]) and torch.equal(rt.kv_pool.v[l][at], full0[l][1])
    staging.restore()
    assert rt.allocator.available_size() == 0 and headroom.used == 0 and headroom.size == 10
    assert PoolStaging(rt, lambda l: {}, headroom).reserve(0, host1)  # the next forward's verifier fits


def test_headroom_fits_to_the_longest_span_and_gives_everything_back():
    rt = _runtime(size=20)
    headroom = VerifyHeadroom(rt.allocator)
    headroom.fit(8)
    assert headroom.size == 8 and rt.allocator.available_size() == 12
    headroom.fit(5)
    assert headroom.size == 5 and rt.allocator.available_size() == 15
    rt.allocator.alloc(13)
    headroom.fit(9)  # grows by what the allocator has: short of the span
    assert headroom.size == 7 and rt.allocator.available_size() == 0
    headroom.fit(0)
    assert headroom.size == 0 and rt.allocator.available_size() == 7
    headroom.fit(7, keep_free=4)  # the batch's next decode steps keep their slots
    assert headroom.size == 3 and rt.allocator.available_size() == 4


def test_a_verify_that_waited_too_long_takes_the_decode_room(caplog):
    """Verifies that keep waiting for room with no token committed (every request holding
    a slot waits to verify, so none would ever be freed) make the headroom grow into the
    decode room it otherwise leaves SGLang: SGLang retracts a request if it must, and the
    verify runs. Short of the limit it leaves that room; one warning per episode."""
    from sglang_vc.vericache.staging import STARVED_AFTER

    rt = _runtime(size=20)
    headroom = VerifyHeadroom(rt.allocator)
    rt.allocator.alloc(10)
    headroom.fit(9, keep_free=6, stalled=STARVED_AFTER - 1)
    assert headroom.size == 4 and rt.allocator.available_size() == 6
    with caplog.at_level("WARNING", logger="sglang_vc.vericache.staging"):
        headroom.fit(9, keep_free=6, stalled=STARVED_AFTER)
        assert headroom.size == 9 and rt.allocator.available_size() == 1
        headroom.fit(10, keep_free=6, stalled=STARVED_AFTER + 1)
    assert headroom.size == 10 and rt.allocator.available_size() == 0
    assert len([r for r in caplog.records if "waited for pool room" in r.getMessage()]) == 1
    headroom.yield_to_decode(3)  # starved: it keeps the decode room it took
    assert headroom.size == 10


def test_the_headroom_evicts_cached_prefixes_it_lacks():
    """Short of free slots, the headroom asks SGLang's prefix cache for what it lacks
    beyond the decode room it leaves, as SGLang's own allocations do."""
    rt = _runtime(size=20)
    cached = rt.allocator.alloc(12)  # a cached prefix: evictable
    asked = []

    def evict(n):
        asked.append(n)
        rt.allocator.free(cached[:n])

    headroom = VerifyHeadroom(rt.allocator, evict)
    headroom.fit(9, keep_free=2)
    assert asked == [3] and headroom.size == 9 and rt.allocator.available_size() == 2


def test_the_headroom_yields_to_sglangs_next_decode():
    """What SGLang's next decode lacks comes back from the headroom (else SGLang would
    retract a request), never more than it holds, and none while a forward uses it."""
    rt = _runtime(size=20)
    headroom = VerifyHeadroom(rt.allocator)
    headroom.fit(8)
    headroom.yield_to_decode(3)
    assert headroom.size == 5 and rt.allocator.available_size() == 15
    headroom.take(2)
    headroom.yield_to_decode(3)  # a forward holds some
    assert headroom.size == 5
    headroom.give_back()
    headroom.yield_to_decode(9)
    assert headroom.size == 0 and rt.allocator.available_size() == 20


def test_a_failed_reload_keeps_the_staged_slots_as_its_full_kv():
    rt = _runtime()
    host, full, spans = _compressed_row(rt, 2, p=1, n=9, n_keep=3)
    kept_slots = rt.req_to_token[2, 1:4].long().clone()
    free = rt.allocator.available_size()
    staging = PoolStaging(rt, lambda l: {})  # the reload gave up: nothing staged per layer
    assert staging.reserve(0, host)
    staging.point()
    staged = staging.requests[0].slots.clone()

    def full_rows(entry, span_slots):
        assert torch.equal(span_slots[:3], kept_slots)  # the request's own slots, not the staged ones
        return {l: full[l][0] for l in LAYERS}, {l: full[l][1] for l in LAYERS}

    assert staging.adopt(host, full_rows)
    staging.restore()
    assert torch.equal(rt.req_to_token[2, 1:9].long(), staged)
    for l in LAYERS:
        assert torch.equal(rt.kv_pool.k[l][staged], full[l][0])
    assert rt.dropped == [2]
    assert rt.allocator.available_size() == free - 8 + 3  # its 3 kept slots back


def test_a_compressing_server_keeps_sglangs_whole_pool():
    """Quantized payloads lease pool slots while their request lives
    (:mod:`sglang_vc.kvruntime.payload_store`): a lossy server's pool is SGLang's, every
    byte of the budget SGLang profiles (device memory after the weights, times
    --mem-fraction-static); the hook is registered on the function SGLang calls."""
    from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401  (the target must import)
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from sglang_vc.config import SERVER_ARGS_ATTR
    from sglang_vc.hooks import _reload_staging_inside_the_budget
    from sglang_vc.kvruntime.runtime import kv_budget_split

    assert callable(KVCacheConfigurator._profile_available_bytes)
    for vc in ({"vc_compressor": "specache"}, {"vc_compressor": "kivi"}, {}):
        on = types.SimpleNamespace(server_args=types.SimpleNamespace(**{SERVER_ARGS_ATTR: vc}), is_draft_worker=False)
        assert _reload_staging_inside_the_budget(10 << 30, on) is None and kv_budget_split() == {}


def test_vericache_sets_its_staged_reloads_aside_in_sglangs_kv_budget():
    """Under VERICACHE the budget is split two ways: the pool and the reloads staged ahead
    of their verify (``--vc-staging-fraction`` of the pool's bytes), which the staggered
    schedule's HBM ring then admits against (``runtime.staging_budget``, shown in
    ``/server_info``'s ``kv_pool``); its drafter's payloads take nothing at start-up. Other
    servers set nothing aside."""
    from sglang_vc.hooks import _reload_staging_inside_the_budget
    from sglang_vc.kvruntime.runtime import kv_budget_split
    from sglang_vc.launch_server import parse_args
    from sglang_vc.vericache import flags

    def configurator(algorithm, *argv):
        _, sa = parse_args(["--speculative-algorithm", algorithm, *argv])
        return types.SimpleNamespace(server_args=sa, is_draft_worker=False)

    budget = 10 << 30
    pool = _reload_staging_inside_the_budget(budget, configurator("VERICACHE", "--vc-compressor", "kivi", "--vc-kv-bits", "2"))
    f = flags.DEFAULT_STAGING_FRACTION
    assert pool == int(budget / (1 + f))
    split = kv_budget_split()
    assert split == {"pool": pool, "reload_staging": int(f * pool)}
    assert budget - 2 <= sum(split.values()) <= budget  # the two shares fill the budget

    pool = _reload_staging_inside_the_budget(budget, configurator("VERICACHE", "--vc-compressor", "kivi", "--vc-kv-bits", "2",
                                                                  "--vc-staging-fraction", "0.5"))
    assert pool == int(budget / 1.5) and kv_budget_split()["reload_staging"] == int(0.5 * pool)
    # SPECACHE: its payloads are not the compressed-KV runtime's, and it verifies nothing
    assert _reload_staging_inside_the_budget(budget, configurator("SPECACHE")) is None
    assert kv_budget_split() == {}
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--speculative-algorithm", "VERICACHE", "--vc-staging-fraction", bad])


def test_the_scheduler_hook_gives_the_decode_what_it_lacks(monkeypatch):
    """Before SGLang's ``update_running_batch`` checks the next decode's room, the hook
    has the headroom give back what that decode lacks (SGLang would retract a request
    otherwise), and nothing when it fits."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_vc import hooks
    from sglang_vc.kvruntime import runtime as runtime_mod

    assert callable(Scheduler.update_running_batch)  # the hook's target
    rt = _runtime(size=20)
    headroom = VerifyHeadroom(rt.allocator)
    headroom.fit(8)
    monkeypatch.setattr(runtime_mod, "_runtime", types.SimpleNamespace(held_back=headroom))

    class Batch:
        def __init__(self, need):
            self.need = need

        def is_empty(self):
            return False

        def check_decode_mem(self):
            return rt.allocator.available_size() >= self.need

        def new_tokens_required_next_decode(self):
            return self.need

    hooks._headroom_yields_to_decode(None, Batch(10))  # 12 free: it fits
    assert headroom.size == 8
    hooks._headroom_yields_to_decode(None, Batch(15))  # 3 short
    assert headroom.size == 5 and rt.allocator.available_size() == 15
