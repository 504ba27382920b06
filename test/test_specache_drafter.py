"""SpeCache as VERICACHE's drafter: the rows it fetches and the requests it accepts.
(Its greedy identity on a real server: test_vericache_serving.py, ``specache1``.)"""

from __future__ import annotations

import pytest
import torch

from sglang_vc.specache import core
from sglang_vc.specache.requests import check_drafter_params
from sglang_vc.vericache.reload import HostKVStore
from sglang_vc.vericache.specache_drafter import SpeCacheDrafter


def test_fetched_rows_are_the_full_kv_from_host_and_tree_prefix():
    """Positions below the tree-shared prefix ``p`` come from the pool (full precision
    there), the others from VERICACHE's host copy; either way bytes-equal to the full KV."""
    g = torch.Generator().manual_seed(0)
    n, p, heads, dim = 40, 6, 3, 8
    k_full, v_full = torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g)
    host = HostKVStore()
    assert host.admit("r", 0, p, n, 0)
    host.sink("r", 0, 2, p, k_full, v_full)
    assert host.get("r", 0) is None  # still on the device until the prefill's flush
    host.flush()
    # the pool: the request's row points at scattered slots; only [0, p) is live there
    slots = torch.randperm(100, generator=g)[:n]
    k_buf, v_buf = torch.zeros(100, heads, dim), torch.zeros(100, heads, dim)
    k_buf[slots[:p]], v_buf[slots[:p]] = k_full[:p], v_full[:p]
    positions = torch.tensor([[0, 5, 6, 39], [1, 2, 30, 31], [7, 8, 9, 10]])
    rows = SpeCacheDrafter._rows(host.get("r", 0), 2, positions, slots, k_buf, v_buf)
    want = core.gather_rows(k_full, v_full, positions)
    assert torch.equal(rows.k, want.k) and torch.equal(rows.v, want.v)
    assert torch.equal(rows.positions, positions)


@pytest.mark.parametrize("custom, vericache, default, error", [
    ({"vc_compressor": "specache", "vc_kv_bits": 1}, True, "snapkv", None),
    ({"vc_compressor": "specache", "vc_kv_bits": 1, "specache_topk": 4}, True, None, None),
    ({"specache_topk": 8}, True, "specache", None),
    ({"vc_compressor": "specache", "vc_kv_bits": 1}, False, "kivi", "only a --speculative-algorithm VERICACHE"),
    ({"specache_topk": 8}, True, "snapkv", "would ignore it"),
    ({"specache_topk": 8}, False, None, "would ignore it"),
    ({"vc_compressor": "specache", "specache_topk": -1}, True, None, "integer >= 0"),
    ({"vc_compressor": "none", "specache_topk": 8}, True, "specache", "would ignore it"),
])
def test_per_request_drafter_choice(custom, vericache, default, error):
    if error is None:
        check_drafter_params(custom, vericache, default)
    else:
        with pytest.raises(ValueError, match=error):
            check_drafter_params(custom, vericache, default)


def test_draft_steps_after_the_first_use_rows_prefetched_by_the_step_before():
    """SpeCache's speculative fetch as VERICACHE's drafter: a request's first draft step
    fetches its own top-k synchronously; each step picks the rows its layer's next step
    will want, one copy job per forward brings them, and the next step attends with
    exactly those full-precision rows, fetching nothing itself."""
    import types

    from sglang_vc import stats

    g = torch.Generator().manual_seed(1)
    n, heads, q_heads, dim, topk, lid = 24, 2, 4, 8, 3, 0
    k_full, v_full = torch.randn(n + 2, heads, dim, generator=g), torch.randn(n + 2, heads, dim, generator=g)
    host = HostKVStore()
    assert host.admit("r", 0, 0, n, 0)
    host.sink("r", 0, lid, 0, k_full[:n], v_full[:n])
    host.flush()
    # the low-bit copy of [0, n): the full rows plus noise; the tail [n, n + 2) in the pool
    kq = k_full[:n] + 0.5 * torch.randn(n, heads, dim, generator=g)
    vq = v_full[:n] + 0.5 * torch.randn(n, heads, dim, generator=g)
    req_to_token = torch.zeros(1, 32, dtype=torch.int32)
    req_to_token[0, : n + 2] = torch.arange(n + 2)
    pool = types.SimpleNamespace(get_key_buffer=lambda l: k_full, get_value_buffer=lambda l: v_full)
    runtime = types.SimpleNamespace(payload_kv=lambda entry, l: (kq, vq), kv_pool=pool, req_to_token=req_to_token)
    entry = types.SimpleNamespace(payload=object(), rid="r", req_pool_idx=0, num_payload_rows=n)
    layer = types.SimpleNamespace(layer_id=lid, scaling=dim ** -0.5)
    drafter = SpeCacheDrafter(host, runtime, topk)

    def sync_fetches():
        return stats.snapshot().get("vericache", {}).get("specache_sync_fetches", 0)

    q1, q2 = torch.randn(1, q_heads, dim, generator=g), torch.randn(1, q_heads, dim, generator=g)
    before = sync_fetches()
    out1 = drafter.attend(q1, entry, layer, n + 1)
    assert sync_fetches() == before + 1  # nothing prefetched yet
    fetch = lambda pos: core.gather_rows(k_full, v_full, pos)  # noqa: E731
    want1, _ = core.attend_fetching(q1, kq, vq, k_full[n : n + 1], v_full[n : n + 1], q_start=n,
                                    scale=layer.scaling, topk=topk, fetch=fetch)
    assert torch.allclose(out1, want1.out)
    drafter.end_forward()  # the forward's one copy job
    out2 = drafter.attend(q2, entry, layer, n + 2)
    assert sync_fetches() == before + 1  # step 2 fetched nothing itself
    picked = core.select_topk(want1.probs[0], heads, topk)  # what step 1 chose for step 2
    want2 = core.attend(q2, kq, vq, k_full[n : n + 2], v_full[n : n + 2], q_start=n + 1, scale=layer.scaling,
                        rows=core.gather_rows(k_full, v_full, picked))
    assert torch.allclose(out2, want2.out)
    # and not what the low-bit copy alone gives
    assert not torch.allclose(out2, core.attend(q2, kq, vq, k_full[n : n + 2], v_full[n : n + 2], q_start=n + 1,
                                                scale=layer.scaling).out)
