"""The host store of full KV and its layer-wise reload into pool slots (no server)."""

from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_vc.kvruntime import CopyStream
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache import reload as reload_mod
from sglang_vc.vericache.reload import HostKVStore, LayerwiseReload

LAYERS = [0, 1, 2, 3]


def _filled_store(capacity=None, n=10, p=2, flush=True, store=None):
    """A store holding request "a" (row 5): every layer sunk, and moved to the host whole
    unless ``flush`` is False (then a compressor's ``kept`` may still select rows)."""
    store = store if store is not None else HostKVStore(capacity)
    assert store.admit("a", 5, p, n, nbytes=100)
    torch.manual_seed(0)
    full = {l: (torch.randn(n, 2, 4), torch.randn(n, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, p, k, v)
    if flush:
        store.flush()
    return store, full


class _Pool:
    """A stand-in KV pool: per layer K and V buffers of ``size`` slots."""

    def __init__(self, size=24):
        self.k = {l: torch.zeros(size, 2, 4) for l in LAYERS}
        self.v = {l: torch.zeros(size, 2, 4) for l in LAYERS}

    def get_key_buffer(self, l):
        return self.k[l]

    def get_value_buffer(self, l):
        return self.v[l]


SLOTS = torch.tensor([17, 3, 9, 12, 20, 4, 15, 8])  # scattered, as SGLang's allocator may hand them out


def _reload(executor, entries, pool=None, req_to_token=None, **kw):
    """A reload of ``entries`` into :data:`SLOTS` (one request) of ``pool``."""
    pool = pool if pool is not None else _Pool()
    req_to_token = req_to_token if req_to_token is not None else torch.zeros(8, 16, dtype=torch.int32)
    return LayerwiseReload(executor, entries, {i: SLOTS for i in entries}, pool, req_to_token, LAYERS, "cpu", **kw), pool


def test_store_keeps_the_replaced_rows_bytes_equal():
    store, full = _filled_store()
    entry = store.get("a", 5)
    assert entry.num_tokens == 8
    for l, (k, v) in full.items():
        assert torch.equal(entry.k[l], k[2:]) and torch.equal(entry.v[l], v[2:])
    assert store.get("a", 6) is None  # another row: a stale entry is never served


def test_store_capacity_refuses_and_retain_frees():
    store = HostKVStore(capacity_bytes=250)
    assert store.admit("a", 0, 0, 10, 100)
    assert store.admit("b", 1, 0, 10, 100)
    assert not store.admit("c", 2, 0, 10, 100)  # 300 > 250
    assert store.reserved_bytes == 200
    store.retain({"b"})
    assert store.reserved_bytes == 100 and set(store.entries) == {"b"}
    assert store.admit("c", 2, 0, 10, 100)
    # re-admitting a request replaces its reservation, it does not add to it
    assert store.admit("c", 2, 0, 12, 120)
    assert store.reserved_bytes == 220


def test_layerwise_reload_lands_every_layer_in_its_slots_in_order():
    store, full = _filled_store()
    with ThreadPoolExecutor(1) as executor:
        rl, pool = _reload(executor, {3: store.get("a", 5)}, depth=2)
        for l in LAYERS:
            assert rl.layer(l) is None  # the rows are in the slots: nothing to hand over
            assert torch.equal(pool.k[l][SLOTS], full[l][0][2:]) and torch.equal(pool.v[l][SLOTS], full[l][1][2:])
        rl.close()
    assert rl.failures == 0
    assert rl.nbytes() == store.get("a", 5).nbytes()
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[SLOTS] = False
    assert all((pool.k[l][untouched] == 0).all() for l in LAYERS)  # no other slot written


def test_failed_copy_is_retried_synchronously(monkeypatch):
    store, full = _filled_store()
    monkeypatch.setattr(reload_mod.faults, "remaining", 1)
    with ThreadPoolExecutor(1) as executor:
        rl, pool = _reload(executor, {0: store.get("a", 5)})
        for l in LAYERS:
            rl.layer(l)
        rl.close()
    assert rl.failures == 1
    for l in LAYERS:
        assert torch.equal(pool.k[l][SLOTS], full[l][0][2:]) and torch.equal(pool.v[l][SLOTS], full[l][1][2:])


def test_copy_failing_every_retry_raises_not_serves(monkeypatch):
    store, _ = _filled_store()
    monkeypatch.setattr(reload_mod.faults, "whole", 1)  # every copy of the next reload fails
    with ThreadPoolExecutor(1) as executor:
        rl, _ = _reload(executor, {0: store.get("a", 5)})
        with pytest.raises(reload_mod.ReloadFailed, match="reload of layer 0 failed"):
            rl.layer(0)
        rl.close()


def test_copy_failing_every_retry_hands_the_requests_over(monkeypatch):
    """With ``on_failure`` (``FullKVRestore`` restores the full KV on the device) a copy that
    fails every retry calls it once with the requests, and nothing lands from then on:
    the verify reads the restored device KV."""
    store, _ = _filled_store()
    taken = []
    monkeypatch.setattr(reload_mod.faults, "whole", 1)
    with ThreadPoolExecutor(1) as executor:
        entries = {0: store.get("a", 5)}
        rl, pool = _reload(executor, entries, on_failure=lambda entries, staging: taken.append(entries))
        for l in LAYERS:
            rl.layer(l)
        rl.close()
    assert taken == [entries] and rl.gave_up
    assert all((pool.k[l] == 0).all() for l in LAYERS)
    assert rl.failures == 1 + reload_mod.SYNC_RETRIES
    assert rl.nbytes() < store.get("a", 5).nbytes()  # not every layer was copied


def test_close_unblocks_unconsumed_layers():
    store, _ = _filled_store()
    with ThreadPoolExecutor(1) as executor:
        rl, _ = _reload(executor, {0: store.get("a", 5)}, depth=1)
        rl.layer(0)
        rl.close()  # layers 1..3 never consumed: must not deadlock the copy thread
        assert executor.submit(lambda: 7).result(timeout=10) == 7


def test_dropped_rows_only_are_copied_and_merged_with_the_kept_ones():
    """After a token-dropping compressor kept 3 of the 8 span rows per head (different
    rows per head), the host keeps the 5 dropped rows; a reload copies only those (and
    their positions), and merges them with the kept rows still in the request's own
    slots (read from its row when the reload starts) into the verify's slots."""
    store, full = _filled_store(n=10, p=2, flush=False)
    kept = torch.tensor([[2, 5, 9], [3, 4, 8]])  # absolute positions, per KV head
    full_bytes = _filled_store(n=10, p=2)[0].get("a", 5).nbytes()
    for l in LAYERS:
        store.kept("a", 5, l, kept)
    store.flush()  # nothing left: every layer's rows were selected
    entry = store.get("a", 5)
    # the request's row 5: position 2 + j is its own slot 2 + j (a slot no reload writes), holding
    # for head h the position kept[h, j]
    pool = _Pool()
    req_to_token = torch.zeros(8, 16, dtype=torch.int32)
    req_to_token[5, :10] = torch.tensor([0, 1, 2, 5, 6, 0, 0, 0, 0, 0], dtype=torch.int32)
    own = [2, 5, 6]
    for l in LAYERS:
        for h in range(2):
            for j in range(3):
                pool.k[l][own[j], h] = full[l][0][kept[h, j], h]
                pool.v[l][own[j], h] = full[l][1][kept[h, j], h]
    with ThreadPoolExecutor(1) as executor:
        rl, _ = _reload(executor, {0: entry}, pool=pool, req_to_token=req_to_token, depth=len(LAYERS))
        req_to_token[5, 2:10] = SLOTS.to(torch.int32)  # the verify points the row at its slots
        for l in LAYERS:
            rl.layer(l)
            assert torch.equal(pool.k[l][SLOTS], full[l][0][2:]) and torch.equal(pool.v[l][SLOTS], full[l][1][2:])
        rl.close()
    rows = 2 * len(LAYERS) * 5 * 2 * 4 * 4  # k and v, layers, dropped rows, heads, dim, fp32
    positions = len(LAYERS) * (2 * 3 + 2 * 5) * 8
    assert rl.nbytes() == entry.nbytes() == rows + positions < full_bytes


def test_kept_rows_before_the_span_leave_the_full_rows():
    store, full = _filled_store(n=10, p=2, flush=False)
    store.kept("a", 5, 0, torch.tensor([[0, 5, 9], [3, 4, 8]]))  # position 0 < p
    store.flush()
    assert store.get("a", 5).span(0).kept is None and store.get("a", 5).k[0].shape[0] == 8
    assert torch.equal(store.get("a", 5).k[0], full[0][0][2:])


def test_rows_move_to_the_host_on_the_copy_stream_after_the_forward():
    """On an accelerator the prompt's rows go to the host by copies on the copy stream
    (the stream reloads use), queued after an event of the forward that computed them;
    the selection of a token-dropping compressor's dropped rows happens before, on the
    device, so only those move; a host reader waits for the last copy's event."""
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    kept_alive = []
    stream.keep_alive = lambda t, s: kept_alive.append(t)
    store, full = _filled_store(n=10, p=0, flush=False, store=HostKVStore(copy_stream=stream, pin=False))
    assert not fake.log, "nothing moves while the prefill forward runs"
    store.kept("a", 5, 0, torch.tensor([[2, 5, 9], [3, 4, 8]]))
    store.flush()
    kinds = [kind for kind, _ in fake.log]
    assert kinds == ["record", "copy-wait", "record"] * len(LAYERS), kinds
    marks, copies = fake.log[0::3], fake.log[2::3]
    assert all(m[1].stream == "compute" and w[1] is m[1] for m, w in zip(marks, fake.log[1::3]))
    assert all(c[1].stream == "copy" for c in copies)
    entry = store.get("a", 5)
    assert entry.k[0].shape == (7, 2, 4) and entry.k[1].shape == (10, 2, 4)  # layer 0: the 7 dropped rows
    assert torch.equal(entry.k[0][:, 0], full[0][0][[0, 1, 3, 4, 6, 7, 8], 0])
    assert len(kept_alive) == 2 * 2 + 2 * (len(LAYERS) - 1)  # the device rows the copies read
    waited = []
    entry.event = types.SimpleNamespace(synchronize=lambda: waited.append(1))
    entry.wait()
    entry.wait()
    assert waited == [1]


def test_a_quantized_layer_goes_to_the_host_during_the_prefill():
    """A quantizer keeps no full row on the device, so each layer's full copy moves to the
    host as soon as that layer is compressed (``kept(..., None)``), on the copy stream
    after the forward's event, not at the prefill's end: the device never holds every
    layer's full copy at once."""
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    stream.keep_alive = lambda t, s: None
    store = HostKVStore(copy_stream=stream, pin=False)
    assert store.admit("a", 5, 0, 10, nbytes=100)
    full = {l: (torch.randn(10, 2, 4), torch.randn(10, 2, 4)) for l in LAYERS}
    for l, (k, v) in full.items():
        store.sink("a", 5, l, 0, k, v)
        store.kept("a", 5, l, None)
        assert not store.entries["a"].pending, "the layer left the device at once"
        assert [kind for kind, _ in fake.log[-3:]] == ["record", "copy-wait", "record"]
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())
    n = len(fake.log)
    store.flush()
    assert len(fake.log) == n  # nothing was left for the prefill's end


def test_reload_copies_on_its_own_stream_and_the_consumer_waits():
    """On an accelerator each layer is copied on the copy stream, after the compute
    stream's work queued before the reload started (the slots' previous users), and the
    consumer's stream waits on that layer's event before reading it; the slots are the
    pool's, so nothing is kept alive."""
    store, full = _filled_store()
    fake = StandInStreams()
    kept = []
    stream = CopyStream("cpu", module=fake)
    stream.keep_alive = lambda t, s: kept.append(t)
    with ThreadPoolExecutor(1) as executor:
        rl, pool = _reload(executor, {0: store.get("a", 5)}, copy_stream=stream)
        start = fake.log[0][1]
        assert fake.log[0][0] == "record" and start.stream == "compute"
        for l in LAYERS:
            rl.layer(l)
            assert fake.log[-1][0] == "wait" and fake.log[-1][1].layer_copied == "copy"
            assert torch.equal(pool.k[l][SLOTS], full[l][0][2:])
        rl.close()
    assert kept == []
    assert [e for kind, e in fake.log if kind == "copy-wait"] == [start] * len(LAYERS)
    waits = [e for kind, e in fake.log if kind == "wait"]
    records = [e for kind, e in fake.log if kind == "record"]
    assert len(waits) == len(LAYERS) and all(any(w is r for r in records) for w in waits)
    assert CopyStream("cpu").stream is None  # the CPU: no stream, no wait


def test_a_reload_closed_unconsumed_makes_the_consumer_wait_for_its_last_copy():
    """A reload closed before its verify read every layer (the verify was put off, the
    request left, the forward raised): its slots go back to the allocator right after,
    so the consumer's stream first waits for its last copy (no host wait); a reload
    consumed whole adds no wait at close."""
    store, _ = _filled_store()
    for consumed, extra_waits in ((LAYERS, 0), (LAYERS[:1], 1)):
        fake = StandInStreams()
        stream = CopyStream("cpu", module=fake)
        with ThreadPoolExecutor(1) as executor:
            rl, _ = _reload(executor, {0: store.get("a", 5)}, copy_stream=stream, depth=len(LAYERS))
            for l in consumed:
                rl.layer(l)
            before = len([1 for kind, _ in fake.log if kind == "wait"])
            rl.close()
        waits = [e for kind, e in fake.log if kind == "wait"][before:]
        assert len(waits) == extra_waits
        if extra_waits:
            last_copy = [e for kind, e in fake.log if kind == "record" and e.stream == "copy"][-1]
            assert waits[0] is last_copy
            assert not any(kind == "sync" for kind, _ in fake.log)


def test_a_staging_slot_comes_back_when_the_gpu_used_the_layers_before():
    """``depth`` bounds the layers in flight on the device (each passes through a device
    tensor of its own before it lands), not only on the host: the copy of layer
    ``l + depth`` waits (on the copy thread) for the consumer stream's event recorded when
    layer ``l`` was handed over; the first ``depth`` copies wait for nothing."""
    store, _ = _filled_store()
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    with ThreadPoolExecutor(1) as executor:
        rl, _ = _reload(executor, {0: store.get("a", 5)}, depth=2, copy_stream=stream)
        for l in LAYERS:
            rl.layer(l)
        rl.close()
    handed = [e for kind, e in fake.log if kind == "record" and e.stream == "compute"][1:]  # (the first: the start)
    synced = [e for kind, e in fake.log if kind == "sync"]
    assert len(handed) == len(LAYERS) and synced == handed[: len(LAYERS) - 2], (handed, synced)
    for s in synced:  # each host wait comes before the next layer's copy is issued
        at = next(i for i, (kind, e) in enumerate(fake.log) if e is s and kind == "sync")
        assert any(kind == "record" and e.stream == "copy" for kind, e in fake.log[at + 1:])


@pytest.mark.parametrize("device, scheduler_device", [("cuda:1", 0), ("cuda", 3)])
def test_the_copy_thread_uses_the_schedulers_device(device, scheduler_device):
    """A new thread starts on device 0 (CUDA's rule, kept by the stand-in): the copy
    thread's initializer binds it to the device its stream belongs to -- the one named,
    or the one the constructing (scheduler) thread uses -- so a rank's reloads never
    land on another GPU."""
    fake = StandInStreams()
    fake.set_device(scheduler_device)
    stream = CopyStream(device, module=fake)
    with ThreadPoolExecutor(1) as unbound:
        assert unbound.submit(fake.current_device).result() == 0
    with ThreadPoolExecutor(1, initializer=stream.bind_thread) as pool:
        assert pool.submit(fake.current_device).result() == (1 if device == "cuda:1" else 3)
    CopyStream("cpu").bind_thread()  # no device module: nothing to bind
