"""VERICACHE's SpeCache drafter for a whole batch on the Triton path
(``SpeCacheDrafter.attend_batch``: a table of payload addresses, one top-k for every
request and KV head, the rows read from the pool or the host copy by one kernel) equals
the per-request drafter of the CPU path, request by request, in a batch that mixes
payload lengths, a tree-shared prefix, a request without a host copy (no fetch) and a
request with its own top-k. No GPU here: a stand-in CUDA platform sends the batched
calls to the Triton kernels, run in Triton's interpreter."""

from __future__ import annotations

import types

import pytest
import torch

import sgl_kernel_ext as ext
from sglang_vc import stats
from sglang_vc.compress.kivi import KIVI
from sglang_vc.compress.specache_copy import SpeCacheCopy
from sglang_vc.kvruntime.index import QuantPayload
from sglang_vc.kvruntime.runtime import KVRuntime
from sglang_vc.specache.requests import TOPK_KEY
from sglang_vc.vericache.reload import HostKVStore
from sglang_vc.vericache.specache_drafter import SpeCacheDrafter

H, HQ, D, LAYERS = 2, 6, 16, 2
# (rid, row, prompt length, tree-shared prefix p, host copy kept, own top-k)
REQUESTS = [("a", 3, 150, 0, True, None), ("b", 0, 260, 64, True, None), ("c", 2, 120, 0, False, None),
            ("d", 5, 200, 0, True, 3)]
TOPK = 8


class _Recording(SpeCacheDrafter):
    """Records the positions the per-request path fetches, per request."""

    fetched: dict

    @staticmethod
    def _rows(host_entry, layer_id, positions, row, k_buf, v_buf):
        _Recording.fetched.setdefault(host_entry.rid, []).append(positions)
        return SpeCacheDrafter._rows(host_entry, layer_id, positions, row, k_buf, v_buf)


def _batch_fixture():
    _Recording.fetched = {}
    g = torch.Generator().manual_seed(11)
    k_buf = [torch.zeros(1500, H, D) for _ in range(LAYERS)]
    v_buf = [torch.zeros(1500, H, D) for _ in range(LAYERS)]
    req_to_token = torch.zeros(6, 300, dtype=torch.int32)
    host = HostKVStore(pin=False)
    entries, seq_lens, next_slot = [], [], 1
    for rid, row, n, p, keep_host, _ in REQUESTS:
        layers = {}
        for lid in range(LAYERS):
            k_all, v_all = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
            qkv = SpeCacheCopy(group_size=32, residual_length=16).compress(0, k_all, v_all, 2)
            layers[lid] = qkv
            n_q = qkv.num_quantized
            if lid == 0:
                slots = torch.arange(next_slot, next_slot + n)  # every row has a slot: [0, p) stays full
                next_slot += n
                req_to_token[row, :n] = slots.to(torch.int32)
            k_buf[lid][slots], v_buf[lid][slots] = k_all, v_all
            if keep_host:
                host.sink(rid, row, lid, p, k_all, v_all)
        host.flush()
        entries.append(types.SimpleNamespace(rid=rid, req_pool_idx=row, payload=QuantPayload(layers, n_q),
                                             num_payload_rows=n_q))
        seq_lens.append(n)
    runtime = types.SimpleNamespace(
        kv_pool=types.SimpleNamespace(get_key_buffer=lambda lid: k_buf[lid], get_value_buffer=lambda lid: v_buf[lid]),
        req_to_token=req_to_token, payload_kv=lambda e, lid: KIVI.dequantize(e.payload.layers[lid]),
        packed_payload=lambda e, lid: KVRuntime.packed_payload(None, e, lid))
    drafter = _Recording(host, runtime, topk=TOPK)
    for (rid, *_, own_topk), e in zip(REQUESTS, entries):
        if own_topk is not None:
            drafter.set_request(rid, {TOPK_KEY: own_topk})
    return drafter, entries, seq_lens, g


def test_attend_batch_equals_per_request_drafter(monkeypatch):
    if ext.dispatch.interpreter_problem():
        pytest.skip(ext.dispatch.interpreter_problem())
    monkeypatch.delenv(ext.dispatch.ENV, raising=False)
    drafter, entries, seq_lens, g = _batch_fixture()
    assert drafter.topk_of["d"] == 3
    q = [torch.randn(len(entries), HQ, D, generator=g) for _ in range(LAYERS)]
    layers = [types.SimpleNamespace(layer_id=lid, scaling=D ** -0.5) for lid in range(LAYERS)]
    # the CPU path: per request, the dequantized payload, the rows fetched from the host copy
    want = [torch.cat([drafter.attend(q[lid][i : i + 1], e, layers[lid], n)
                       for i, (e, n) in enumerate(zip(entries, seq_lens))]) for lid in range(LAYERS)]
    # b's tree-shared prefix [0, 64) is read from the pool: some of its rows were chosen
    assert any(bool((pos < 64).any()) for pos in _Recording.fetched["b"]) and "c" not in _Recording.fetched
    # the fetch changed the drafts: without it (top-k 0) the outputs differ
    plain = SpeCacheDrafter(drafter.host, drafter.runtime, topk=0)
    low = plain.attend(q[0][:1], entries[0], layers[0], seq_lens[0])
    assert not torch.allclose(low, want[0][:1], atol=1e-4)

    monkeypatch.setattr(ext.dispatch, "is_cuda_tensor", lambda t: True)  # the stand-in CUDA platform
    ext.launches.clear()
    before = stats.snapshot().get("vericache", {}).get("specache_rows_fetched", 0)
    misses = stats.snapshot().get("vericache", {}).get("specache_fetch_misses", 0)
    (sb,) = drafter.batch(entries, seq_lens, "cpu")
    assert sb.members == [0, 1, 2, 3] and sb.topk.tolist() == [TOPK, TOPK, 0, 3]  # c: no host copy
    got = [drafter.attend_batch(q[lid], sb, layers[lid]) for lid in range(LAYERS)]
    for lid in range(LAYERS):
        torch.testing.assert_close(got[lid], want[lid].float(), atol=1e-5, rtol=1e-5)
    assert ext.launches["specache_fetch_rows"] == LAYERS and ext.launches["kivi_attention_batch"] == 2 * LAYERS
    after = stats.snapshot()["vericache"]["specache_rows_fetched"]
    assert after - before == LAYERS * H * (TOPK + TOPK + 0 + 3)
    # c has no host copy: one miss per layer, as the per-request path counts it
    assert stats.snapshot()["vericache"]["specache_fetch_misses"] - misses == LAYERS
