"""The host store's rows are views of a few large pinned slabs, pinned when first needed
and reused after a request ends, not one pinned allocation per layer (no server)."""

from __future__ import annotations

import gc

import torch

from sglang_vc.vericache.host_slabs import HostSlabs
from sglang_vc.vericache.reload import HostKVStore

LAYERS = range(32)


def _offload(store: HostKVStore, rid: str, row: int, n: int = 64) -> dict:
    """Request ``rid``'s full KV of every layer sunk and moved to the host; the rows."""
    assert store.admit(rid, row, 0, n, nbytes=n * 2 * 2 * 4 * 4 * len(LAYERS))
    full = {}
    for l in LAYERS:
        full[l] = (torch.randn(n, 2, 4), torch.randn(n, 2, 4))
        store.sink(rid, row, l, 0, *full[l])
    store.flush()
    return full


def _inside(t: torch.Tensor, slabs: HostSlabs) -> bool:
    ptr = t.data_ptr()
    return any(s.buffer.data_ptr() <= ptr < s.buffer.data_ptr() + s.capacity for s in slabs.slabs)


def test_a_request_pins_one_slab_not_a_tensor_per_layer(monkeypatch):
    """64 rows of a request (32 layers, K and V) take one pinned allocation, made when the
    first row is offloaded (none at start-up); the rows are the sunk ones, byte for byte."""
    pinned = []
    empty = torch.empty

    def spy(*args, pin_memory=False, **kw):  # the stand-in has no CUDA: record, do not pin
        if pin_memory:
            pinned.append(args)
        return empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", spy)
    store = HostKVStore(capacity_bytes=64 << 20, pin=True)
    assert pinned == [] and store.slabs.stats()["host_slabs"] == 0
    full = _offload(store, "a", 5)
    assert len(pinned) == 1, pinned  # the slab; it was 64 before
    entry = store.get("a", 5)
    for l in LAYERS:
        assert _inside(entry.k[l], store.slabs) and _inside(entry.v[l], store.slabs)
        assert torch.equal(entry.k[l], full[l][0]) and torch.equal(entry.v[l], full[l][1])
    stats = store.slabs.stats()
    assert stats["host_slabs"] == 1 and stats["host_rows_outside_slabs"] == 0
    assert stats["host_slab_in_use_bytes"] >= 2 * len(LAYERS) * 64 * 2 * 4 * 4


def test_an_ended_requests_blocks_are_reused_by_the_next():
    """A dropped request's rows go back to its slab once its entry is gone (a reload may
    hold it last), and the next request's rows take the same memory: no second slab."""
    store = HostKVStore(capacity_bytes=64 << 20, pin=False)
    _offload(store, "a", 5)
    first = {store.get("a", 5).k[l].data_ptr() for l in LAYERS}
    held = store.get("a", 5)  # as a reload in flight would
    store.drop("a")
    gc.collect()
    in_use = store.slabs.stats()["host_slab_in_use_bytes"]
    assert in_use > 0  # still held
    del held
    gc.collect()
    assert store.slabs.stats()["host_slab_in_use_bytes"] == 0
    _offload(store, "b", 6)
    second = {store.get("b", 6).k[l].data_ptr() for l in LAYERS}
    assert first == second
    assert store.slabs.stats()["host_slabs"] == 1


def test_past_the_bound_rows_are_tensors_of_their_own_and_counted():
    """The slabs never pin more than the store's bound: a row that finds no room is a
    tensor of its own (counted), and still holds the exact rows."""
    slabs = HostSlabs(pin=False, limit_bytes=4096, slab_bytes=4096)
    a = slabs.empty((2, 256), torch.float32, owner=slabs)  # 2048 bytes: in the slab
    b = slabs.empty((2, 256), torch.float32, owner=slabs)  # the slab is full now
    c = slabs.empty((2, 256), torch.float32, owner=slabs)  # no second slab under the bound
    assert _inside(a, slabs) and _inside(b, slabs) and not _inside(c, slabs)
    assert slabs.stats() == {"host_slabs": 1, "host_slab_bytes": 4096, "host_slab_in_use_bytes": 4096,
                             "host_rows_outside_slabs": 1}
    c.copy_(torch.arange(512.0).view(2, 256))
    assert c.sum().item() == sum(range(512))


def test_a_row_larger_than_a_slab_gets_a_slab_of_its_size():
    slabs = HostSlabs(pin=False, slab_bytes=1024)
    t = slabs.empty((4, 1024), torch.float32, owner=slabs)
    assert _inside(t, slabs) and slabs.stats()["host_slab_bytes"] == 4 * 1024 * 4
