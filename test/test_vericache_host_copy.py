"""The prefill's copies of the full KV to the host store go through one small device
buffer: the gathered device rows are free once a layer is done with them, the pieces in
flight hold at most the buffer, and where the link is behind the scheduler waits for the
oldest copy rather than hold more (no server; stand-in streams and events record what a
GPU would order)."""

from __future__ import annotations

import types

import torch

from sglang_vc.kvruntime import CopyStream
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache.reload import HostKVStore
from sglang_vc.vericache.staging_arena import ALIGN, StagingArena

LAYERS = [0, 1, 2, 3]


class _LaggingStreams(StandInStreams):
    """Stand-in streams whose events pass only once the host waits for them: a link
    that has copied nothing by the time the prefill queues the next layer."""

    def _event(self, stream: str):
        event = super()._event(stream)
        event.passed = False
        event.query = lambda: event.passed

        def synchronize():
            self.log.append(("sync", event))
            event.passed = True
        event.synchronize = synchronize
        return event


def _store(fake, arena_bytes: int, kept=None, n=64, p=0):
    stream = CopyStream("cpu", module=fake)
    kept_alive = []
    stream.keep_alive = lambda t, s: kept_alive.append(t)
    store = HostKVStore(copy_stream=stream, pin=False)
    arena = StagingArena(arena_bytes, "cpu", stream.fences)
    store.use_arena(arena)
    assert store.admit("a", 5, p, n, nbytes=100)
    torch.manual_seed(0)
    full = {l: (torch.randn(n, 2, 4), torch.randn(n, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, p, k, v)
        store.kept("a", 5, l, kept)  # None: a quantizer, the whole layer goes now
    store.flush()
    return store, arena, full, kept_alive


def test_the_prefills_rows_reach_the_host_through_the_arena_bytes_equal():
    fake = StandInStreams()
    store, arena, full, kept_alive = _store(fake, arena_bytes=64 * ALIGN)
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())
    out = store.copy_out
    assert out.outside == 0 and not kept_alive, "no copy read (and kept alive) the gathered device rows"
    # each piece: an event of the compute stream's write into the arena, then the copy
    copies = [e for kind, e in fake.log if kind == "record" and e.stream == "copy"]
    waits = [e for kind, e in fake.log if kind == "copy-wait"]
    assert len(copies) == len(waits) == 2 * len(LAYERS) and all(w.stream == "compute" for w in waits)
    assert entry.event is copies[-1]


def test_a_lagging_link_makes_the_prefill_wait_not_hold_more():
    """A 4 KiB buffer, pieces of 2 KiB, each layer's K and V 2 KiB: with no copy landing
    by itself, the third piece waits for the first, so the device never holds more than
    two pieces, whatever the layers."""
    fake = _LaggingStreams()
    store, arena, full, _ = _store(fake, arena_bytes=16 * ALIGN)
    out = store.copy_out
    assert out.cap == 16 * ALIGN and out.piece == out.cap // 2
    assert out.peak_in_flight <= out.cap and arena.peak <= out.cap
    syncs = [e for kind, e in fake.log if kind == "sync"]
    assert len(syncs) == 2 * len(LAYERS) - 2  # every piece but the last two waited for one before
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())


def test_a_layer_larger_than_a_piece_goes_in_pieces_and_a_token_droppers_rows_too():
    fake = _LaggingStreams()
    kept = torch.stack([torch.arange(0, 64, 4), torch.arange(1, 64, 4)])  # 16 kept rows per head
    store, arena, full, _ = _store(fake, arena_bytes=4 * ALIGN, kept=kept)
    out = store.copy_out
    assert out.piece == 2 * ALIGN  # 16 rows of 32 bytes: the 48 dropped rows in three pieces
    entry = store.get("a", 5)
    for l, (k, _) in full.items():
        keep = set(kept[0].tolist())
        assert torch.equal(entry.k[l][:, 0], k[[i for i in range(64) if i not in keep], 0])
    assert out.peak_in_flight <= out.cap and out.outside == 0


def test_without_room_in_the_arena_a_piece_copies_from_its_own_tensor_and_is_counted():
    """The buffer is full: each piece then copies from a tensor of its own (kept alive until
    its copy lands), counted, and still lands whole."""
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    kept_alive = []
    stream.keep_alive = lambda t, s: kept_alive.append(t)
    store = HostKVStore(copy_stream=stream, pin=False)
    arena = StagingArena(64 * ALIGN, "cpu", stream.fences)
    store.use_arena(arena)
    assert arena.alloc(arena.capacity) is not None  # no room left
    assert store.admit("a", 5, 0, 64, nbytes=100)
    full = {l: (torch.randn(64, 2, 4), torch.randn(64, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, 0, k, v)
        store.kept("a", 5, l, None)
    out = store.copy_out
    assert out.outside == 2 * len(LAYERS) and len(kept_alive) == out.outside
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())


def test_on_the_cpu_the_store_copies_directly():
    store = HostKVStore(pin=False)
    store.use_arena(StagingArena(64 * ALIGN, "cpu"))
    assert store.copy_out is None  # no stream: a copy is done when it returns
    # on an accelerator, a buffer the device could not hold (no room at all)
    store = HostKVStore(copy_stream=CopyStream("cpu", module=StandInStreams()), pin=False)
    store.use_arena(types.SimpleNamespace(capacity=0))
    assert store.copy_out is None
