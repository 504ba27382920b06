"""A full context on EvicPress's storage tier is HiCache's own pages (#75 item 4): the keys
are SGLang's hash chain, the page bytes are the host pool's ``get_data_page``, the
manager writes no blob of its own for it, and a page gone is a drop, never a wrong row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sglang_vc.evicpress import tenant
from sglang_vc.evicpress.codec import FullKV
from sglang_vc.evicpress.config import FULL, Placement, Tier
from sglang_vc.evicpress.context import KVDims, Settings
from sglang_vc.evicpress.disk_tier import DiskTierStore
from sglang_vc.evicpress.hicache_pages import HiCachePages, for_pool
from sglang_vc.evicpress.host_tier import RamHostStore
from sglang_vc.evicpress.manager import EvicPressManager
from sglang_vc.evicpress.storage_backend import EvicPressFileStorage

from test_evicpress_storage import storage_config

L, H, D = 2, 2, 8
DIMS = KVDims(layers=L, heads=H, head_dim=D, v_heads=H, v_head_dim=D, itemsize=4)


def _backend(path):
    return EvicPressFileStorage(storage_config({"path": str(path), "capacity_gb": 1.0}))


def _kv(n: int, seed: int = 0) -> FullKV:
    g = torch.Generator().manual_seed(seed)
    return FullKV(torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g))


def _host_pages(kv: FullKV, layout: str, page_size: int) -> list[torch.Tensor]:
    """The pages SGLang's MHA host pool hands the backend for ``kv`` (its own
    ``get_data_page`` on a buffer of ``layout`` holding ``kv`` from slot 0)."""
    n = kv.num_tokens
    both = torch.stack([kv.k, kv.v])  # [2, L, N, H, D]
    if layout == "layer_first":
        buf = both.clone()
    elif layout == "page_first":
        buf = both.permute(0, 2, 1, 3, 4).contiguous()
    else:  # page_first_direct: [2, pages, L, page, H, D]
        buf = both.reshape(2, L, n // page_size, page_size, H, D).permute(0, 2, 1, 3, 4, 5).contiguous()
    pool = SimpleNamespace(layout=layout, kv_buffer=buf, page_size=page_size)
    return [MHATokenToKVPoolHost.get_data_page(pool, i).clone() for i in range(0, n, page_size)]


def _zero_copy_pages(kv: FullKV, page_size: int) -> list[torch.Tensor]:
    """The objects SGLang's zero-copy calls write for ``kv`` (``seaweedfs``' ``_put_from``):
    the host buffers ``get_page_buffer_meta`` lists for each page, one after the other,
    from a ``layer_first`` MHA host pool holding ``kv`` from slot 0."""
    import ctypes

    n = kv.num_tokens
    buf = torch.stack([kv.k, kv.v]).contiguous()  # [2, L, N, H, D]
    pool = SimpleNamespace(layout="layer_first", kv_buffer=buf, page_size=page_size, layer_num=L, size=n,
                           head_num=H, head_dim=D, dtype=torch.float32)
    ptrs, sizes = MHATokenToKVPoolHost.get_page_buffer_meta(pool, torch.arange(n))
    per_page = len(ptrs) // (n // page_size)
    pages = []
    for i in range(n // page_size):
        chunk = b"".join(ctypes.string_at(a, z) for a, z in zip(ptrs[i * per_page:(i + 1) * per_page],
                                                                sizes[i * per_page:(i + 1) * per_page]))
        pages.append(torch.frombuffer(bytearray(chunk), dtype=torch.float32))
    return pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_zero_copy_objects_read_as_the_context(tmp_path, page_size):
    """Backends SGLang drives through the zero-copy calls (``seaweedfs``) hold a page as the
    host buffers of each layer's K then V, not ``get_data_page``'s order: read in that format
    (read in the other, the KV came back scrambled and a second server answered wrongly)."""
    ids, kv = list(range(8)), _kv(8)
    backend = _backend(tmp_path)
    pages = HiCachePages(backend, "zero_copy:layer_first", page_size, L, H, D, torch.float32)
    assert backend.batch_set(pages.keys(ids, None), _zero_copy_pages(kv, page_size))
    got = pages.read(ids, None)
    assert torch.equal(got.k, kv.k) and torch.equal(got.v, kv.v)
    other = _backend(tmp_path / "b")
    ok, _ = HiCachePages(other, "zero_copy:layer_first", page_size, L, H, D, torch.float32).write(ids, None, kv)
    assert ok and all(torch.equal(other.get(k), backend.get(k)) for k in pages.keys(ids, None))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_are_hicaches_keys_and_bytes(tmp_path, layout, page_size):
    """What HiCache writes for a prefix (SGLang's keys, the host pool's pages) reads back as
    the context's KV, and what EvicPress writes is byte for byte what HiCache would."""
    ns = tenant.namespace("lora-a", None)
    ids = list(range(100, 110))  # 10 tokens: with page 4, two whole pages and a tail
    kv = _kv(len(ids))
    n = len(ids) // page_size * page_size
    sglang_keys = get_storage_hash_str(RadixKey(ids[:n], extra_key="lora-a"), None, page_size=page_size)

    hicache = _backend(tmp_path / "a")
    pages = HiCachePages(hicache, layout, page_size, L, H, D, torch.float32)
    assert pages.keys(ids, ns) == sglang_keys
    assert not pages.probe(ids, ns) and pages.read(ids, ns) is None
    assert hicache.batch_set(sglang_keys, _host_pages(kv.prefix(n), layout, page_size))  # HiCache's backup
    assert pages.probe(ids, ns)
    got = pages.read(ids, ns)
    assert got.num_tokens == n and torch.equal(got.k, kv.k[:, :n]) and torch.equal(got.v, kv.v[:, :n])
    assert pages.write(ids, ns, kv) == (True, 0)  # all there: nothing written

    own = _backend(tmp_path / "b")  # EvicPress first: the same objects HiCache writes
    mine = HiCachePages(own, layout, page_size, L, H, D, torch.float32)
    ok, nbytes = mine.write(ids, ns, kv)
    assert ok and nbytes == 2 * L * n * H * D * 4
    for key in sglang_keys:
        assert torch.equal(own.get(key), hicache.get(key))
    assert HiCachePages(own, layout, page_size, L, H, D, torch.float32).keys(ids, None) != sglang_keys  # tenants apart


def test_only_missing_pages_are_written_and_a_lost_page_is_a_miss(tmp_path):
    backend = _backend(tmp_path)
    pages = HiCachePages(backend, "layer_first", 2, L, H, D, torch.float32)
    ids, kv = list(range(8)), _kv(8)
    keys = pages.keys(ids, None)
    assert backend.batch_set(keys[:2], _host_pages(kv.prefix(4), "layer_first", 2))
    ok, nbytes = pages.write(ids, None, kv)
    assert ok and nbytes == 2 * L * 4 * H * D * 4  # the two pages HiCache had not written
    assert backend.delete(keys[1])  # evicted by the backend
    assert not pages.probe(ids, None) and pages.read(ids, None) is None


def _manager(tmp_path, full_pages):
    s = Settings(policy="lru", candidates=(), disk_capacity=10**8, host_bandwidth=10e9,
                 disk_bandwidth=1e9, prefill_tokens_per_s=500.0, prefill_measured=False)
    disk = DiskTierStore(tmp_path / "disk", 10**8, fsync=False)
    clock = iter(range(1, 10**6)).__next__
    return EvicPressManager(s, DIMS, RamHostStore(0), disk, full_pages=full_pages, clock=lambda: float(clock()))


def test_the_manager_keeps_a_full_context_on_storage_as_pages_only(tmp_path):
    backend = _backend(tmp_path / "kv")
    mgr = _manager(tmp_path, HiCachePages(backend, "layer_first", 1, L, H, D, torch.float32))
    ctx = mgr.registry.register(list(range(1, 65)), ctx_id="c")
    kv = _kv(64)
    mgr.store_computed(ctx, kv)  # no host room: full on storage
    assert ctx.placement == Placement(FULL, Tier.DISK)
    assert mgr.disk.used_bytes == 0 and len(mgr.disk) == 0  # no EvicPress blob beside the pages
    assert mgr.counters["full_pages_written"] == 1
    assert len(list((tmp_path / "kv").rglob("*"))) >= 64  # the pages, one a token
    got = mgr.requests.fetch(ctx)
    assert got.config == FULL and got.tier == Tier.DISK
    assert torch.equal(got.kv.k, kv.k) and torch.equal(got.kv.v, kv.v)
    assert mgr.counters["full_pages_read"] == 1

    backend.delete(mgr.full_pages.keys(ctx.token_ids, ctx.namespace)[10])  # a page evicted
    assert mgr.requests.fetch(ctx) is None
    assert ctx.placement.dropped and mgr.counters["lost"] == 1 and mgr.counters["full_pages_missing"] == 1


def test_pages_off_for_pools_it_cannot_read_is_said(caplog):
    pool = SimpleNamespace(layout="page_head", head_num=H, head_dim=D, dtype=torch.float32)
    backend = SimpleNamespace(batch_get=lambda *a: None, batch_set=lambda *a: None)
    with caplog.at_level("WARNING"):
        assert for_pool(backend, pool, 1, DIMS, zero_copy=False) is None
        assert for_pool(backend, SimpleNamespace(**{**vars(pool), "layout": "page_first"}), 1, DIMS, zero_copy=True) is None
    assert "stay EvicPress blobs" in caplog.text and "page_head" in caplog.text and "zero_copy:page_first" in caplog.text
    for zero_copy in (False, True):
        assert for_pool(backend, SimpleNamespace(**{**vars(pool), "layout": "layer_first"}), 1, DIMS, zero_copy) is not None


def test_pages_under_a_placement_are_kept_from_the_backends_eviction(tmp_path):
    """``evicpress_file`` evicts its oldest pages for newer ones; the pages of a full context
    EvicPress placed on storage are pinned until it moves the context away."""
    page_bytes = 2 * L * H * D * 4
    backend = EvicPressFileStorage(storage_config({"path": str(tmp_path / "kv"), "capacity_gb": 40 * (page_bytes + 130) / (1 << 30)}))
    mgr = _manager(tmp_path, HiCachePages(backend, "layer_first", 1, L, H, D, torch.float32))
    ctx = mgr.registry.register(list(range(1, 17)), ctx_id="c")
    kv = _kv(16)
    mgr.store_computed(ctx, kv)
    assert ctx.placement == Placement(FULL, Tier.DISK)
    other = HiCachePages(backend, "layer_first", 1, L, H, D, torch.float32)
    for i in range(4):  # HiCache's backups of other prefixes, more than the budget holds
        other.write(list(range(1000 * (i + 1), 1000 * (i + 1) + 16)), None, _kv(16, seed=i + 1))
    assert backend.stats.pages_evicted > 0 and mgr.full_pages.probe(ctx.token_ids, None)
    assert torch.equal(mgr.requests.fetch(ctx).kv.k, kv.k)

    mgr._delete_blob(ctx, ctx.placement)  # moved away: HiCache's cache again, evicted first
    other.write(list(range(9000, 9016)), None, _kv(16, seed=9))
    assert not mgr.full_pages.probe(ctx.token_ids, None)


def test_the_full_storage_copy_is_the_pages_and_the_next_server_reads_them(tmp_path):
    """Storage copies (``--evicpress-storage-copies full,kivi@4b``): the full one is the
    context's pages, written by server A beside its 4-bit blob; server B finds the pages
    first (``find_shared``) and loads A's exact KV from them; no EvicPress blob of the
    full KV exists."""
    from sglang_vc.evicpress.config import CompressionConfig
    from sglang_vc.evicpress.storage_tier import StorageTier

    kivi4 = CompressionConfig("kivi", bits=4)
    ids, kv = list(range(7, 71)), _kv(64)

    def server():
        backend = _backend(tmp_path / "kv")
        s = Settings(policy="lru", candidates=(kivi4,), storage_copies=(FULL, kivi4), model_id="m",
                     disk_capacity=10**8, prefill_measured=False)
        disk = StorageTier(backend, 10**8, namespace="model-a")
        pages = HiCachePages(backend, "layer_first", 1, L, H, D, torch.float32)
        return EvicPressManager(s, DIMS, RamHostStore(10**8), disk, full_pages=pages)

    a = server()
    ctx = a.registry.register(ids, ctx_id="doc")
    a.store_computed(ctx, kv)
    assert ctx.placement.tier == Tier.HOST and ctx.shared == {FULL, kivi4}
    assert a.counters["storage_copies_written"] == 2 and a.full_pages.probe(ids, None)
    assert not a.disk.probe(a.blob_key(ctx, Tier.DISK, FULL)) and a.disk.probe(a.blob_key(ctx, Tier.DISK, kivi4))
    assert a.registry.forget("doc")

    b = server()
    other = b.registry.register(ids, ctx_id="same-tokens")
    assert b.storage_copies.find_shared(other) and other.placement == Placement(FULL, Tier.DISK)
    got = b.requests.fetch(other)
    assert torch.equal(got.kv.k, kv.k) and torch.equal(got.kv.v, kv.v)
    read = b.storage_copies.read_storage_copy(other, FULL)  # VeriCache's remote prefix path
    assert torch.equal(read.k, kv.k) and b.counters["storage_copies_read"] == 1
