"""A verify forward's full KV in SGLang's KV pool (:mod:`sglang_vc.vericache.staging`),
on SGLang's own token allocator: slots reserved per verifying request, its row pointed
at them and back, each layer's full rows copied there by the reload (a token-dropping
drafter's kept rows merged with the reloaded dropped ones), the headroom held back in the pool taken
when the allocator has no room, no room at all refused without taking anything,
and a failed reload adopting the staged slots for good."""

from __future__ import annotations

import types

import pytest

import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sglang_vc.kvruntime import NULL_SLOT
from sglang_vc.kvruntime.scheduler_side import SchedulerSide
from concurrent.futures import ThreadPoolExecutor

from sglang_vc.vericache.reload import HostEntry, LayerwiseReload, Span
from sglang_vc.vericache.staging import AheadSlots, PoolStaging, VerifyHeadroom

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
    for l, span in spans.items():  # the host copy holds the dropped rows only
        host.k[l], host.v[l], host.kept[l], host.dropped[l] = span.k, span.v, span.kept, span.dropped
    return host, full, spans


def _reload(rt, staging, hosts: dict, executor, release=None):
    """The worker's reload of ``hosts`` (forward index -> entry) into their staged slots."""
    reload = LayerwiseReload(executor, hosts, {k: staging.requests[k].slots for k in hosts}, rt.kv_pool,
                             rt.req_to_token, list(LAYERS), "cpu", release=release)
    staging.layer_ready = reload.layer
    return reload


def test_staged_rows_hold_the_full_kv_during_the_forward_and_the_mapping_comes_back():
    rt = _runtime()
    host0, full0, spans0 = _compressed_row(rt, 1, p=2, n=10, n_keep=3)
    host1, full1, spans1 = _compressed_row(rt, 3, p=0, n=6, n_keep=2)
    before = rt.req_to_token.clone()
    free = rt.allocator.available_size()
    staging = PoolStaging(rt)
    assert staging.reserve(0, host0) and staging.reserve(5, host1)
    assert rt.allocator.available_size() == free - 8 - 6
    executor = ThreadPoolExecutor(1)
    reload = _reload(rt, staging, {0: host0, 5: host1}, executor)  # (before the rows are pointed)
    staging.point()
    for k, host, full in ((0, host0, full0), (5, host1, full1)):
        row = rt.req_to_token[host.req_pool_idx]
        assert torch.equal(row[host.p : host.n].long(), staging.requests[k].slots)
        assert torch.equal(row[: host.p], before[host.req_pool_idx, : host.p])  # the tree prefix untouched
    for l in LAYERS:
        staging.layer_landed(l)
        for k, host, full in ((0, host0, full0), (5, host1, full1)):
            at = rt.req_to_token[host.req_pool_idx, host.p : host.n].long()
            assert torch.equal(rt.kv_pool.k[l][at], full[l][0]) and torch.equal(rt.kv_pool.v[l][at], full[l][1])
    reload.close()
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
    staging = PoolStaging(rt, headroom=headroom)
    assert staging.reserve(0, host0) and staging.requests[0].from_headroom
    assert not staging.reserve(1, host1) and 1 not in staging  # no room left: it waits
    reload = _reload(rt, staging, {0: host0}, ThreadPoolExecutor(1))
    staging.point()
    for l in LAYERS:
        staging.layer_landed(l)
        at = rt.req_to_token[1, 0:10].long()
        assert torch.equal(rt.kv_pool.k[l][at], full0[l][0]) and torch.equal(rt.kv_pool.v[l][at], full0[l][1])
    reload.close()
    staging.restore()
    assert rt.allocator.available_size() == 0 and headroom.used == 0 and headroom.size == 10
    assert PoolStaging(rt, headroom=headroom).reserve(0, host1)  # the next forward's verifier fits


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
    staging = PoolStaging(rt)  # the reload gave up: nothing lands per layer
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


def test_a_reload_started_ahead_lands_in_slots_it_took_and_hands_them_to_the_verify():
    """The staggered schedule starts a reload iterations before its verify: its slots are
    the allocator's from then on (SGLang counts them as used), the verify's staging takes
    them over (freed after the forward), and a reload closed unconsumed gives them back."""
    rt = _runtime(size=40)
    host, full, _ = _compressed_row(rt, 1, p=2, n=12, n_keep=4)
    free = rt.allocator.available_size()
    ahead = AheadSlots(rt.allocator, bytes_per_slot=7, cap_bytes=700)
    executor = ThreadPoolExecutor(1)
    slots = ahead.take(10)
    reload = LayerwiseReload(executor, {0: host}, {0: slots}, rt.kv_pool, rt.req_to_token, list(LAYERS), "cpu",
                             depth=len(LAYERS), release=ahead)
    assert rt.allocator.available_size() == free - 10 and ahead.held == 10
    assert ahead.stats()["reload_ahead_bytes"] == 70
    staging = PoolStaging(rt)
    staging.hold(3, host, reload.hand_over()[0])
    staging.layer_ready = reload.layer
    assert ahead.held == 0 and ahead.peak == 10
    staging.point()
    for l in LAYERS:
        staging.layer_landed(l)
        at = rt.req_to_token[1, 2:12].long()
        assert torch.equal(at, slots)
        assert torch.equal(rt.kv_pool.k[l][at], full[l][0]) and torch.equal(rt.kv_pool.v[l][at], full[l][1])
    reload.close()  # handed over: it gives nothing back itself
    assert rt.allocator.available_size() == free - 10
    staging.restore()
    assert rt.allocator.available_size() == free
    # a reload put off (its verify deferred, its request gone): the slots come back at close
    dropped = LayerwiseReload(executor, {0: host}, {0: ahead.take(10)}, rt.kv_pool, rt.req_to_token, list(LAYERS),
                              "cpu", depth=len(LAYERS), release=ahead)
    dropped.close()
    assert rt.allocator.available_size() == free and ahead.held == 0
    assert ahead.take(10 ** 6) is None and ahead.held == 0  # no room: nothing taken


def test_a_40k_token_reload_needs_only_the_slots_its_verify_takes():
    """A verify's reload of any length lands in the slots its verify needs anyway: a
    40,960-token request of 2 layers reloads with nothing allocated beside the pool but
    one layer in flight (depth 1), identical to its full KV, and attention over the staged
    row equals attention over the full KV."""
    n, pool_size = 40960, 40960 + 64
    rt = types.SimpleNamespace(req_to_token=torch.zeros(2, n + 8, dtype=torch.int32),
                               allocator=TokenToKVPoolAllocator(pool_size, torch.float32, "cpu", None, need_sort=False),
                               kv_pool=_Pool(pool_size), drop_compressed_index=lambda row: None)
    rt.req_to_token[1, :n] = NULL_SLOT  # quantized elsewhere: no row of the prompt in the pool
    g = torch.Generator().manual_seed(0)
    full = {l: (torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)) for l in LAYERS}
    host = HostEntry("long", 1, 0, n)
    for l in LAYERS:
        host.k[l], host.v[l] = full[l]
    staging = PoolStaging(rt)
    assert staging.reserve(0, host) and rt.allocator.available_size() == 64
    reload = _reload(rt, staging, {0: host}, ThreadPoolExecutor(1))
    staging.point()
    q = torch.randn(1, H, 3, D, generator=g)
    for l in LAYERS:
        staging.layer_landed(l)
        at = rt.req_to_token[1, :n].long()
        k, v = rt.kv_pool.k[l][at], rt.kv_pool.v[l][at]
        assert torch.equal(k, full[l][0]) and torch.equal(v, full[l][1])
        got = torch.nn.functional.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        want = torch.nn.functional.scaled_dot_product_attention(q, full[l][0].transpose(0, 1)[None],
                                                                full[l][1].transpose(0, 1)[None])
        assert torch.equal(got, want)
    assert reload.nbytes() == host.nbytes()
    reload.close()
    staging.restore()
    assert rt.allocator.available_size() == pool_size and (rt.req_to_token[1, :n] == NULL_SLOT).all()


def test_every_server_keeps_sglangs_whole_pool():
    """Nothing is set aside at start-up: quantized payloads lease pool slots while their
    request lives (:mod:`sglang_vc.kvruntime.payload_store`) and reloads land in pool slots
    taken when they start (:class:`sglang_vc.vericache.staging.AheadSlots`), so the pool
    is the plain server's, every byte of the budget SGLang profiles, whatever the flags:
    no project hook on SGLang's pool sizing changes it (``bench.gpu_parity.pool_share``
    runs every hook ``hooks.install`` registers there)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from sglang_vc.bench.gpu_parity import pool_share
    from sglang_vc.launch_server import parse_args

    assert callable(KVCacheConfigurator._profile_available_bytes)  # the function SGLang sizes the pool with
    for argv in (("--speculative-algorithm", "VERICACHE"),
                 ("--speculative-algorithm", "VERICACHE", "--vc-compressor", "kivi", "--vc-kv-bits", "2",
                  "--vc-staging-fraction", "0.5"),
                 ("--speculative-algorithm", "VERICACHE", "--vc-schedule", "lockstep"),
                 ("--vc-compressor", "kivi", "--vc-kv-bits", "4"), ("--speculative-algorithm", "SPECACHE"), ()):
        assert pool_share(argv) == 1.0, argv
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
    monkeypatch.setattr(runtime_mod, "_runtime", types.SimpleNamespace(side=SchedulerSide(held_back=headroom)))

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
