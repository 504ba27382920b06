"""The emulated hardware regime of ``bench.evicpress --regime`` (#75): the throttled tiers
give this machine the reference hardware's load / prefill ratio per token, and the delay
model holds: with ``--evicpress-throttle`` a load of N bytes from a tier takes at least N /
its bandwidth, EvicPress's own fetches and SGLang's HiCache load-backs of a host copy
alike; without it, loads take what they take."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_vc.bench.evicpress_regime import H100_8B, capacities, emulate
from sglang_vc.evicpress.codec import FullKV
from sglang_vc.evicpress.config import FULL, Tier
from sglang_vc.evicpress.context import KVDims, Settings
from sglang_vc.evicpress.disk_tier import DiskTierStore
from sglang_vc.evicpress.host_tier import RamHostStore
from sglang_vc.evicpress.manager import EvicPressManager
from sglang_vc.evicpress.request_plan import ContextPlan, Origin

DIMS = KVDims(layers=2, heads=2, head_dim=32, v_heads=2, v_head_dim=32, itemsize=4)
TOKENS = 200


def test_the_reference_ratios_and_their_emulation_here():
    """An 8B model's token on an H100: host DRAM loads it in 0.16 of its prefill, an SSD
    in 1.35 (slower than recomputing it). Emulated for a machine that prefills 800
    tokens/s with 46,080 B of KV a token (smollm2-135m, float32), the tiers' bandwidths give
    the same ratios, and the flags carry them."""
    assert H100_8B.kv_bytes_per_token == 131072  # the paper's 0.12 GB per 1K tokens
    assert H100_8B.load_over_prefill(H100_8B.host_bytes_per_s) == pytest.approx(0.1620, rel=1e-3)
    assert H100_8B.load_over_prefill(H100_8B.disk_bytes_per_s) == pytest.approx(1.3503, rel=1e-3)
    here = emulate(H100_8B, 800.0, 46080)
    for bw, ratio in ((here.host_bytes_per_s, here.host_load_over_prefill),
                      (here.disk_bytes_per_s, here.disk_load_over_prefill)):
        assert (46080 / bw) / (1 / 800.0) == pytest.approx(ratio)
    assert here.host_bytes_per_s > here.disk_bytes_per_s
    flags = here.server_flags()
    assert "--evicpress-throttle" in flags and float(flags[flags.index("--evicpress-disk-bandwidth") + 1]) == \
        pytest.approx(here.disk_bytes_per_s / 1e9, rel=1e-5)
    assert capacities(H100_8B, 10_000) == {"device": 2000, "host": 5000}
    with pytest.raises(ValueError):
        emulate(H100_8B, 0.0, 46080)


def _manager(tmp_path, throttle: bool, bandwidth: float, host_bytes: int = 10**8) -> EvicPressManager:
    s = Settings(policy="lru", disk_capacity=10**8, host_bandwidth=bandwidth, disk_bandwidth=bandwidth,
                 prefill_tokens_per_s=500.0, prefill_measured=False, throttle=throttle)
    return EvicPressManager(s, DIMS, RamHostStore(host_bytes), DiskTierStore(tmp_path / "disk", 10**8, fsync=False))


def _stored(mgr, i: int = 0):
    g = torch.Generator().manual_seed(i)
    kv = FullKV(torch.randn(2, TOKENS, 2, 32, generator=g), torch.randn(2, TOKENS, 2, 32, generator=g))
    ctx = mgr.registry.register(list(range(1000 * i + 1, 1000 * i + 1 + TOKENS)), ctx_id=f"c{i}")
    mgr.store_computed(ctx, kv)
    return ctx


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_a_throttled_fetch_takes_at_least_its_bytes_over_the_tiers_bandwidth(tmp_path, tier):
    """A host tier with no room puts the context on disk (LRU). Throttled to 2 MB/s, its
    ~100 KB load takes at least its bytes over that, counted as its load time; at 1 B/s
    unthrottled, it takes what reading it takes."""
    slow, host_bytes = 2e6, (10**8 if tier is Tier.HOST else 10**3)
    mgr = _manager(tmp_path / "on", True, slow, host_bytes)
    ctx = _stored(mgr)
    assert ctx.placement.tier is tier
    started = time.perf_counter()
    got = mgr.requests.fetch(ctx)
    took = time.perf_counter() - started
    assert got is not None and got.tier is tier
    assert took >= got.nbytes / slow and got.seconds >= got.nbytes / slow
    assert mgr.counters[f"load_seconds_{tier.name.lower()}"] >= got.nbytes / slow

    free = _manager(tmp_path / "off", False, 1.0, host_bytes)  # 1 B/s: a throttled load would take a day
    ctx = _stored(free, 1)
    started = time.perf_counter()
    got = free.requests.fetch(ctx)
    assert got is not None and got.tier is tier and time.perf_counter() - started < got.nbytes / 1.0


class _BackedRows:
    """The device holds none of the context's rows; SGLang's tree still has its host
    backup (a HiCache load-back serves it)."""

    def floor(self, n):
        return n

    def exact(self, n):
        return 0

    def serve_lossy(self, ctx, cfg, n):
        return False

    def backed_up(self, n):
        return True

    def load(self, ctx, fetched, usable, have):
        raise AssertionError("a load-back is SGLang's: nothing for EvicPress to load")


@pytest.mark.parametrize("throttle", [True, False])
def test_a_hicache_load_back_of_a_host_copy_is_paced_like_a_host_fetch(tmp_path, throttle):
    slow = 1e6 if throttle else 1.0
    mgr = _manager(tmp_path, throttle, slow)
    ctx = _stored(mgr)
    assert ctx.placement.tier is Tier.HOST
    mgr.host_backed = lambda c: True  # (its host copy is SGLang's backup of the tree nodes)
    ids = ctx.token_ids.tolist() + [5, 6, 7]
    plan = ContextPlan()
    started = time.perf_counter()
    mgr.requests.plan_match("r", ids, None, ids, _BackedRows(), plan)
    took = time.perf_counter() - started
    assert (plan.origin, plan.served, plan.backed_hit) == (Origin.HOST, FULL, True)
    nbytes = DIMS.bytes_per_token * plan.usable
    assert mgr.counters["bytes_loaded_host"] == nbytes
    if throttle:
        assert took >= nbytes / slow and mgr.counters["load_seconds_host"] >= nbytes / slow
    else:
        assert took < nbytes / slow and mgr.counters.get("load_seconds_host", 0) == 0
