"""Staged reloads in pool slots leased per reload (``vericache.staging_leases`` over
``kvruntime.pool_lease``), on SGLang's own KV pool and allocator: a lease is out of
SGLang's free list while held and back once the GPU is past it, and the layer-wise reload
stages into the lease's rows (no server)."""

from __future__ import annotations

import gc
import types
from concurrent.futures import ThreadPoolExecutor

import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream, pool_lease
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache.host_copy import rows_for
from sglang_vc.vericache.reload import HostKVStore, LayerwiseReload
from sglang_vc.vericache.staging_leases import StagingLeases

LAYERS = [0, 1, 2, 3]


def _pool(size=64):
    kv = MHATokenToKVPool(size, 1, torch.float32, 2, 4, len(LAYERS), "cpu", False, enable_alt_stream=False)
    return kv, TokenToKVPoolAllocator(size, torch.float32, "cpu", kv, need_sort=True)


def _staging(size=64, cap=None, fences=tuple):
    kv, alloc = _pool(size)
    staging = StagingLeases(lambda rows: pool_lease.take(alloc, kv, rows), lambda lease: pool_lease.give_back(alloc, lease),
                            size if cap is None else cap, fences)
    return staging, kv, alloc


def _store(n=10, p=2, kept=None):
    store = HostKVStore()
    assert store.admit("a", 5, p, n, nbytes=100)
    torch.manual_seed(0)
    full = {l: (torch.randn(n, 2, 4), torch.randn(n, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, p, k, v)
        if kept is not None:
            store.kept("a", 5, l, kept)
    store.flush()
    return store.get("a", 5), full


def _in_layer(t: torch.Tensor, kv, layer: int) -> bool:
    """``t`` lies in layer ``layer``'s K or V buffer of the pool."""
    for buf in (kv.get_key_buffer(layer), kv.get_value_buffer(layer)):
        lo = buf.data_ptr()
        if lo <= t.data_ptr() < lo + buf.numel() * buf.element_size():
            return True
    return False


def _in_pool(t: torch.Tensor, kv) -> bool:
    return any(_in_layer(t, kv, l) for l in LAYERS)


class _Event:
    """A GPU event that has not passed until ``passed`` is set (a host wait sets it)."""

    def __init__(self):
        self.passed = False
        self.waited = 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited += 1
        self.passed = True


def test_a_lease_is_out_of_sglangs_free_list_until_the_gpu_passed_its_events():
    staging, kv, alloc = _staging(cap=40)
    first = staging.take(16)
    assert first is not None and alloc.available_size() == 64 - 16 and staging.in_use == 16
    copied, read = _Event(), _Event()
    staging.release(first, [copied, read])
    assert staging.in_use == 16 and alloc.available_size() == 48  # the GPU may still copy into it or read it
    second = staging.take(16)
    assert second is not None and read.waited == 0  # under the cap: no wait
    copied.passed = True  # the reads have not passed: the first lease is not back yet
    third = staging.take(16)  # over the cap: the oldest closed lease is waited for (a rare host wait)
    assert third is not None and read.waited == 1 and staging.in_use == 32
    done = _Event()
    done.passed = True
    staging.release(second, [done])
    staging.release(third)
    assert staging.in_use == 0 and done.waited == 0 and alloc.available_size() == 64 and staging.peak == 32


def test_over_the_cap_or_without_a_run_of_free_slots_there_is_no_lease():
    staging, kv, alloc = _staging(cap=8)
    assert staging.take(9) is None  # over the cap
    staging.cap_rows = 64
    got = alloc.alloc(64)
    alloc.free(got[::2])  # every other slot free: no run of two
    assert staging.take(2) is None and staging.no_room == 2
    alloc.free(got[1::2])
    assert staging.take(2) is not None


def test_a_reload_stages_its_layers_into_depth_plus_one_layers_rows_of_one_lease():
    """Depth 1 over 4 layers: one lease of the span's rows; layers 0 and 2 stage into the
    lease's rows of layer 0 (layer 0 consumed by then), 1 and 3 into layer 1's, and every
    layer is served with its own rows."""
    entry, full = _store()
    staging, kv, alloc = _staging()
    base = stats.snapshot().get("vericache", {})
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=1, staging=staging)
        assert rl.lease is not None and rl.lease.size == 8  # the span [2, 10): a slot per row
        assert alloc.available_size() == 64 - 8
        ptrs = []
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert _in_layer(span.k, kv, l % 2) and _in_layer(span.v, kv, l % 2)
            assert torch.equal(span.k, full[l][0][2:]) and torch.equal(span.v, full[l][1][2:])
            ptrs.append(span.k.data_ptr())
        assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
        rl.close()
    assert staging.in_use == 0 and alloc.available_size() == 64 and rl.failures == 0
    after = stats.snapshot()["vericache"]
    assert after["staged_in_pool"] == base.get("staged_in_pool", 0) + 1


def test_a_token_dropping_drafters_rows_and_positions_stage_into_the_lease():
    kept = torch.tensor([[2, 5, 9], [3, 4, 8]])
    entry, full = _store(kept=kept)
    staging, kv, _ = _staging()
    k_buf = {l: torch.zeros(10, 2, 4) for l in LAYERS}
    v_buf = {l: torch.zeros(10, 2, 4) for l in LAYERS}
    for l in LAYERS:
        for h in range(2):
            for j in range(3):
                k_buf[l][2 + j, h], v_buf[l][2 + j, h] = full[l][0][kept[h, j], h], full[l][1][kept[h, j], h]
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), staging=staging)
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert all(_in_layer(t, kv, l) for t in span.tensors())
            k, v = span.full(k_buf[l], v_buf[l], torch.arange(10)[2:])
            assert torch.equal(k, full[l][0][2:]) and torch.equal(v, full[l][1][2:])
        rl.close()
    assert staging.in_use == 0 and staging.peak > 0  # (rows, positions, each 256-byte aligned)


def test_a_staggered_reload_holds_every_layer_in_its_own_layers_rows_even_when_layers_differ():
    """Layers of different sizes (two layers keep rows on the device and stage only the
    dropped ones, two stay full): holding every layer until its verify, each layer is in
    the lease's rows of that layer, from their start; the lease has rows for the largest."""
    store = HostKVStore()
    assert store.admit("a", 5, 2, 10, nbytes=100)
    torch.manual_seed(1)
    full = {l: (torch.randn(10, 2, 4), torch.randn(10, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, 2, k, v)
    for l in LAYERS[:2]:
        store.kept("a", 5, l, torch.tensor([[2, 5, 9], [3, 4, 8]]))
    store.flush()
    entry = store.get("a", 5)
    assert entry.span(0).staged_bytes() != entry.span(3).staged_bytes()
    staging, kv, _ = _staging()
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), staging=staging)
        # rows for the largest layer: a token-dropping layer's rows and positions, each
        # 256-byte aligned (here larger than the 8 full rows: 32-byte rows)
        assert rl.lease.size == max(rows_for([entry.span(l).tensors()]) for l in LAYERS) >= 8
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert torch.equal(span.k, entry.k[l]) and torch.equal(span.v, entry.v[l])
            assert span.k.data_ptr() == kv.get_key_buffer(l)[rl.lease.start].data_ptr()
            assert span.v.data_ptr() == kv.get_value_buffer(l)[rl.lease.start].data_ptr()
        rl.close()


def test_two_requests_of_one_reload_stage_one_after_the_other():
    a, full = _store()
    store = HostKVStore()
    assert store.admit("b", 6, 0, 8, nbytes=100)
    other = {l: (torch.randn(8, 2, 4), torch.randn(8, 2, 4)) for l in LAYERS}
    for l, (k, v) in other.items():
        store.sink("b", 6, l, 0, k, v)
    store.flush()
    staging, kv, _ = _staging()
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: a, 1: store.get("b", 6)}, LAYERS, "cpu", depth=len(LAYERS), staging=staging)
        assert rl.lease.size == 8 + 8  # (8 rows of 32 bytes: 256, aligned already)
        for l in LAYERS:
            spans = rl.layer(l)
            assert torch.equal(spans[0].k, full[l][0][2:]) and torch.equal(spans[1].v, other[l][1])
            assert spans[1].k.data_ptr() == kv.get_key_buffer(l)[rl.lease.start + 8].data_ptr()
        rl.close()


def test_a_reload_without_room_stages_outside_and_stays_correct():
    entry, full = _store()
    staging, kv, _ = _staging(cap=4)  # fewer rows than the span
    base = stats.snapshot().get("vericache", {}).get("staged_outside_pool", 0)
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=2, staging=staging)
        assert rl.lease is None
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert not _in_pool(span.k, kv) and torch.equal(span.k, full[l][0][2:])
        rl.close()
    assert stats.snapshot()["vericache"]["staged_outside_pool"] == base + 1


def test_a_reload_dropped_unclosed_still_gives_its_lease_back():
    entry, _ = _store()
    staging, kv, alloc = _staging()
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), staging=staging)
        for l in LAYERS:
            rl.layer(l)
    assert staging.in_use == 8
    del rl
    gc.collect()
    assert staging.in_use == 8  # queued, not given back from whatever thread dropped it
    assert staging.take(1) is not None and staging.in_use == 1  # at the next lease
    assert alloc.available_size() == 63


def test_on_a_gpu_closing_records_a_copy_and_a_compute_event_and_needs_no_record_stream():
    """With streams (a stand-in CUDA), closing records an event on the copy stream and one
    on the consumer's, which the lease's release waits for (their waiting is
    :func:`test_a_lease_is_out_of_sglangs_free_list_until_the_gpu_passed_its_events`). The
    staged views are not ``record_stream``-ed: they are pool memory."""
    entry, _ = _store()
    fake = StandInStreams()
    kept = []
    stream = CopyStream("cpu", module=fake)
    stream.keep_alive = lambda t, s: kept.append(t)
    staging, _, _ = _staging()
    released = []
    real = staging.release
    staging.release = lambda lease, events=(): (released.append(tuple(events)), real(lease, events))
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), copy_stream=stream, staging=staging)
        for l in LAYERS:
            rl.layer(l)
        rl.close()
    assert kept == []
    assert len(released) == 1 and [e.stream for e in released[0]] == ["copy", "compute"]
    assert staging.in_use == 0  # the stand-in's events have passed
    rl.close()  # closing twice gives nothing back twice
    assert len(released) == 1


def test_a_layers_rows_are_reused_only_after_the_gpu_passed_the_layer_before_it():
    """Depth 1 on a stand-in CUDA: two layers' rows. Layer ``i + 1``'s copy goes into
    layer ``i - 1``'s rows, and is issued (on the copy thread) only after a host wait on
    the event recorded when layer ``i`` was handed over: the GPU is past layer ``i - 1``'s
    reads by then."""
    entry, full = _store()
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    staging, _, _ = _staging(fences=stream.fences)
    ptrs = []
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=1, copy_stream=stream, staging=staging)
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert torch.equal(span.k, full[l][0][2:])
            ptrs.append(span.k.data_ptr())
        rl.close()
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]
    handed = [e for kind, e in fake.log if kind == "record" and e.stream == "compute"][: len(LAYERS)]
    synced = [e for kind, e in fake.log if kind == "sync"]
    # layer i + 1 waited for the hand-over of layer i (layer 1's wait is for the depth bound)
    assert synced == handed[:3], (handed, synced)
    copies = [i for i, (kind, e) in enumerate(fake.log) if kind == "record" and e.stream == "copy"]
    for s, copy in zip(synced, copies[1:]):
        assert next(i for i, (kind, e) in enumerate(fake.log) if kind == "sync" and e is s) < copy


def test_the_worker_caps_staging_at_the_staging_share_and_sets_nothing_aside():
    """The worker's staging leases pool slots at most ``--vc-staging-fraction`` of the
    pool at once (``_staging_budget``), built once; it takes no slot until a reload asks."""
    from sglang_vc.vericache.worker import VeriCacheWorker

    kv, alloc = _pool()
    worker = object.__new__(VeriCacheWorker)
    worker.device = "cpu"
    worker.copy_stream = CopyStream("cpu", module=StandInStreams())  # an accelerator's copy stream
    worker.host = HostKVStore(copy_stream=worker.copy_stream, pin=False)
    bytes_per_slot = len(LAYERS) * 2 * 2 * 4 * 4
    runtime = types.SimpleNamespace(staging_budget=16 * bytes_per_slot, staging_leases=None, allocator=alloc,
                                    kv_pool=kv, bytes_per_slot=bytes_per_slot, _evict=lambda n: None)
    worker._runtime = runtime
    staging = worker._staging_leases()
    assert staging.cap_rows == 16 and runtime.staging_leases is staging and worker._staging_leases() is staging
    assert alloc.available_size() == 64  # nothing set aside
    # the prefill's copies to the host store lease through the same staging (host_copy)
    assert worker.host.copy_out is not None and worker.host.copy_out.staging is staging


def test_the_gpu_checks_reload_staging_runs_the_servers_reload_on_the_cpu():
    """``bench.gpu_check``'s staging check (what a lent GPU runs first) on small CPU shapes:
    the staged rows equal the host copy, through leased rows and without them."""
    from sglang_vc.bench.gpu_check import reload_staging

    out = reload_staging(device="cpu", n=64, layers=3, hkv=2, d=8, dtype=torch.float32, repeats=1)
    assert out["ok"] and out["pool_gb_per_s"] > 0 and out["tensors_gb_per_s"] > 0, out
    assert out["staged_peak_bytes"] == out["bytes"]  # one leased row per staged token, every layer
