"""EvicPress in the runtime: codec, host slots, manager moves and policies (fast, no
server), flag validation (the launcher exits 2), and a real server with
``--radix-cache-backend evicpress`` (bytes survive device -> host -> disk -> device,
corrupted / truncated disk entries are recomputed, a full disk, hits from every tier,
re-profiling on drift)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from sglang_vc.evicpress import codec
from sglang_vc.evicpress.codec import FullKV
from sglang_vc.evicpress.config import DROPPED, FULL, CompressionConfig, Placement, Tier
from sglang_vc.evicpress.disk_tier import DiskTierStore
from sglang_vc.evicpress.host_tier import HostSlotStore, RamHostStore
from sglang_vc.evicpress.context import KVDims, Settings
from sglang_vc.evicpress.manager import EvicPressManager
from sglang_vc.evicpress.request_plan import ContextPlan, Origin

KIVI4 = CompressionConfig("kivi", bits=4)
KIVI2 = CompressionConfig("kivi", bits=2)
DIMS = KVDims(layers=2, heads=2, head_dim=32, v_heads=2, v_head_dim=32, itemsize=4)


ADMIN_KEY = "evicpress-admin-key-for-tests"

def _kv(n: int, seed: int = 0) -> FullKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(DIMS.layers, n, DIMS.heads, DIMS.head_dim, generator=g)
    v = torch.randn(DIMS.layers, n, DIMS.v_heads, DIMS.v_head_dim, generator=g)
    return FullKV(k, v)


# ---------------------------------------------------------------------------- codec


@pytest.mark.parametrize("cfg", [FULL, KIVI4, KIVI2, CompressionConfig("kivi1", bits=1)])
def test_codec_roundtrip_and_size_estimate(cfg):
    kv = _kv(100)
    blob = codec.encode(kv, cfg)
    got_cfg, out, pos = codec.decode(blob)
    assert got_cfg == cfg and pos is None
    assert out.k.shape == kv.k.shape and out.v.shape == kv.v.shape
    if cfg.is_full:
        assert torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)
    else:
        err = (out.k - kv.k).abs().mean() / kv.k.abs().mean()
        assert 0 < err < {4: 0.15, 2: 0.6, 1: 1.0}[cfg.bits]
        assert len(blob) < 0.45 * kv.nbytes
    est = codec.estimate_bytes(kv.nbytes, 100, cfg, 4)
    assert abs(est - len(blob)) < 2048
    assert codec.blob_config(blob) == cfg


def test_codec_kivi_is_per_layer():
    """Merging layers into heads must equal compressing each layer on its own."""
    from sglang_vc.compress.registry import get_compressor

    kv = _kv(64, seed=3)
    _, out, _ = codec.decode(codec.encode(kv, KIVI2))
    comp = get_compressor("kivi", residual_length=0)
    for layer in range(DIMS.layers):
        res = comp.compress(layer, kv.k[layer], kv.v[layer], 2)
        k, v, _ = comp.decompress(res)
        assert torch.equal(k, out.k[layer]) and torch.equal(v, out.v[layer])


KNORM5 = CompressionConfig("knorm", ratio=0.5)


@pytest.mark.parametrize("method", ["knorm", "keydiff"])
def test_codec_token_dropped_keeps_rows_per_layer_and_head(method):
    """A token-dropped blob holds each (layer, head)'s kept rows bit-exact, chosen as
    the method chooses them layer by layer, and is about ``ratio`` of the full size."""
    from sglang_vc.compress.registry import get_compressor

    kv, cfg = _kv(100, seed=5), CompressionConfig(method, ratio=0.5)
    blob = codec.encode(kv, cfg)
    got, rows, pos = codec.decode(blob)
    assert got == cfg and rows.k.shape == (DIMS.layers, 50, DIMS.heads, DIMS.head_dim)
    assert pos.shape == (DIMS.layers, DIMS.heads, 50)
    comp = get_compressor(method)
    for layer in range(DIMS.layers):
        res = comp.compress(layer, kv.k[layer], kv.v[layer], 0.5)
        assert torch.equal(pos[layer], res.kept_positions)
        for h in range(DIMS.heads):
            assert torch.equal(rows.k[layer, :, h], kv.k[layer, pos[layer, h], h])
            assert torch.equal(rows.v[layer, :, h], kv.v[layer, pos[layer, h], h])
    assert 0.5 * kv.nbytes < len(blob) < 0.56 * kv.nbytes
    assert abs(codec.estimate_bytes(kv.nbytes, 100, cfg, 4) - len(blob)) < 2048


def test_codec_token_dropped_transcode_and_ratio_one():
    kv = _kv(100, seed=6)
    six = codec.encode(kv, CompressionConfig("knorm", ratio=0.6))
    three = codec.transcode(six, CompressionConfig("knorm", ratio=0.3))
    direct = codec.decode(codec.encode(kv, CompressionConfig("knorm", ratio=0.3)))
    got = codec.decode(three)
    assert got[0] == direct[0] and torch.equal(got[2], direct[2])  # knorm ranks rows: nested
    assert torch.equal(got[1].k, direct[1].k) and torch.equal(got[1].v, direct[1].v)
    for dst in (KIVI2, FULL, CompressionConfig("keydiff", ratio=0.3), CompressionConfig("knorm", ratio=0.9)):
        with pytest.raises(ValueError):
            codec.transcode(six, dst)
    # quantized and full blobs still transcode by decoding
    assert codec.blob_config(codec.transcode(codec.encode(kv, FULL), KNORM5)) == KNORM5
    # ratio 1 keeps every row in order: the full KV
    _, rows, pos = codec.decode(codec.encode(kv, CompressionConfig("knorm", ratio=1.0)))
    assert torch.equal(rows.k, kv.k) and torch.equal(rows.v, kv.v)
    assert torch.equal(pos[0, 0], torch.arange(100))


# ---------------------------------------------------------------------------- host slots


class _FakeHostPool:
    """SGLang's host pool API, as HostSlotStore uses it."""

    def __init__(self, size: int, layout: str = "layer_first"):
        self.layout, self.page_size, self.size = layout, 1, size
        dims = (2, DIMS.layers, size, DIMS.heads, DIMS.head_dim)
        if layout == "page_first":
            dims = (2, size, DIMS.layers, DIMS.heads, DIMS.head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=torch.float32)
        self.free_slots = list(range(size))

    def get_size_per_token(self):
        return 2 * DIMS.layers * DIMS.heads * DIMS.head_dim * 4

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.free_slots.extend(int(i) for i in idx)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_slots_roundtrip_bytes(layout):
    pool = _FakeHostPool(64, layout)
    store = HostSlotStore(pool)
    blobs = {f"b{i}": os.urandom(n) for i, n in enumerate([1, 1000, 1024, 5000, 1023 * 3])}
    # NaN bit patterns and every byte value must survive the float buffer
    blobs["nan"] = np.full(300, 0x7FC00001, dtype=np.uint32).tobytes()
    for k, b in blobs.items():
        assert store.put(k, b)
    for k, b in blobs.items():
        assert store.get(k) == b
    used = store.used_bytes
    assert used == sum(store.footprint(len(b)) for b in blobs.values())
    assert store.delete("b3") and store.get("b3") is None
    assert store.used_bytes == used - store.footprint(5000)
    assert not store.put("huge", b"x" * store.capacity_bytes)  # does not fit
    assert store.get("b1") == blobs["b1"]


class _FakeHostTree:
    """The radix cache's side of HostTierStore: node backups of contexts on the device."""

    def __init__(self, pool, on_device: dict):
        self.pool, self.on_device = pool, on_device  # ctx -> FullKV it holds on the device
        self.backups: dict = {}  # ctx -> host slots (locked or released)
        self.locked: set = set()
        self.lost: set = set()  # backups SGLang no longer has all of

    def back_up_full(self, ctx):
        kv = self.on_device.get(ctx)
        idx = None if kv is None else self.pool.alloc(kv.num_tokens)
        if idx is None:
            return None
        self.backups[ctx] = idx
        self.locked.add(ctx)
        return ctx

    def read_backed(self, ctx):
        return None if ctx in self.lost else self.on_device[ctx]

    def release_backed(self, ctx):
        self.locked.discard(ctx)

    def free_host(self, n):  # SGLang's host LRU: only released backups go
        freed = 0
        for ctx in [c for c in self.backups if c not in self.locked]:
            idx = self.backups.pop(ctx)
            self.pool.free(idx)
            freed += len(idx)
        return freed


def test_host_tier_keeps_full_copies_as_node_backups_and_the_rest_as_blobs():
    from sglang_vc.evicpress.host_tier import HostTierStore

    pool = _FakeHostPool(300)
    kv_a, kv_b = _kv(100, seed=1), _kv(100, seed=2)
    tree = _FakeHostTree(pool, {"a": kv_a, "b": kv_b})
    store = HostTierStore(HostSlotStore(pool), tree, context_of=lambda key: key)
    full_a = codec.encode(kv_a, FULL)
    assert store.put("a", full_a) and store.is_backed("a") and "a" in tree.locked
    assert store.get("a") == full_a  # read back from the backup, bit-exact
    assert store.used_bytes == 100 * store.slot_bytes
    # a backup SGLang lost is reported missing, never served
    assert store.put("b", codec.encode(kv_b, FULL)) and store.is_backed("b")
    tree.lost.add("b")
    assert store.get("b") is None
    assert store.delete("b") and "b" not in tree.locked
    # a compressed copy, and a full one not on the device, are blobs in pool slots
    kivi_b = codec.encode(kv_b, KIVI2)
    assert store.put("b2", kivi_b) and not store.is_backed("b2") and store.get("b2") == kivi_b
    full_c = codec.encode(_kv(20, seed=3), FULL)
    assert store.put("c", full_c) and not store.is_backed("c") and store.get("c") == full_c
    # released: the backup stays in the pool until a blob needs its slots
    assert store.delete("a") and "a" not in tree.locked and "a" in tree.backups
    assert store.used_bytes == store.slots.used_bytes
    free_before = len(pool.free_slots)
    big = codec.encode(_kv(free_before + 20, seed=4), FULL)  # more slots than the pool has free
    assert store.put("big", big) and "a" not in tree.backups and store.get("big") == big


# ---------------------------------------------------------------------------- manager


def _manager(tmp_path, host_bytes, disk_bytes, policy="evicpress", fixed=FULL, **kw):
    kw.setdefault("disk_bandwidth", 1e6)  # a 200 KB test context takes 0.2 s from disk
    s = Settings(policy=policy, fixed_config=fixed, candidates=(KIVI2, KIVI4), disk_capacity=disk_bytes,
                 host_bandwidth=10e9, prefill_tokens_per_s=500.0, prefill_measured=False, **kw)
    host = RamHostStore(host_bytes)
    disk = DiskTierStore(tmp_path / "disk", disk_bytes, fsync=False)
    clock = iter(range(1, 10**6)).__next__
    return EvicPressManager(s, DIMS, host, disk, clock=lambda: float(clock()))


def _ctx(mgr, i, n=200, quality=None):
    ctx = mgr.registry.register(list(range(1000 * i + 1, 1000 * i + 1 + n)), ctx_id=f"c{i}")
    if quality:
        mgr.profiling.set_profile(ctx.ctx_id, quality)
    return ctx


def test_a_quantized_config_as_good_as_full_never_enters_the_device(tmp_path):
    """A profile where KIVI answers exactly like the full KV (quality 1.0, common on short
    answers) once made the admission pick KIVI for the device tier, whose store refuses
    it: the context was then never stored. The device tier admits the full form."""
    from sglang_vc.evicpress.placement import admit

    mgr = _manager(tmp_path, 10**7, 10**7)
    ctx = _ctx(mgr, 1, quality={"kivi@2b": 1.0, "kivi@4b": 1.0})
    info = mgr.info(ctx)
    assert info.bytes_at(Placement(KIVI4, Tier.DEVICE)) >= info.bytes_at(Placement(FULL, Tier.DEVICE))
    assert admit(info, [Tier.DEVICE, Tier.HOST, Tier.DISK]) == Placement(FULL, Tier.DEVICE)
    assert admit(info, [Tier.HOST, Tier.DISK]).config == KIVI2  # smallest of the equals off the device


def test_manager_store_fetch_demote_bytes_equal(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=int(2.5 * full), disk_bytes=10 * full, policy="lru")
    kvs = {i: _kv(200, seed=i) for i in range(4)}
    ctxs = [_ctx(mgr, i) for i in range(4)]
    for i, c in enumerate(ctxs):
        mgr.store_computed(c, kvs[i])
    # two fit on the host; the LRU ones were demoted to disk
    tiers = [c.placement.tier for c in ctxs]
    assert tiers == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST]
    for i, c in enumerate(ctxs):
        got = mgr.requests.fetch(c)
        assert got.config == FULL and got.tier == tiers[i]
        assert torch.equal(got.kv.k, kvs[i].k) and torch.equal(got.kv.v, kvs[i].v)
    # a disk hit promotes (LRU) and demotes the least recently used host context
    mgr.requests.on_request(ctxs[0], Tier.DISK, FULL)
    mgr.after_hit(ctxs[0], Tier.DISK)
    assert ctxs[0].placement.tier == Tier.HOST
    assert mgr.counters["promotions"] == 1 and mgr.counters["demotions"] >= 3
    got = mgr.requests.fetch(ctxs[0])
    assert torch.equal(got.kv.k, kvs[0].k)


class _Rows:
    """``ContextRows`` over no tree: the exact rows the device holds and whether a copy
    fits on the device are the test's."""

    def __init__(self, exact=0, fits=True):
        self.rows, self.fits, self.loaded = exact, fits, []

    def floor(self, n):
        return n

    def exact(self, n):
        return min(self.rows, n)

    def serve_lossy(self, ctx, cfg, n):
        return False

    def backed_up(self, n):
        return False

    def load(self, ctx, fetched, usable, have):
        self.loaded.append((fetched.config, usable, have))
        return self.fits


def test_the_manager_plans_a_request_in_one_call_per_match(tmp_path):
    """``plan_match`` is all the radix cache asks on a match: exact device rows are a
    device hit (to store when the context is not stored yet); a stored copy is fetched
    and loaded, a hit of its tier to promote after; a copy the device cannot take is a
    miss stored once computed; a waiting request matched again loads again, from the copy
    it read (not from the tier again), but is not accounted twice."""
    mgr = _manager(tmp_path, host_bytes=10**3, disk_bytes=10**8, policy="lru")  # host: no room
    ctx = _ctx(mgr, 0)
    ids = list(range(1, 220))  # the context's 200 tokens, then the question

    def plan(rid, rows, earlier=None):
        p = earlier or ContextPlan()
        mgr.requests.plan_match(rid, ids, None, ids, rows, p)
        return p

    hit = plan("device", _Rows(exact=200))
    assert (hit.origin, hit.served, hit.usable, hit.lcp) == (Origin.DEVICE, FULL, 200, 200)
    assert hit.store_device_rows and hit.promote is None and hit.capture_len == 0
    mgr.store_computed(ctx, _kv(200, 1))
    assert ctx.placement == Placement(FULL, Tier.DISK)

    rows = _Rows()
    loaded = plan("stored", rows)
    assert (loaded.origin, loaded.served, loaded.backed_hit) == (Origin.DISK, FULL, False)
    assert rows.loaded == [(FULL, 200, 0)] and ctx.device_config == FULL
    assert not loaded.store_device_rows and callable(loaded.promote)

    ctx.device_config = None
    rows = _Rows(fits=False)
    miss = plan("no-room", rows)
    assert (miss.origin, miss.served, miss.capture_len, miss.promote) == (Origin.MISS, None, 200, None)
    assert ctx.device_config is None
    counted = (mgr.counters, ctx.frequency)
    assert counted[0]["hits_device"] == counted[0]["hits_disk"] == counted[0]["misses"] == 1
    read = mgr.counters["bytes_loaded_disk"]
    again = plan("no-room", _Rows(), earlier=miss)  # waiting, matched again: loaded now
    assert again is miss and miss.origin is Origin.MISS and ctx.device_config == FULL
    assert mgr.counters["bytes_loaded_disk"] == read  # from the copy it read, not the tier again
    assert (mgr.counters["misses"], mgr.counters["hits_disk"], ctx.frequency) == (1, 1, counted[1])
    assert set(mgr.profiling.active_requests) == {"device", "stored", "no-room"}
    other = ContextPlan()
    short = list(range(5000, 5100))  # no context, too short for an automatic one
    mgr.requests.plan_match("other", short, None, short, _Rows(), other)
    assert (other.origin, other.ctx) == (Origin.NONE, None) and mgr.counters["misses"] == 1


def test_a_request_aborted_while_waiting_leaves_no_plan(tmp_path, monkeypatch):
    """SGLang ends a request aborted in the waiting queue with ``finish(ABORT)``, never
    ``on_release``: the cache forgets its plan, its lossy prefix and its activity (which
    keeps the profiler from seeing the server idle). An aborted chunked prefill also gets
    ``finish(ABORT)`` but holds a row: its state stays for the ``on_release`` that
    follows (which frees a token-dropped prefix's index entry with the row)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, CacheRequestOutcome
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sglang_vc.evicpress import radix

    # SGLang's own bookkeeping needs a whole cache; only ours is under test
    monkeypatch.setattr(UnifiedRadixCache, "release_aborted_request", lambda self, request: None)
    monkeypatch.setattr(UnifiedRadixCache, "maybe_hand_to_session", lambda self, req: None)
    mgr = _manager(tmp_path, host_bytes=10**7, disk_bytes=10**8)
    ctx = _ctx(mgr, 0)
    ids = list(range(1, 220))
    cache = radix.EvicPressRadixCache.__new__(radix.EvicPressRadixCache)
    cache.evicpress, cache._reqs, cache._private, cache._holding_rows = mgr, {}, {}, set()
    rids = ("waiting", "prefilling", "done")
    for rid in rids:
        assert mgr.registry.match(ids) == (ctx, 200)
        mgr.profiling.note_activity(rid, True)  # as the request's first match does
        cache._reqs[rid] = ContextPlan(Origin.HOST, ctx, 200, 200, KIVI4)
        cache._private[rid] = radix._PrivatePrefix("lossy:c0", 200, 200, KIVI4, ctx.ctx_id)
    cache.maybe_hand_to_session(SimpleNamespace(rid="prefilling", kv=SimpleNamespace(req_pool_idx=3)))
    assert set(mgr.profiling.active_requests) == set(rids)
    for rid in ("waiting", "prefilling"):
        cache.finish(CacheRequestHandle(rid=rid, attempt_id=0), CacheRequestOutcome.ABORT)
    cache.finish(CacheRequestHandle(rid="done", attempt_id=0), CacheRequestOutcome.SUCCESS)
    # the waiting one is forgotten; the one holding a row and the success wait for on_release
    assert set(cache._reqs) == set(cache._private) == set(mgr.profiling.active_requests) == {"prefilling", "done"}


def test_manager_corrupted_and_truncated_disk_entries_are_dropped(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=full // 2, disk_bytes=10 * full, policy="lru")
    a, b = _ctx(mgr, 1), _ctx(mgr, 2)
    mgr.store_computed(a, _kv(200, 1))
    mgr.store_computed(b, _kv(200, 2))
    assert a.placement.tier == b.placement.tier == Tier.DISK  # the host holds none
    files = sorted((tmp_path / "disk").glob("*.kv"))
    pa = tmp_path / "disk" / DiskTierStore.file_name(mgr.blob_key(a, Tier.DISK))
    pb = tmp_path / "disk" / DiskTierStore.file_name(mgr.blob_key(b, Tier.DISK))
    assert set(files) == {pa, pb}
    data = bytearray(pa.read_bytes())
    data[len(data) // 2] ^= 0x01
    pa.write_bytes(bytes(data))
    pb.write_bytes(pb.read_bytes()[:-10])
    assert mgr.requests.fetch(a) is None and mgr.requests.fetch(b) is None
    assert a.placement == DROPPED and b.placement == DROPPED
    assert mgr.counters["disk_corrupted"] == 2
    assert not pa.exists() and not pb.exists()


def test_manager_full_disk_drops(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=full + 4096, disk_bytes=full // 3, policy="lru")
    a, b = _ctx(mgr, 1), _ctx(mgr, 2)
    mgr.store_computed(a, _kv(200, 1))
    mgr.store_computed(b, _kv(200, 2))
    assert b.placement.tier == Tier.HOST and a.placement == DROPPED
    assert mgr.disk.used_bytes == 0
    # the disk is smaller than any context: a planned demotion that fails drops
    assert mgr.set_placement(b, Placement(FULL, Tier.DISK)) is False or b.placement == DROPPED
    assert b.placement == DROPPED and mgr.counters.get("disk_full", 0) >= 1


def test_evicpress_compresses_insensitive_context_instead_of_demoting(tmp_path):
    """Paper fig. 2: the insensitive context is compressed to stay on the fast tier,
    the sensitive one keeps full KV."""
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=int(1.4 * full), disk_bytes=10 * full, alpha=1.0)
    robust = _ctx(mgr, 1, quality={"kivi@4b": 0.99, "kivi@2b": 0.97})
    fragile = _ctx(mgr, 2, quality={"kivi@4b": 0.5, "kivi@2b": 0.2})
    for c in (robust, fragile):
        c.frequency = 5
    mgr.store_computed(robust, _kv(200, 1))
    mgr.store_computed(fragile, _kv(200, 2))
    assert fragile.placement == Placement(FULL, Tier.HOST)
    assert robust.placement.tier == Tier.HOST and not robust.placement.config.is_full
    assert mgr.counters["compressions"] == 1
    got = mgr.requests.fetch(robust)
    assert got.config == robust.placement.config and got.kv.k.shape == (2, 200, 2, 32)


def test_fixed_policy_stores_compressed(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=full, disk_bytes=10 * full, policy="fixed", fixed=KIVI4)
    ctxs = [_ctx(mgr, i) for i in range(5)]
    for i, c in enumerate(ctxs):
        mgr.store_computed(c, _kv(200, i))
    assert all(c.placement.config == KIVI4 for c in ctxs)
    on_host = [c for c in ctxs if c.placement.tier == Tier.HOST]
    assert len(on_host) >= 3  # a 4-bit context takes about a fifth of the space
    assert mgr.host.used_bytes <= full


def test_reprofile_fires_when_quality_drifts(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=int(0.5 * full), disk_bytes=10 * full, reprofile_threshold=0.3)
    ctx = _ctx(mgr, 1, quality={"kivi@4b": 0.95, "kivi@2b": 0.9})
    ctx.profile_reason = None
    mgr.store_computed(ctx, _kv(200, 1))
    assert not ctx.placement.config.is_full  # a full copy would not fit the host
    cfg = ctx.placement.config.label
    mgr.requests.on_request(ctx, Tier.HOST, ctx.placement.config, suffix=[5, 6, 7], prefix_len=200)
    fired = [mgr.profiling.record_observation("c1", cfg, q) for q in (0.9, 0.92, 0.91)]
    assert not any(fired) and ctx.profile_reason is None
    fired = [mgr.profiling.record_observation("c1", cfg, 0.2) for _ in range(6)]
    assert any(fired) and ctx.profile_reason == "drift"
    jobs = mgr.profiling.profile_work()
    assert jobs and jobs[0]["reason"] == "drift"
    assert jobs[0]["prompts"][0][-3:] == [5, 6, 7]  # re-profiled on the online query
    # the new profile says this config is bad now: the lossy copy is dropped (it will
    # be recomputed in full and stored again with the new profile)
    mgr.profiling.set_profile("c1", {"kivi@4b": 0.1, "kivi@2b": 0.05}, reason="drift")
    assert mgr.counters["reprofilings"] == 1
    mgr.run_pending()
    assert ctx.placement == DROPPED


def test_reconfigure_empties_tiers_keeps_profiles(tmp_path):
    full = DIMS.bytes_per_token * 200
    mgr = _manager(tmp_path, host_bytes=full + 4096, disk_bytes=10 * full, policy="lru")
    ctxs = [_ctx(mgr, i, quality={"kivi@4b": 0.9}) for i in range(3)]
    for i, c in enumerate(ctxs):
        mgr.store_computed(c, _kv(200, i))
    assert mgr.host.used_bytes > 0 and mgr.disk.used_bytes > 0
    out = mgr.reconfigure(policy="fixed", fixed_config="kivi@4b")
    assert out["policy"] == "fixed:kivi@4b"
    assert mgr.host.used_bytes == 0 and mgr.disk.used_bytes == 0
    assert all(c.placement == DROPPED and c.frequency == 0 and c.quality[KIVI4] == 0.9 for c in ctxs)
    with pytest.raises(ValueError):
        mgr.reconfigure(policy="nosuch")
    assert mgr.policy.name == "fixed:kivi@4b"
    mgr.store_computed(ctxs[0], _kv(200, 0))
    assert ctxs[0].placement == Placement(KIVI4, Tier.HOST)
    out = mgr.reconfigure(observe_rate=0.5, reprofile_threshold=0.05)  # the drift check's knobs
    assert (out["observe_rate"], out["reprofile_threshold"]) == (0.5, 0.05)
    assert mgr.tracker.threshold == 0.05
    with pytest.raises(ValueError):
        mgr.reconfigure(observe_rate=2)
    assert mgr.settings.observe_rate == 0.5


def test_auto_contexts_are_recycled_at_the_limit(tmp_path):
    mgr = _manager(tmp_path, host_bytes=1 << 30, disk_bytes=1 << 30, max_contexts=3)
    mgr.registry.register(list(range(1, 40)), ctx_id="api")
    a1 = mgr.registry.register(list(range(100, 140)), source="auto")
    a2 = mgr.registry.register(list(range(200, 240)), source="auto")
    a3 = mgr.registry.register(list(range(300, 340)), source="auto")  # forgets a1 (least recent)
    assert set(mgr.contexts) == {"api", a2.ctx_id, a3.ctx_id} and a1.ctx_id not in mgr.contexts
    with pytest.raises(ValueError):
        mgr.registry.register(list(range(400, 440)))  # an API context is refused instead
    assert mgr.registry.match(list(range(200, 260)))[0] is a2
    assert mgr.registry.match(list(range(100, 140))) is None
    assert mgr.registry.match(list(range(1, 30)))[1] == 29  # the longest prefix, >= half of it


def test_profiler_job_scores_variants_against_reference():
    """The profiler answers each prompt with full KV (reference) and under each config,
    scores the agreement, skips a config whose compressed context was not loaded, and
    posts the profile."""
    from sglang_vc.evicpress.context import ref_namespace, variant_label
    from sglang_vc.evicpress.service import ProfilerService

    posted = []

    class Client:
        def call(self, method, path, body=None, params=None):
            posted.append((method, path, body))
            return {}

    ctx = list(range(100, 300))
    answers = {"ref": "the cat sat", "kivi@4b": "the cat sat", "kivi@2b": "a dog ran"}

    class Prof(ProfilerService):
        def _gen(self, ids, ns, max_new_tokens, **kw):
            assert ns.endswith("/c")  # each context's reference and variants in namespaces of its own
            label = "ref" if ns == ref_namespace("c") else variant_label(ns)
            cached = len(ctx) if label != "kivi1@1b" else 3  # 1-bit failed to load
            return {"text": answers.get(label, "x"), "meta_info": {"cached_tokens": cached}}

    prof = Prof(Client(), "http://unused", tok=None, idle_seconds=0,
                scorer=lambda a, b: 1.0 if a == b else 0.25)
    job = {"ctx_id": "c", "reason": "new", "token_ids": ctx, "prompts": [ctx + [1, 2], ctx + [3]],
           "candidates": ["kivi@2b", "kivi@4b", "kivi1@1b"], "generate_queries": 0, "max_new_tokens": 4}
    q = prof.profile(job)
    assert q == {"kivi@2b": 0.25, "kivi@4b": 1.0}
    assert posted[-1] == ("POST", "/work/profile", {"ctx_id": "c", "quality": q, "reason": "new"})


def test_profiler_writes_questions_for_contexts_without_queries():
    from sglang_vc.evicpress.service import ProfilerService

    posted = []

    class Client:
        def call(self, method, path, body=None, params=None):
            posted.append((method, path, body))
            return {}

    class Tok:
        def encode(self, text, special=True):
            return [ord(c) % 50 for c in text]

    ctx = list(range(100, 300))
    questions = {0.7: "What is X?\nmore", 0.8: "What is X?", 0.9: "Who wrote it?"}

    class Prof(ProfilerService):
        def _gen(self, ids, ns, max_new_tokens, **kw):
            if kw.get("stop"):  # question writing
                return {"text": " " + questions[round(kw["temperature"], 1)], "meta_info": {}}
            return {"text": "same", "meta_info": {"cached_tokens": len(ctx)}}

    prof = Prof(Client(), "http://unused", tok=Tok(), idle_seconds=0, scorer=lambda a, b: 1.0)
    job = {"ctx_id": "c", "reason": "new", "token_ids": ctx, "prompts": [], "candidates": ["kivi@4b"],
           "generate_queries": 3, "profile_source": "model", "max_new_tokens": 4}
    assert prof.profile(job) == {"kivi@4b": 1.0}
    queries = [b for m, p, b in posted if p == "/contexts/c/queries"][0]
    assert queries["texts"] == ["What is X?", "Who wrote it?"]  # first line, deduplicated
    assert len(queries["suffixes"]) == 2


# ---------------------------------------------------------------------------- flags


LAUNCH = [sys.executable, "-m", "sglang_vc.launch_server"]
BAD_FLAGS = [
    (["--evicpress-alpha", "-1"], "alpha"),
    (["--evicpress-methods", "nosuch"], "unknown method"),
    (["--evicpress-methods", "snapkv"], "queries"),
    (["--evicpress-policy", "fixed", "--evicpress-fixed-config", "h2o@0.5"], "queries"),
    (["--evicpress-bits", "3"], "bits"),
    (["--evicpress-ratios", "0,2"], "ratios"),
    (["--evicpress-policy", "fixed"], "fixed-config"),
    (["--evicpress-fixed-config", "kivi@4b"], "policy fixed"),
    (["--evicpress-policy", "fixed", "--evicpress-fixed-config", "kivi@3x"], "fixed-config"),
    (["--evicpress-observe-rate", "1.5"], "observe-rate"),
    (["--evicpress-disk-size-gb", "0"], "disk-size"),
    (["--evicpress-host-bandwidth", "0"], "host-bandwidth"),
    (["--evicpress-profile-queries", "0"], "profile-queries"),
]


@pytest.mark.parametrize("extra, message", BAD_FLAGS)
def test_bad_flag_values_rejected(extra, message, capsys):
    from sglang_vc.launch_server import build_vc_parser
    from sglang_vc.config import ConfigError, VCConfig

    args, _ = build_vc_parser().parse_known_args(["--evicpress-disk-dir", "/tmp/x", *extra])
    with pytest.raises(ConfigError, match=message):
        VCConfig.from_cli_args(args)


def test_token_dropping_flags_select_the_lossy_attention_backend():
    """knorm/keydiff candidates or a fixed knorm config are accepted and make the launcher
    pass --attention-backend vc_torch (page size 1, prefill CUDA graphs off; decode graphs
    stay on for batches without compressed requests) to SGLang; another
    attention backend is refused."""
    from sglang_vc.config import ConfigError, VCConfig
    from sglang_vc.evicpress import flags
    from sglang_vc.launch_server import backend_flags, build_vc_parser

    def parsed(*argv):
        return VCConfig.from_cli_args(build_vc_parser().parse_known_args(["--evicpress-disk-dir", "/tmp/x", *argv])[0])

    vc = parsed("--evicpress-methods", "knorm,keydiff,kivi")
    assert {"knorm@0.3", "knorm@0.6", "knorm@0.9", "keydiff@0.3", "kivi@2b"} <= set(flags.settings_of(vc)["candidates"])
    fixed = parsed("--evicpress-policy", "fixed", "--evicpress-fixed-config", "knorm@0.5")
    assert flags.settings_of(fixed)["fixed_config"] == "knorm@0.5" and flags.drops_tokens(flags.settings_of(fixed))
    assert not flags.drops_tokens(flags.settings_of(parsed()))  # default: kivi only
    argv = ["--radix-cache-backend", "evicpress"]
    extra = backend_flags(fixed, argv)
    assert extra[:2] == ["--attention-backend", "vc_torch"] and "--page-size" in extra
    assert "--cuda-graph-backend-prefill" in extra and "--cuda-graph-backend-decode" not in extra
    assert "--radix-cache-backend" not in extra
    assert backend_flags(parsed(), argv) == []
    with pytest.raises(ConfigError, match="vc_torch"):
        backend_flags(fixed, argv + ["--attention-backend", "torch_native"])


@pytest.mark.parametrize(
    "backend, ep, hicache, message",
    [
        ("evicpress", [], True, "needs a storage tier"),
        ("evicpress", ["--evicpress-disk-dir", "/tmp/x"], False, "--enable-hierarchical-cache"),
        (None, ["--evicpress-disk-dir", "/tmp/x"], True, "--radix-cache-backend evicpress"),
        (None, ["--evicpress-alpha", "2"], False, "--radix-cache-backend evicpress"),
        ("evicpress", ["--evicpress-disk-dir", "/tmp/x"], "write_back", "not write_back"),
        ("evicpress", ["--evicpress-disk-dir", "/tmp/x"], "buffer_only", "not buffer_only"),
    ],
)
def test_inconsistent_flags_rejected(backend, ep, hicache, message, capsys):
    """What the launcher checks after resolving the storage tier (``storage_argv``)."""
    from types import SimpleNamespace

    from sglang_vc.config import VCConfig
    from sglang_vc.evicpress.flags import settings_of, storage_argv
    from sglang_vc.evicpress.service import check_server_args
    from sglang_vc.kvruntime.select import flag_value
    from sglang_vc.launch_server import build_vc_parser

    vc = VCConfig.from_cli_args(build_vc_parser().parse_known_args(ep)[0])
    argv = storage_argv(settings_of(vc), ["--radix-cache-backend", backend] if backend else [])
    sa = SimpleNamespace(radix_cache_backend=backend, enable_hierarchical_cache=bool(hicache),
                         hicache_storage_backend=flag_value(argv, "--hicache-storage-backend")[1],
                         hicache_mem_layout="layer_first", tp_size=1, dp_size=1,
                         hicache_write_policy="write_back" if hicache == "write_back" else "write_through",
                         hicache_host_memory_mode="buffer_only" if hicache == "buffer_only" else "cache")
    with pytest.raises(SystemExit) as exc:
        check_server_args(vc, sa)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_disk_dir_becomes_our_storage_backend_through_sglangs_dynamic_one():
    import json

    from sglang_vc.config import VCConfig
    from sglang_vc.evicpress.flags import settings_of, storage_argv
    from sglang_vc.kvruntime.select import flag_value
    from sglang_vc.launch_server import build_vc_parser

    vc = VCConfig.from_cli_args(build_vc_parser().parse_known_args(
        ["--evicpress-disk-dir", "/tmp/x", "--evicpress-disk-size-gb", "2"])[0])
    argv = storage_argv(settings_of(vc), ["--radix-cache-backend", "evicpress"])
    assert settings_of(vc)["enabled"] and settings_of(vc)["control_port"] > 0
    assert flag_value(argv, "--hicache-storage-backend")[1] == "dynamic"
    extra = json.loads(flag_value(argv, "--hicache-storage-backend-extra-config")[1])
    assert extra["backend_name"] == "evicpress_file" and extra["path"] == "/tmp/x" and extra["capacity_gb"] == 2
    # a storage backend given by name is EvicPress's storage tier as it is
    vc = VCConfig.from_cli_args(build_vc_parser().parse_known_args([])[0])
    argv = ["--radix-cache-backend", "evicpress", "--hicache-storage-backend", "file"]
    assert storage_argv(settings_of(vc), argv) == argv and settings_of(vc)["enabled"]


def test_no_evicpress_flags_is_fine():
    from types import SimpleNamespace

    from sglang_vc.config import VCConfig
    from sglang_vc.evicpress.service import check_server_args
    from sglang_vc.launch_server import build_vc_parser

    vc = VCConfig.from_cli_args(build_vc_parser().parse_known_args([])[0])
    assert check_server_args(vc, SimpleNamespace(radix_cache_backend=None)) is False
    assert "evicpress" not in vc.enabled_mechanisms()


def test_bad_evicpress_flag_is_a_usage_error(tmp_path, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--evicpress-bits", "3", "--evicpress-disk-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--evicpress-bits" in capsys.readouterr().err


@pytest.mark.slow  # a launcher process; test_inconsistent_flags_rejected runs the same check in process
def test_launcher_exits_2_on_inconsistent_evicpress_flags(model_dir, tmp_path):
    """End to end: the check SGLang's own flags need runs before any server starts."""
    argv = ["--radix-cache-backend", "evicpress", "--evicpress-disk-dir", str(tmp_path)]
    r = subprocess.run(LAUNCH + ["--model-path", model_dir] + argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--enable-hierarchical-cache" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------- real server

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.evicpress import CTX_TOKENS
from sglang_vc.testing.files import wait_for_files


@pytest.fixture(scope="module")
def ep_server(model_dir, tmp_path_factory):
    from sglang_vc.testing.server import ServerProcess

    root = tmp_path_factory.mktemp("evicpress")
    per_ctx_gb = CTX_TOKENS * 46080 / (1 << 30)
    args = [
        "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "2048",
        # the README's flags only: the launcher sets the CPU platform's HiCache transfers
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--radix-cache-backend", "evicpress", "--enable-metrics",
        "--evicpress-disk-dir", str(root / "disk"),
        "--evicpress-host-size-gb", f"{2.5 * per_ctx_gb:.6f}",
        "--evicpress-disk-size-gb", f"{4.5 * per_ctx_gb:.6f}",
        "--evicpress-observe-rate", "1", "--evicpress-generate-queries", "0",
        # the profiler works after 5 s without requests: never between a test's requests,
        # however slow the machine (registered contexts are also profiled up front)
        "--evicpress-idle-seconds", "5", "--evicpress-profile-max-new-tokens", "8",
        "--evicpress-profile-queries", "1", "--evicpress-auto-context-tokens", "150",
        "--evicpress-device-size-gb", "0",  # device copies: SGLang's LRU (tier tests: test_evicpress_tree)
        "--evicpress-storage-copies", "none",  # the knapsack alone places (copies: test_evicpress_tree)
        # the delay model's inputs are pinned, so that placements do not depend on what
        # this machine measures at start-up (their measurement has its own test)
        "--evicpress-host-bandwidth", "10", "--evicpress-disk-bandwidth", "1",
        "--evicpress-decompress-bandwidth", "5", "--evicpress-prefill-tokens-per-s", "200",
        "--admin-api-key", ADMIN_KEY,  # the digests its tests read
    ]
    proc = ServerProcess(args, log_path=root / "server.log", timeout=420)
    proc.disk_dir = root / "disk"
    proc.admin_key = ADMIN_KEY
    yield proc
    proc.stop()


def test_server_kv_bytes_survive_device_host_disk_device(ep_server, tokenizer):
    from conftest import real_text_passages

    s = ep_server
    # full KV only, profiled at registration: the profiler (idle-time work) never moves it
    ids, _ = epx.register(s, tokenizer, "move", real_text_passages(12, words=220)[0], quality={})
    first = epx.ask(s, tokenizer, ids)
    assert epx.placement(s, "move")["tier"] == "host"
    d0 = epx.api(s, "GET", "/evicpress/contexts/move/digest")
    assert d0["device_tokens"] == CTX_TOKENS and d0["device"] == d0["stored"]  # device -> host
    # HiCache writes the prompt through to storage, one page a token (page size 1)
    wait_for_files(next(d for d in s.disk_dir.iterdir() if d.is_dir()), CTX_TOKENS, timeout=120, quiet_s=1.0)
    before = epx.counters(s)
    epx.api(s, "POST", "/evicpress/contexts/move/placement", {"tier": "disk"})
    assert epx.placement(s, "move")["tier"] == "disk"
    d1 = epx.api(s, "GET", "/evicpress/contexts/move/digest")
    assert d1["stored"] == d0["device"] and d1["blob"] == d0["blob"]  # host -> disk
    # on storage the full KV is HiCache's pages of it, found by SGLang's keys: EvicPress
    # writes no copy of its own (#75)
    moved = epx.counters(s)
    assert moved.get("full_pages_found", 0) == before.get("full_pages_found", 0) + 1, moved
    assert moved.get("full_pages_written", 0) == before.get("full_pages_written", 0)
    assert len(d1["storage_files"]) == CTX_TOKENS and all(Path(f).is_file() for f in d1["storage_files"])
    assert moved["disk_used_bytes"] == 0  # nothing in EvicPress's own storage entries
    epx.api(s, "POST", "/evicpress/evict_device")
    assert epx.api(s, "GET", "/evicpress/contexts/move/digest")["device_tokens"] == 0
    again = epx.ask(s, tokenizer, ids)  # disk -> device
    after = epx.counters(s)
    assert after.get("hits_disk", 0) == before.get("hits_disk", 0) + 1, after
    assert after.get("full_pages_read", 0) == before.get("full_pages_read", 0) + 1, after
    d2 = epx.api(s, "GET", "/evicpress/contexts/move/digest")
    assert d2["device"] == d0["device"]
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= CTX_TOKENS

    # compressed: 4-bit on the host, dequantized into device slots on a hit
    epx.api(s, "POST", "/evicpress/contexts/move/placement", {"tier": "host", "config": "kivi@4b"})
    p = epx.placement(s, "move")
    assert p["tier"] == "host" and p["config"] == "kivi@4b" and p["stored_bytes"] < 0.3 * 46080 * CTX_TOKENS
    epx.api(s, "POST", "/evicpress/evict_device")
    lossy = epx.ask(s, tokenizer, ids)
    d3 = epx.api(s, "GET", "/evicpress/contexts/move/digest")
    assert d3["device"] == d3["stored"] != d0["device"]
    assert lossy["meta_info"]["cached_tokens"] >= CTX_TOKENS
    assert epx.counters(s)["hits_host"] >= 1
    info = epx.api(s, "GET", "/evicpress/contexts/move")
    assert info["device_config"] == "kivi@4b"


def test_a_lossy_copy_never_stands_in_for_the_exact_rows_of_another_request(ep_server, tokenizer):
    """A context served from its 2-bit copy shares its first 28 tokens (an instruction
    header) with a plain request that is no context. The lossy rows are the context's
    alone: the plain request decodes token for token as full-KV decoding, sent after
    the context's load and in one batch with it, in both orders. (Until 2026-11-27 the
    dequantized rows went into the tree under the request's own namespace, and the plain
    request reused them for the header: its greedy output differed.)"""
    import threading

    from conftest import real_text_passages

    s = ep_server
    passages = real_text_passages(16, words=220)
    header = tokenizer("You are a careful reader. Read the document below, then answer the question "
                       "after it in a few words.\n\nDocument:\n", add_special_tokens=False)["input_ids"]
    body = lambda i, n: tokenizer(passages[i], add_special_tokens=False)["input_ids"][:n]  # noqa: E731
    ctx_ids = header + body(12, CTX_TOKENS - len(header))
    q = tokenizer(epx.QUESTION, add_special_tokens=False)["input_ids"]
    plain = header + body(13, 80) + q  # under --evicpress-auto-context-tokens: no context
    assert len(header) >= 20 and len(plain) < 150

    def run(ids):
        return s.generate(input_ids=ids, max_new_tokens=12)

    epx.api(s, "POST", "/evicpress/evict_device")
    want = run(plain)  # full-KV decoding, nothing cached
    epx.api(s, "POST", "/evicpress/contexts", {"id": "lossy", "token_ids": ctx_ids, "quality": {}})
    exact = epx.ask(s, tokenizer, ctx_ids)  # computed and stored
    epx.api(s, "POST", "/evicpress/contexts/lossy/placement", {"tier": "host", "config": "kivi@2b"})
    full = epx.api(s, "GET", "/evicpress/contexts/lossy/digest")

    def check_plain(got):
        assert got["output_ids"] == want["output_ids"], (got["output_ids"], want["output_ids"])
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        assert len(got["output_ids"]) == len(want["output_ids"])

    def check_lossy(c0):
        assert epx.counters(s)["hits_host"] == c0.get("hits_host", 0) + 1
        d = epx.api(s, "GET", "/evicpress/contexts/lossy/digest")
        # the device holds the 2-bit copy dequantized, not the full KV: the compressed path
        assert d["device_config"] == "kivi@2b" and d["device"] == d["stored"] != full["device"], d

    epx.api(s, "POST", "/evicpress/evict_device")
    c0 = epx.counters(s)
    lossy = epx.ask(s, tokenizer, ctx_ids)
    assert lossy["meta_info"]["cached_tokens"] >= CTX_TOKENS
    check_lossy(c0)
    got = run(plain)  # the lossy copy is on the device now
    check_plain(got)
    # No device row of the header is reused: what is cached is HiCache's host backup of
    # the plain request's own exact rows (its first run was written through, and so is the
    # context's request since its rows are HiCache's too: how much of the plain prompt's
    # backup survives the context's split of that node depends on the write-through's timing)
    details = got["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] == got["meta_info"]["cached_tokens"], got["meta_info"]
    c1 = epx.counters(s)
    again = epx.ask(s, tokenizer, ctx_ids)  # the context's own requests do reuse its device copy
    assert epx.counters(s)["hits_device"] == c1.get("hits_device", 0) + 1
    assert again["output_ids"] == lossy["output_ids"]
    # ... but not a request with another cache_salt: SGLang keeps salted rows apart, and so
    # does EvicPress (the context is another tenant's): nothing of it is reused from any
    # tier, the request computes its prompt and answers as full KV does
    c2 = epx.counters(s)
    r = requests.post(s.url + "/generate", json={"input_ids": ctx_ids + q, "cache_salt": "tenant-b",
                                                 "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
                      timeout=300)
    assert r.status_code == 200, r.text
    c3 = epx.counters(s)
    assert r.json()["meta_info"]["cached_tokens"] == 0, r.json()["meta_info"]
    assert all(c3.get(k, 0) == c2.get(k, 0) for k in ("hits_device", "hits_host", "hits_disk")), (c2, c3)
    assert r.json()["output_ids"] == exact["output_ids"]

    for order in (("ctx", "plain"), ("plain", "ctx")):  # one batch, both orders
        epx.api(s, "POST", "/evicpress/evict_device")
        c0, outs = epx.counters(s), {}
        prompts = {"ctx": ctx_ids + q, "plain": plain}
        threads = [threading.Thread(target=lambda k=k: outs.__setitem__(k, run(prompts[k]))) for k in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check_plain(outs["plain"])
        check_lossy(c0)


@pytest.mark.parametrize("damage", [pytest.param("flip", marks=pytest.mark.slow), "truncate"])
def test_server_damaged_disk_entry_is_recomputed(ep_server, tokenizer, damage):
    from conftest import real_text_passages

    s = ep_server
    cid = f"bad-{damage}"
    ids, _ = epx.register(s, tokenizer, cid, real_text_passages(12, words=220)[1 if damage == "flip" else 2],
                          quality={})  # as above: no idle-time profile moves it
    first = epx.ask(s, tokenizer, ids)
    epx.api(s, "POST", f"/evicpress/contexts/{cid}/placement", {"tier": "disk"})
    files = epx.api(s, "GET", f"/evicpress/contexts/{cid}/digest")["storage_files"]
    # HiCache's pages of the context, one a token (page size 1): one of them damaged
    assert len(files) == CTX_TOKENS and all(str(s.disk_dir) in f for f in files), files
    path = Path(files[len(files) // 2])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))
    epx.api(s, "POST", "/evicpress/evict_device")
    before = epx.counters(s)
    again = epx.ask(s, tokenizer, ids)
    after = epx.counters(s)
    assert after.get("disk_corrupted", 0) == before.get("disk_corrupted", 0) + 1
    assert after.get("misses", 0) == before.get("misses", 0) + 1
    assert after.get("hits_disk", 0) == before.get("hits_disk", 0)
    assert again["output_ids"] == first["output_ids"]  # recomputed, never served
    assert not path.exists() or epx.placement(s, cid)["tier"] == "host"
    assert epx.placement(s, cid)["tier"] == "host"  # stored again after the recompute


def test_a_full_context_whose_storage_pages_are_cleared_is_recomputed(ep_server, tokenizer):
    """A full context on storage is HiCache's pages: SGLang's storage clear (what
    ``bench.evicpress`` does between systems) removes them, and the next request
    recomputes the context -- a drop, never a wrong row."""
    from conftest import real_text_passages
    from sglang_vc.bench.evicpress_client import Client

    s = ep_server
    ids, _ = epx.register(s, tokenizer, "cleared", real_text_passages(12, words=220)[3], quality={})
    first = epx.ask(s, tokenizer, ids)
    epx.api(s, "POST", "/evicpress/contexts/cleared/placement", {"tier": "disk"})
    files = [Path(f) for f in epx.api(s, "GET", "/evicpress/contexts/cleared/digest")["storage_files"]]
    assert len(files) == CTX_TOKENS and all(f.is_file() for f in files)
    Client(s.url, admin_key=s.admin_key).clear_storage()
    assert not any(f.exists() for f in files)
    epx.api(s, "POST", "/evicpress/evict_device")
    before = epx.counters(s)
    again = epx.ask(s, tokenizer, ids)
    after = epx.counters(s)
    assert after.get("full_pages_missing", 0) == before.get("full_pages_missing", 0) + 1, after
    assert after.get("misses", 0) == before.get("misses", 0) + 1
    assert again["output_ids"] == first["output_ids"]


@pytest.mark.slow  # 15-min default budget; full disk in process: test_manager_full_disk_drops
def test_server_hits_from_every_tier_and_full_disk(ep_server, tokenizer):
    """More contexts than the tiers hold (host 2.5, disk 4.5 full contexts, 8 contexts of
    equal use): the knapsack keeps 2 on the host, demotes 4 to disk and, with the disk
    full, drops the rest (recomputed on demand). Each then answers from where it was
    placed. The delay model is pinned (fixture), so the placement is the same on any
    machine; the tiers start empty (``reconfigure``) whatever the tests before left."""
    from conftest import real_text_passages

    s = ep_server
    epx.api(s, "POST", "/evicpress/reconfigure", {"policy": "evicpress"})
    passages = real_text_passages(16, words=220)[4:12]
    # profiled at registration as full KV only: the server's profiler (which runs
    # whenever the server is idle, so when depends on the machine) leaves them alone
    ctxs = {f"t{i}": epx.register(s, tokenizer, f"t{i}", p, quality={})[0] for i, p in enumerate(passages)}
    assert all(epx.api(s, "GET", f"/evicpress/contexts/{cid}")["profiled"] for cid in ctxs)
    before = epx.counters(s)
    ref = {cid: epx.ask(s, tokenizer, ids)["output_ids"] for cid, ids in ctxs.items()}  # misses
    after_misses = epx.counters(s)
    assert after_misses.get("misses", 0) - before.get("misses", 0) == len(ctxs)
    status = epx.api(s, "GET", "/evicpress/status")
    placed = {c["id"]: c["placement"] for c in epx.api(s, "GET", "/evicpress/contexts")["contexts"]
              if c["id"] in ctxs}
    by_tier = {t: sorted(cid for cid, p in placed.items() if p["tier"] == t) for t in ("host", "disk", None)}
    assert (len(by_tier["host"]), len(by_tier["disk"]), len(by_tier[None])) == (2, 4, 2), placed
    assert all(p["config"] in (None, "full") for p in placed.values()), placed
    for tier in ("host", "disk"):
        t = status["tiers"][tier]
        assert t["used_bytes"] <= t["capacity_bytes"], status["tiers"]
    assert after_misses.get("drops", 0) > before.get("drops", 0)  # the full disk dropped

    def ask_from(cid, counter, evict=True):
        if evict:
            epx.api(s, "POST", "/evicpress/evict_device")
        c0 = epx.counters(s)
        out = epx.ask(s, tokenizer, ctxs[cid])
        c1 = epx.counters(s)
        assert c1.get(counter, 0) == c0.get(counter, 0) + 1, (cid, counter, c0, c1)
        assert out["output_ids"] == ref[cid], cid  # full KV from every tier: same tokens
        # the same tier per request, by its rid (what a client of concurrent requests reads)
        rid = out["meta_info"]["id"]
        served = epx.api(s, "GET", f"/evicpress/requests?rid={rid}&rid=unknown-rid")["requests"]
        tier = {"hits_device": "device", "hits_host": "host", "hits_disk": "disk", "misses": "miss"}[counter]
        assert served == [{"rid": rid, "ctx": cid, "tier": tier, "config": None if tier == "miss" else "full"}], served
        return out

    out = ask_from(by_tier["host"][0], "hits_host")
    assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS
    ask_from(by_tier["host"][0], "hits_device", evict=False)
    out = ask_from(by_tier["disk"][0], "hits_disk")
    assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS
    ask_from(by_tier[None][0], "misses")  # dropped: recomputed

    # the same counters in the sglang_vc section of /server_info and on /metrics
    info = s.server_info()["sglang_vc"]["counters"]["evicpress"]
    for key in ("hits_device", "hits_host", "hits_disk", "misses", "demotions", "drops"):
        assert info.get(key, 0) > 0, info
    metrics = requests.get(s.url + "/metrics", timeout=60).text
    for key in ("hits_host", "hits_disk", "demotions", "bytes_loaded_disk"):
        assert f"sglang_vc:evicpress_{key}_total" in metrics, metrics[-3000:]
    status = epx.api(s, "GET", "/evicpress/status")
    for tier in ("host", "disk"):
        t = status["tiers"][tier]
        assert t["used_bytes"] <= t["capacity_bytes"], status["tiers"]


def test_measured_delay_model_inputs_are_physical(tmp_path):
    """What a server measures at start-up when the flags do not pin it (the path the
    pinned tests skip): finite, positive, and the host tier loads faster than the disk
    tier (a memcpy against reads through the file system)."""
    import math

    from sglang_vc.evicpress.measure import measure_delay_inputs

    ep = {"candidates": ["kivi@2b", "kivi@4b", "kivi1@1b"]}
    m = measure_delay_inputs(ep, DIMS, tmp_path)
    values = [m["host_bandwidth"], m["disk_bandwidth"], *m["decompress_bytes_per_s"].values()]
    assert set(m["decompress_bytes_per_s"]) == {"kivi", "kivi1"}
    assert all(math.isfinite(v) and v > 0 for v in values), m
    assert m["host_bandwidth"] > m["disk_bandwidth"], m
    # pinned flags skip the measurement
    pinned = measure_delay_inputs({**ep, "host_bandwidth": 10, "disk_bandwidth": 1, "decompress_bandwidth": 5}, DIMS, tmp_path)
    assert pinned == {}


def test_server_long_prompt_becomes_a_context(ep_server, tokenizer):
    """An unregistered prompt of >= --evicpress-auto-context-tokens is a context too."""
    from conftest import real_text_passages

    s = ep_server
    ids = tokenizer(real_text_passages(12, words=220)[11])["input_ids"][:CTX_TOKENS]

    def autos():  # earlier tests' long prompts (another tenant's included) are contexts too
        return {c["id"]: c for c in epx.api(s, "GET", "/evicpress/contexts")["contexts"] if c["source"] == "auto"}

    known = autos()
    first = epx.ask(s, tokenizer, ids)
    new = [c for cid, c in autos().items() if cid not in known]
    assert len(new) == 1 and new[0]["placement"]["tier"] is not None and new[0]["namespace"] is None, new
    epx.api(s, "POST", "/evicpress/evict_device")
    before = epx.counters(s)
    again = epx.ask(s, tokenizer, ids)
    after = epx.counters(s)
    assert sum(after.get(k, 0) - before.get(k, 0) for k in ("hits_host", "hits_disk")) == 1
    assert again["meta_info"]["cached_tokens"] >= CTX_TOKENS
    assert again["output_ids"] == first["output_ids"]


def test_a_salted_context_is_profiled_in_its_tenant(ep_server, tokenizer):
    """A long prompt under a ``cache_salt`` is a context of that tenant, and the server's
    profiler (its requests carry no salt: they name the context by id) loads each
    candidate copy of it and profiles it; until 2026-12-02 every load missed ("could not
    load kivi@2b of context ... for profiling") and the profile failed."""
    from conftest import real_text_passages

    s = ep_server
    ids = tokenizer(real_text_passages(12, words=220)[9])["input_ids"][:CTX_TOKENS]
    q = tokenizer(epx.QUESTION, add_special_tokens=False)["input_ids"]
    known = {c["id"] for c in epx.api(s, "GET", "/evicpress/contexts")["contexts"]}
    before = epx.counters(s)
    r = requests.post(s.url + "/generate", json={"input_ids": ids + q, "cache_salt": "tenant-p",
                                                 "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
                      timeout=300)
    assert r.status_code == 200, r.text
    new = [c for c in epx.api(s, "GET", "/evicpress/contexts")["contexts"] if c["id"] not in known]
    assert len(new) == 1 and new[0]["namespace"] is not None, new  # the tenant's own context
    deadline = time.time() + 600  # the profiler starts after 5 s without requests
    while time.time() < deadline:
        info = epx.api(s, "GET", f"/evicpress/contexts/{new[0]['id']}")
        if info["profiled"] or epx.counters(s).get("profile_failures", 0) > before.get("profile_failures", 0):
            break
        time.sleep(2)
    after = epx.counters(s)
    assert info["profiled"], (info, s.log_tail(20))
    assert after.get("profile_failures", 0) == before.get("profile_failures", 0), after
    assert set(info["quality"]) >= {"full", "kivi@2b", "kivi@4b"}, info
    assert after.get("profile_loads", 0) >= before.get("profile_loads", 0) + 2, (before, after)


@pytest.mark.slow
def test_server_reprofiles_on_quality_drift(ep_server, tokenizer):
    from conftest import real_text_passages

    s = ep_server
    ids, info = epx.register(s, tokenizer, "drift", real_text_passages(12, words=220)[10],
                          queries=["What is this text about?"],
                          quality={"kivi@2b": 0.9, "kivi@4b": 0.97})
    assert info["profile_pending"] is None and info["quality"]["kivi@2b"] == 0.9
    epx.ask(s, tokenizer, ids)
    epx.api(s, "POST", "/evicpress/contexts/drift/placement", {"tier": "host", "config": "kivi@2b"})
    epx.api(s, "POST", "/evicpress/evict_device")
    epx.ask(s, tokenizer, ids)  # served from the 2-bit copy: sampled for a shadow check
    before = epx.counters(s)
    fired = [epx.api(s, "POST", "/evicpress/contexts/drift/observations",
                  {"config": "kivi@2b", "quality": 0.1})["reprofile"] for _ in range(4)]
    assert any(fired)
    deadline = time.time() + 600
    while time.time() < deadline:
        c = epx.counters(s)
        if c.get("reprofilings", 0) > before.get("reprofilings", 0) and c.get("observations", 0) >= 5:
            break
        time.sleep(2)
    else:
        pytest.fail(f"no re-profiling: {epx.counters(s)}\n{s.log_tail(40)}")
    info = epx.api(s, "GET", "/evicpress/contexts/drift")
    assert info["profile_pending"] is None and info["profiled"]
    assert set(info["quality"]) >= {"full", "kivi@2b", "kivi@4b"}
    assert c.get("observations", 0) >= 5  # ours + the profiler's shadow check


def test_bench_fixed_option_accepts_token_dropping_configs(tmp_path, capsys):
    """``python -m sglang_vc.bench.evicpress --fixed knorm@0.5`` is a valid baseline
    (checked before anything starts); a config EvicPress cannot store is a usage error."""
    from sglang_vc.bench import evicpress as bench
    from sglang_vc.evicpress.flags import validate_fixed

    assert validate_fixed("knorm@0.5").drops_tokens and not validate_fixed("kivi@4b").drops_tokens
    for bad in ("snapkv@0.5", "kivi@3b", "nosuch@0.5"):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--json", str(tmp_path / "x.json"), "--quick", "--fixed", bad])
        assert exc.value.code == 2
        assert "--fixed" in capsys.readouterr().err


@pytest.mark.parametrize("body, message", [
    ({"token_ids": list(range(1, 9000))}, "at most 8192 tokens"),
    ({"token_ids": "abc"}, "non-empty list of token ids"),
    ({"token_ids": []}, "non-empty list of token ids"),
    ({"token_ids": [1, True]}, "non-empty list of token ids"),
    ({}, "give 'text' or 'token_ids'"),
])
def test_bad_context_registrations_are_400(ep_server, body, message):
    """``POST /evicpress/contexts`` bounds what it registers (each context is prefilled and
    profiled): token ids as a list, at most the model's context length (8,192 here)."""
    import requests

    r = requests.post(ep_server.url + "/evicpress/contexts", json=body, headers=epx.auth(ep_server), timeout=60)
    assert r.status_code == 400 and message in r.text, (r.status_code, r.text)


def test_routes_that_show_what_requests_sent_need_the_admin_key(ep_server, tokenizer):
    """A context's token ids (and KV digests) are other users' prompts: on a server
    started with ``--admin-api-key`` they answer only a client presenting it (401
    otherwise), as do the routes that change EvicPress's state (SGLang's level for its
    own cache routes); ``test_evicpress_tree`` checks a server without the key (403)."""
    import requests

    epx.api(ep_server, "POST", "/evicpress/contexts", {"id": "secret", "token_ids": list(range(100, 300))})
    url = ep_server.url + "/evicpress/contexts/secret"
    assert requests.get(url, params={"tokens": 1}, timeout=60).status_code == 401
    assert requests.get(url + "/digest", timeout=60).status_code == 401
    assert requests.post(ep_server.url + "/evicpress/evict_device", timeout=60).status_code == 401
    got = requests.get(url, params={"tokens": 1}, headers=epx.auth(ep_server), timeout=60)
    assert got.status_code == 200 and got.json()["token_ids"][:3] == [100, 101, 102], got.text
    epx.api(ep_server, "DELETE", "/evicpress/contexts/secret")
