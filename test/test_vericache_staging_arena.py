"""The reloads' staging arena: one preallocated buffer, blocks handed out and given back
once the GPU is past them, and the layer-wise reload staging into it (no server)."""

from __future__ import annotations

import gc
import types
from concurrent.futures import ThreadPoolExecutor

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache.reload import HostKVStore, LayerwiseReload
from sglang_vc.vericache.staging_arena import ALIGN, StagingArena

LAYERS = [0, 1, 2, 3]


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


def _inside(t: torch.Tensor, arena: StagingArena) -> bool:
    start = arena.buffer.data_ptr()
    return start <= t.data_ptr() < start + arena.capacity


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


def test_blocks_are_aligned_first_fit_and_coalesce_when_given_back():
    arena = StagingArena(10 * ALIGN + 17, "cpu")
    assert arena.capacity == 10 * ALIGN  # whole aligned units only
    a, b, c = arena.alloc(1), arena.alloc(3 * ALIGN), arena.alloc(2 * ALIGN + 1)
    assert (a.start, a.size) == (0, ALIGN) and (b.start, b.size) == (ALIGN, 3 * ALIGN)
    assert (c.start, c.size) == (4 * ALIGN, 3 * ALIGN)
    assert arena.alloc(4 * ALIGN) is None  # 3 units left
    assert arena.in_use == 7 * ALIGN and arena.peak == 7 * ALIGN
    arena.release(a)
    arena.release(b)  # coalesces with a's run: 4 units from 0
    assert arena.alloc(4 * ALIGN).start == 0
    arena.release(c)  # coalesces with the free run after it: 6 units from 4
    assert arena.stats()["free_runs"] == 1 and arena.alloc(6 * ALIGN).start == 4 * ALIGN
    assert arena.alloc(11 * ALIGN) is None  # more than the arena
    assert arena.peak == 10 * ALIGN


def test_a_block_comes_back_only_once_the_gpu_passed_its_events():
    arena = StagingArena(8 * ALIGN, "cpu")
    first = arena.alloc(4 * ALIGN)
    copied, read = _Event(), _Event()
    arena.release(first, [copied, read])
    assert arena.in_use == 4 * ALIGN  # the GPU may still copy into it or read it
    second = arena.alloc(4 * ALIGN)
    assert second.start == 4 * ALIGN and read.waited == 0  # the free half: no wait
    copied.passed = True  # the reads have not passed: the first block is not free yet
    # nothing else fits: the arena waits for the pending block's events (a rare host wait)
    again = arena.alloc(ALIGN)
    assert again.start == 0 and read.waited == 1
    done = _Event()
    done.passed = True
    arena.release(second, [done])
    assert arena.in_use == ALIGN and done.waited == 0  # passed: back at once


def test_the_arena_waits_oldest_first_and_only_while_waiting_can_make_room():
    arena = StagingArena(6 * ALIGN, "cpu")
    blocks = [arena.alloc(2 * ALIGN) for _ in range(3)]
    events = [_Event() for _ in blocks]
    for block, event in zip(blocks, events):
        arena.release(block, [event])
    assert arena.alloc(2 * ALIGN).start == 0  # the oldest pending block, waited for
    assert [e.waited for e in events] == [1, 0, 0]
    assert arena.alloc(7 * ALIGN) is None and [e.waited for e in events] == [1, 0, 0]  # larger than the arena
    held = arena.alloc(4 * ALIGN)  # both others waited for: they coalesce
    assert held.start == 2 * ALIGN and [e.waited for e in events] == [1, 1, 1]
    assert arena.alloc(ALIGN) is None  # nothing pending, nothing free: no wait, no room


def test_views_are_typed_slices_of_the_block():
    arena = StagingArena(8 * ALIGN, "cpu")
    block = arena.alloc(2 * ALIGN)
    f = arena.view(block, 0, (4, 2, 4), torch.float32)
    i = arena.view(block, ALIGN, (2, 3), torch.int64)
    f.fill_(1.5)
    i.fill_(7)
    assert f.shape == (4, 2, 4) and i.dtype == torch.int64 and float(f.sum()) == 48.0
    assert i.data_ptr() - f.data_ptr() == ALIGN and _inside(i, arena)
    for bad in ((1, (4,), torch.float32), (ALIGN, (100,), torch.float32)):  # misaligned, too long
        try:
            arena.view(block, *bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a_reload_stages_its_layers_into_depth_plus_one_slots_of_one_block():
    """Depth 1 over 4 layers: one block of two layer slots; layer 2 reuses layer 0's
    views (consumed by then), and every layer is served with its own rows."""
    entry, full = _store()
    arena = StagingArena(1 << 20, "cpu")
    base = stats.snapshot().get("vericache", {})
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=1, arena=arena)
        assert rl.block is not None and rl.block.size == 2 * entry.span(0).staged_bytes()
        ptrs = []
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert _inside(span.k, arena) and _inside(span.v, arena)
            assert torch.equal(span.k, full[l][0][2:]) and torch.equal(span.v, full[l][1][2:])
            ptrs.append(span.k.data_ptr())
        assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
        assert arena.in_use == rl.block.size
        rl.close()
    assert arena.in_use == 0 and rl.failures == 0
    after = stats.snapshot()["vericache"]
    assert after["staged_in_arena"] == base.get("staged_in_arena", 0) + 1


def test_a_token_dropping_drafters_rows_and_positions_stage_into_the_arena():
    kept = torch.tensor([[2, 5, 9], [3, 4, 8]])
    entry, full = _store(kept=kept)
    arena = StagingArena(1 << 20, "cpu")
    k_buf = {l: torch.zeros(10, 2, 4) for l in LAYERS}
    v_buf = {l: torch.zeros(10, 2, 4) for l in LAYERS}
    for l in LAYERS:
        for h in range(2):
            for j in range(3):
                k_buf[l][2 + j, h], v_buf[l][2 + j, h] = full[l][0][kept[h, j], h], full[l][1][kept[h, j], h]
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), arena=arena)
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert all(_inside(t, arena) for t in span.tensors())
            k, v = span.full(k_buf[l], v_buf[l], torch.arange(10)[2:])
            assert torch.equal(k, full[l][0][2:]) and torch.equal(v, full[l][1][2:])
        rl.close()
    assert arena.in_use == 0 and arena.peak == entry.staged_bytes()


def test_a_staggered_reload_takes_the_bytes_the_hbm_ring_counted_even_when_layers_differ():
    """Layers of different sizes (two layers keep rows on the device and stage only the
    dropped ones, two stay full): holding every layer until its verify, the reload's block
    is exactly ``staged_bytes()`` (what ADMIT reserved on the HBM ring), each layer at its
    own offset."""
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
    sizes = {l: entry.span(l).staged_bytes() for l in LAYERS}
    assert sizes[0] != sizes[3]
    arena = StagingArena(1 << 20, "cpu")
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), arena=arena)
        assert rl.block.size == entry.staged_bytes() == sum(sizes.values())
        starts = []
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert torch.equal(span.k, entry.k[l]) and torch.equal(span.v, entry.v[l])
            starts.append(span.k.data_ptr() - arena.buffer.data_ptr())
        rl.close()
    assert starts == [sum(sizes[m] for m in LAYERS[:i]) for i in range(len(LAYERS))]


def test_a_reload_without_room_stages_outside_and_stays_correct():
    entry, full = _store()
    arena = StagingArena(ALIGN, "cpu")  # smaller than one layer slot
    base = stats.snapshot().get("vericache", {}).get("staged_outside_arena", 0)
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=2, arena=arena)
        assert rl.block is None
        for l in LAYERS:
            span = rl.layer(l)[0]
            assert not _inside(span.k, arena) and torch.equal(span.k, full[l][0][2:])
        rl.close()
    assert stats.snapshot()["vericache"]["staged_outside_arena"] == base + 1


def test_a_reload_dropped_unclosed_still_gives_its_block_back():
    entry, _ = _store()
    arena = StagingArena(1 << 20, "cpu")
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), arena=arena)
        for l in LAYERS:
            rl.layer(l)
    assert arena.in_use > 0
    del rl
    gc.collect()
    assert arena.in_use > 0  # queued, not given back from whatever thread dropped it
    assert arena.alloc(ALIGN) is not None and arena.in_use == ALIGN  # at the next allocation


def test_on_a_gpu_closing_records_a_copy_and_a_compute_event_and_needs_no_record_stream():
    """With streams (a stand-in CUDA), closing records an event on the copy stream and one
    on the consumer's, which the block's release waits for (their waiting is
    :func:`test_a_block_comes_back_only_once_the_gpu_passed_its_events`). The staged
    views are not ``record_stream``-ed: the arena's buffer is never freed."""
    entry, _ = _store()
    fake = StandInStreams()
    kept = []
    stream = CopyStream("cpu", module=fake)
    stream.keep_alive = lambda t, s: kept.append(t)
    arena = StagingArena(1 << 20, "cpu")
    released = []
    real = arena.release
    arena.release = lambda block, events=(): (released.append(tuple(events)), real(block, events))
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=len(LAYERS), copy_stream=stream, arena=arena)
        for l in LAYERS:
            rl.layer(l)
        rl.close()
    assert kept == []
    assert len(released) == 1 and [e.stream for e in released[0]] == ["copy", "compute"]
    assert arena.in_use == 0  # the stand-in's events have passed
    rl.close()  # closing twice gives nothing back twice
    assert len(released) == 1


def test_a_layer_slot_is_reused_only_after_the_gpu_passed_the_layer_before_it():
    """Depth 1 on a stand-in CUDA: two layer slots. Layer ``i + 1``'s copy goes into
    layer ``i - 1``'s slot, and is issued (on the copy thread) only after a host wait on
    the event recorded when layer ``i`` was handed over: the GPU is past layer ``i - 1``'s
    reads by then."""
    entry, full = _store()
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    arena = StagingArena(1 << 20, "cpu", stream.fences)
    ptrs = []
    with ThreadPoolExecutor(1) as pool:
        rl = LayerwiseReload(pool, {0: entry}, LAYERS, "cpu", depth=1, copy_stream=stream, arena=arena)
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


def test_the_worker_sizes_the_arena_to_the_staging_share():
    """The worker's arena is the HBM ring's capacity (``_staging_budget``), allocated once."""
    from sglang_vc.vericache.worker import VeriCacheWorker

    worker = object.__new__(VeriCacheWorker)
    worker.device = "cpu"
    worker.copy_stream = CopyStream("cpu", module=StandInStreams())  # an accelerator's copy stream
    worker.host = HostKVStore(copy_stream=worker.copy_stream, pin=False)
    runtime = types.SimpleNamespace(staging_budget=64 * ALIGN, staging_arena=None)
    worker._runtime = runtime
    arena = worker._staging_arena()
    assert arena.capacity == 64 * ALIGN and runtime.staging_arena is arena
    assert worker._staging_arena() is arena
    # the prefill's copies to the host store go through the same share (host_copy)
    assert worker.host.copy_out is not None and worker.host.copy_out.arena is arena


def test_the_gpu_checks_reload_staging_runs_the_servers_reload_on_the_cpu():
    """``bench.gpu_check``'s staging check (what a lent GPU runs first) on small CPU shapes:
    the staged rows equal the host copy, through the arena and without it."""
    from sglang_vc.bench.gpu_check import reload_staging

    out = reload_staging(device="cpu", n=64, layers=3, hkv=2, d=8, dtype=torch.float32, repeats=1)
    assert out["ok"] and out["arena_gb_per_s"] > 0 and out["tensors_gb_per_s"] > 0, out
    assert out["arena_peak_bytes"] == out["bytes"]  # 64 x 2 x 8 x 4 bytes per tensor: aligned already
