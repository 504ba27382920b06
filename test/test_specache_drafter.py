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
    ({"vc_compressor": "specache", "specache_topk": -1}, True, None, r"integer in \[0, 4096\]"),
    ({"vc_compressor": "specache", "specache_topk": 2**31}, True, None, r"integer in \[0, 4096\]"),
    ({"vc_compressor": "none", "specache_topk": 8}, True, "specache", "would ignore it"),
])
def test_per_request_drafter_choice(custom, vericache, default, error):
    if error is None:
        check_drafter_params(custom, vericache, default)
    else:
        with pytest.raises(ValueError, match=error):
            check_drafter_params(custom, vericache, default)
