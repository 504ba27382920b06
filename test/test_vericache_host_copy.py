"""The prefill's copies of the full KV to the host store go through pool slots leased
per request (``vericache.host_copy``, inside SGLang's pool): the gathered device rows are
free once a layer is done with them, and the lease goes back to SGLang's allocator once
the request's last copy has landed (no server; stand-in streams and events record what a
GPU would order)."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_vc.kvruntime import CopyStream, pool_lease
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache.reload import HostKVStore
from sglang_vc.vericache.staging_leases import StagingLeases

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


def _store(fake, cap: int = 256, kept=None, n=64, p=0, send=True):
    kv = MHATokenToKVPool(256, 1, torch.float32, 2, 4, len(LAYERS), "cpu", False, enable_alt_stream=False)
    alloc = TokenToKVPoolAllocator(256, torch.float32, "cpu", kv, need_sort=True)
    stream = CopyStream("cpu", module=fake)
    kept_alive = []
    stream.keep_alive = lambda t, s: kept_alive.append(t)
    store = HostKVStore(copy_stream=stream, pin=False)
    staging = StagingLeases(lambda rows: pool_lease.take(alloc, kv, rows), lambda lease: pool_lease.give_back(alloc, lease),
                            cap, stream.fences)
    store.use_staging(staging)
    assert store.admit("a", 5, p, n, nbytes=100)
    torch.manual_seed(0)
    full = {l: (torch.randn(n, 2, 4), torch.randn(n, 2, 4)) for l in LAYERS}
    if send:
        for l, (k, v) in full.items():
            store.sink("a", 5, l, p, k, v)
            store.kept("a", 5, l, kept)  # None: a quantizer, the whole layer goes now
    return store, staging, alloc, full, kept_alive


def test_the_prefills_rows_reach_the_host_through_leased_pool_rows_bytes_equal():
    fake = StandInStreams()
    store, staging, alloc, full, kept_alive = _store(fake)
    assert staging.in_use == 64 and alloc.available_size() == 256 - 64  # a slot per row, while copying
    store.flush()  # the prefill forward ended: the lease goes back once its copies landed
    assert staging.in_use == 0 and alloc.available_size() == 256
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())
    out = store.copy_out
    assert out.outside == 0 and not kept_alive, "no copy read (and kept alive) the gathered device rows"
    # each layer: an event of the compute stream's write into the lease, then the copy
    copies = [e for kind, e in fake.log if kind == "record" and e.stream == "copy"]
    waits = [e for kind, e in fake.log if kind == "copy-wait"]
    assert len(copies) == len(waits) == len(LAYERS) and all(w.stream == "compute" for w in waits)
    assert entry.event is copies[-1]


def test_the_lease_goes_back_only_once_the_last_copy_landed():
    """With a link that has copied nothing yet, the lease stays out of SGLang's free list
    after the prefill; the next lease that needs its room waits for the copy."""
    fake = _LaggingStreams()
    store, staging, alloc, full, _ = _store(fake, cap=100)
    store.flush()
    assert staging.in_use == 64 and alloc.available_size() == 256 - 64
    assert staging.take(64) is not None  # over the cap of 100: waits for the copy, then leases
    assert [kind for kind, _ in fake.log].count("sync") == 1 and staging.in_use == 64
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())


def test_a_token_droppers_rows_and_positions_go_through_the_lease_too():
    fake = StandInStreams()
    kept = torch.stack([torch.arange(0, 64, 4), torch.arange(1, 64, 4)])  # 16 kept rows per head
    store, staging, _, full, kept_alive = _store(fake, kept=kept)
    # K side: the 48 dropped rows, then the kept and dropped positions (int64), in 32-byte rows
    assert staging.in_use == (48 * 32 + 2 * 16 * 8 + 2 * 48 * 8) // 32
    store.flush()
    entry = store.get("a", 5)
    for l, (k, _) in full.items():
        keep = set(kept[0].tolist())
        assert torch.equal(entry.k[l][:, 0], k[[i for i in range(64) if i not in keep], 0])
    assert store.copy_out.outside == 0 and not kept_alive


def test_without_room_a_layer_copies_from_its_own_tensor_and_is_counted():
    """Reloads hold the whole cap: each layer then copies from tensors of its own, as
    before (kept alive until its copy lands), counted, and still lands whole."""
    fake = StandInStreams()
    store, staging, alloc, full, kept_alive = _store(fake, cap=32)  # under the request's 64 rows
    out = store.copy_out
    assert out.outside == len(LAYERS) and len(kept_alive) == 2 * len(LAYERS) and staging.in_use == 0
    store.flush()
    entry = store.get("a", 5)
    assert all(torch.equal(entry.k[l], k) and torch.equal(entry.v[l], v) for l, (k, v) in full.items())
    assert alloc.available_size() == 256


def test_on_the_cpu_the_store_copies_directly():
    store = HostKVStore(pin=False)
    store.use_staging(StagingLeases(lambda rows: None, lambda lease: None, 64))
    assert store.copy_out is None  # no stream: a copy is done when it returns
