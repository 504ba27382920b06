"""The mechanisms' CUDA paths run sgl-kernel-ext's Triton kernels. No GPU here: a stand-in
CUDA platform (``sgl_kernel_ext.dispatch.is_cuda_tensor`` answering yes for CPU tensors)
sends every dispatch to the Triton kernels, which then run in Triton's interpreter. Each
test checks that the kernel was launched and that the result equals the CPU (torch) path
of the same call."""

from __future__ import annotations

import types

import pytest
import torch

import sgl_kernel_ext as ext
from sglang_vc.compress.kivi import KIVI
from sglang_vc.kvruntime import kernels
from sglang_vc.kvruntime.backend import VCTorchAttnBackend
from sglang_vc.kvruntime.index import QuantPayload
from sglang_vc.kvruntime.runtime import KVRuntime
from sglang_vc.specache import core, fused


@pytest.fixture
def stand_in_cuda(monkeypatch):
    monkeypatch.delenv(ext.dispatch.ENV, raising=False)

    def enable():
        monkeypatch.setattr(ext.dispatch, "is_cuda_tensor", lambda t: True)
        ext.launches.clear()
        return ext.launches

    return enable


def test_runtime_attention_and_index_lists(stand_in_cuda):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(30, 2, 16, generator=g), torch.randn(30, 2, 16, generator=g)
    q = torch.randn(4, 6, 16, generator=g)
    pos = torch.cat([torch.arange(0, 8), torch.arange(12, 34)])[:30]
    row = torch.randint(1, 90, (40,), generator=g, dtype=torch.int32)
    row[5:9] = 0
    args = dict(num_prefix=3, key_positions=pos[3:], q_start=30, scale=0.25, enable_gqa=True)
    want = kernels.attend(q, k, v, **args)
    want_sel = kernels.attend(q, k, v, **{**args, "q_positions": torch.tensor([2, 9, 15, 33])})
    want_rows = kernels.live_rows(row, 2, 37)
    launches = stand_in_cuda()
    torch.testing.assert_close(kernels.attend(q, k, v, **args), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.attend(q, k, v, **args, q_positions=torch.tensor([2, 9, 15, 33])), want_sel,
                               atol=1e-5, rtol=1e-5)
    got_rows = kernels.live_rows(row, 2, 37)
    assert torch.equal(got_rows[0], want_rows[0]) and torch.equal(got_rows[1], want_rows[1])
    assert launches["paged_attention"] == 2 and launches["build_kv_indices"] == 2


def test_compressed_decode_reads_pool_and_packed_payload(stand_in_cuda):
    """vc_torch's decode of a KIVI-compressed request: the Triton path (index list over the
    pool, payload dequantized in the kernel, merged) equals the runtime's torch path."""
    g = torch.Generator().manual_seed(1)
    n, h, hq, d = 90, 2, 6, 16
    k_all, v_all = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    qkv = KIVI(group_size=32, residual_length=16).compress(0, k_all[:80], v_all[:80], 2)
    n_q = qkv.num_quantized  # 64: positions [0, 64) are the payload
    k_buf, v_buf = torch.zeros(200, h, d), torch.zeros(200, h, d)
    slots = torch.arange(100, 100 + n - n_q)
    k_buf[slots], v_buf[slots] = k_all[n_q:], v_all[n_q:]
    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    req_to_token[2, n_q:n] = slots.to(torch.int32)
    entry = types.SimpleNamespace(req_pool_idx=2, row_start=n_q, payload=QuantPayload({0: qkv}, n_q),
                                  num_payload_rows=n_q)
    runtime = types.SimpleNamespace(packed_payload=lambda e, lid: KVRuntime.packed_payload(None, e, lid))
    backend = object.__new__(VCTorchAttnBackend)
    backend.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
    backend.token_to_kv_pool = types.SimpleNamespace(get_key_buffer=lambda lid: k_buf, get_value_buffer=lambda lid: v_buf)
    backend.runtime = runtime
    layer = types.SimpleNamespace(layer_id=0, scaling=0.25)
    q = torch.randn(1, hq, d, generator=g)

    assert backend._attend_compressed(q, entry, layer, n) is None  # CPU: the runtime's torch path
    kq, vq = KIVI.dequantize(qkv)
    want = kernels.attend(q, torch.cat([kq, k_all[n_q:]]), torch.cat([vq, v_all[n_q:]]), num_prefix=n_q,
                          key_positions=torch.arange(n_q, n), q_start=n - 1, scale=0.25, enable_gqa=True)
    launches = stand_in_cuda()
    got = backend._attend_compressed(q, entry, layer, n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert launches["kivi_attention"] == 1 and launches["paged_attention"] == 1


def test_specache_step_fused_equals_core(stand_in_cuda):
    """SpeCache's eq. 1 with prefetched rows substituted, and the next step's top-k: the
    fused Triton path equals ``core.attend`` (the CPU path)."""
    g = torch.Generator().manual_seed(2)
    n, h, hq, d = 100, 2, 4, 16
    k_all, v_all = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    from sglang_vc.compress.kivi1 import KIVI1

    qkv = KIVI1(group_size=32, residual_length=16).compress(0, k_all[:80], v_all[:80], 1)
    n_q = qkv.num_quantized
    k_buf, v_buf = torch.zeros(300, h, d), torch.zeros(300, h, d)
    tail = torch.arange(150, 150 + n - n_q)
    k_buf[tail], v_buf[tail] = k_all[n_q:], v_all[n_q:]
    positions = torch.stack([torch.randperm(n_q, generator=g)[:6].sort().values for _ in range(h)])
    rows = core.gather_rows(k_all[:n_q], v_all[:n_q], positions)
    q = torch.randn(2, hq, d, generator=g)
    kq, vq = KIVI.dequantize(qkv)
    want = core.attend(q, kq, vq, k_all[n_q:n - 1], v_all[n_q:n - 1], q_start=n - 2, scale=0.25, rows=rows)
    payload = KVRuntime.packed_payload(None, types.SimpleNamespace(payload=QuantPayload({0: qkv}, n_q)), 0)
    launches = stand_in_cuda()
    got = fused.attend(q, payload, k_buf, v_buf, tail[:-1], q_start=n - 2, scale=0.25, rows=rows)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
    for t in (0, 1):
        scores = got.head_scores(t, h)  # computed when asked: one kernel launch per call
        torch.testing.assert_close(scores, want.head_scores(t, h), atol=1e-6, rtol=1e-4)
        assert torch.equal(ext.select_topk(scores, 8), core.select_topk(want.probs[t], h, 8))
    assert launches["kivi_attention"] == 1 and launches["specache_scores"] == 2


def test_vericache_specache_drafter_fused_equals_core(stand_in_cuda):
    """VERICACHE's SpeCache drafter (low-bit payload, its own top-k rows fetched from the
    host copy, attended again): on the Triton path the fused kernels over the packed
    payload and the pool, with the same rows fetched and the same output as the CPU
    path (``core.attend_fetching`` over the dequantized payload)."""
    from sglang_vc.compress.specache_copy import SpeCacheCopy
    from sglang_vc.vericache.reload import HostKVStore
    from sglang_vc.vericache.specache_drafter import SpeCacheDrafter

    g = torch.Generator().manual_seed(9)
    n, h, hq, d = 120, 2, 6, 16
    k_all, v_all = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    qkv = SpeCacheCopy(group_size=32, residual_length=16).compress(0, k_all[:100], v_all[:100], 2)
    n_q = qkv.num_quantized
    k_buf, v_buf = torch.zeros(300, h, d), torch.zeros(300, h, d)
    req_to_token = torch.zeros(4, 160, dtype=torch.int32)
    slots = torch.arange(150, 150 + n - n_q)
    k_buf[slots], v_buf[slots] = k_all[n_q:], v_all[n_q:]
    req_to_token[3, n_q:n] = slots.to(torch.int32)
    host = HostKVStore(pin=False)
    assert host.admit("r", 3, 0, n, 0)
    host.sink("r", 3, 0, 0, k_all, v_all)
    host.flush()
    entry = types.SimpleNamespace(rid="r", req_pool_idx=3, payload=QuantPayload({0: qkv}, n_q), num_payload_rows=n_q)
    runtime = types.SimpleNamespace(
        kv_pool=types.SimpleNamespace(get_key_buffer=lambda lid: k_buf, get_value_buffer=lambda lid: v_buf),
        req_to_token=req_to_token, payload_kv=lambda e, lid: KIVI.dequantize(qkv),
        packed_payload=lambda e, lid: KVRuntime.packed_payload(None, e, lid))
    layer = types.SimpleNamespace(layer_id=0, scaling=0.25)
    q = torch.randn(1, hq, d, generator=g)
    fetched = []

    class Drafter(SpeCacheDrafter):
        @staticmethod
        def _rows(host_entry, layer_id, positions, row, k_buf, v_buf):
            fetched.append(positions)
            return SpeCacheDrafter._rows(host_entry, layer_id, positions, row, k_buf, v_buf)

    drafter = Drafter(host, runtime, topk=8)
    want = drafter.attend(q, entry, layer, n)
    launches = stand_in_cuda()
    got = drafter.attend(q, entry, layer, n)
    assert torch.equal(fetched[0], fetched[1]) and fetched[0].shape == (h, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert launches["kivi_attention"] == 2 and launches["specache_scores"] == 1
    kq, vq = KIVI.dequantize(qkv)
    low = core.attend(q, kq, vq, k_all[n_q:], v_all[n_q:], q_start=n - 1, scale=0.25).out
    assert not torch.allclose(want, low, atol=1e-4), "the fetched rows changed the output"


def test_vericache_reload_assembly(stand_in_cuda):
    from sglang_vc.vericache.reload import Span

    g = torch.Generator().manual_seed(3)
    n, h, d = 20, 2, 8
    full = torch.randn(n, h, d, generator=g)
    kept = torch.stack([torch.randperm(n, generator=g)[:7].sort().values for _ in range(h)])
    dropped = torch.stack([torch.tensor(sorted(set(range(n)) - set(kept[i].tolist()))) for i in range(h)])
    pool = torch.zeros(30, h, d)
    pool[10:17] = full.gather(0, kept.t().unsqueeze(-1).expand(-1, -1, d))
    rows = full.gather(0, dropped.t().unsqueeze(-1).expand(-1, -1, d))
    span = Span(0, n, rows, rows, kept, dropped)
    launches = stand_in_cuda()
    assert torch.equal(span.full(pool, pool, torch.arange(10, 30))[0], full)
    assert launches["scatter_head_rows"] == 4  # kept and dropped, for K and V


def _mixed_batch(g, backend_cls, hq: int, layers: int, ends: tuple[int, int, int]):
    """A pool with a KIVI-compressed request (row 5: payload for positions [0, 64)), a
    token-dropped one (row 2: [30, 50) null) and an uncompressed one (row 6), filled up
    to ``ends``, and a ``backend_cls`` over it whose full-KV backend is torch_native."""
    from sglang_vc.kvruntime import make_spec
    from sglang_vc.kvruntime.index import CompressedKVIndex
    from sglang_vc.kvruntime.names import NULL_SLOT

    h, d = 2, 16
    k_buf = [torch.randn(400, h, d, generator=g) for _ in range(layers)]
    v_buf = [torch.randn(400, h, d, generator=g) for _ in range(layers)]
    req_to_token = torch.zeros(8, 160, dtype=torch.int32)
    slots = torch.randperm(399, generator=g)[: sum(ends)] + 1
    req_to_token[5, 64 : ends[0]] = slots[: ends[0] - 64].to(torch.int32)
    req_to_token[2, : ends[1]] = slots[ends[0] - 64 : ends[0] - 64 + ends[1]].to(torch.int32)
    req_to_token[2, 30:50] = NULL_SLOT
    req_to_token[6, : ends[2]] = slots[ends[0] - 64 + ends[1] : ends[0] - 64 + ends[1] + ends[2]].to(torch.int32)
    k_all = torch.randn(100, h, d, generator=g)
    payload = {lid: KIVI(group_size=32, residual_length=16).compress(lid, k_all[:80], k_all[:80].flip(0), 2)
               for lid in range(layers)}
    assert payload[0].num_quantized == 64
    kivi = CompressedKVIndex("a", 5, make_spec("kivi", bits=2), 100, 0, row_start=64, attend_from=64,
                             payload=QuantPayload(payload, 64), quantized_tokens=64)
    dropped = CompressedKVIndex("b", 2, make_spec("snapkv", ratio=0.7), 70, 0, row_start=0, attend_from=70,
                                tokens_kept=50)
    runtime = object.__new__(KVRuntime)
    runtime.kv_pool = types.SimpleNamespace(get_key_buffer=lambda lid: k_buf[lid], get_value_buffer=lambda lid: v_buf[lid])
    runtime.req_to_token = req_to_token
    runtime.index = {5: kivi, 2: dropped}
    runtime.last_layer = layers  # no end_forward in these tests
    runtime.batch = None  # no forward before
    backend = object.__new__(backend_cls)
    backend.runtime = runtime
    backend.full_kv = None  # the CPU's full-KV backend: torch_native, the class's own base
    backend.translator = None
    backend.device = "cpu"
    backend.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
    backend.token_to_kv_pool = runtime.kv_pool
    backend.use_sliding_window_kv_pool = False
    layer = [types.SimpleNamespace(layer_id=lid, tp_q_head_num=hq, tp_k_head_num=h, qk_head_dim=d, v_head_dim=d,
                                   scaling=0.25, is_cross_attention=False, attn_type=None, sliding_window_size=None)
             for lid in range(layers)]
    return backend, layer, k_buf, v_buf, req_to_token


def test_decode_batch_is_one_launch_per_layer(stand_in_cuda):
    """A decode batch mixing a KIVI-compressed request, a token-dropped one (null slots in
    its row) and an uncompressed one: on the Triton path the index lists are built once
    per forward and each layer is one paged attention launch over all three (plus the
    quantized request's payload kernel); the output equals vc_torch's per-request loop."""
    g = torch.Generator().manual_seed(4)
    hq, d, layers = 6, 16, 2
    seq_lens = [100, 70, 40]
    rows = [5, 2, 6]
    backend, layer, *_ = _mixed_batch(g, VCTorchAttnBackend, hq, layers, tuple(seq_lens))
    fb = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False,
                                           is_target_verify=lambda: False),
        rids=["a", "b", "c"], req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens), out_cache_loc=None)
    q = [torch.randn(3, hq * d, generator=g) for _ in range(layers)]

    backend.init_forward_metadata(fb)
    assert backend.decode_index is None  # the CPU: the per-request torch loop
    want = [backend.forward_decode(q[lid], None, None, layer[lid], fb, save_kv_cache=False) for lid in range(layers)]
    launches = stand_in_cuda()
    backend.init_forward_metadata(fb)
    assert backend.decode_index is not None
    got = [backend.forward_decode(q[lid], None, None, layer[lid], fb, save_kv_cache=False) for lid in range(layers)]
    for lid in range(layers):
        torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5)
    # the index kernel (count + write) once for the forward; per layer one attention
    # launch for the three requests and one payload launch for every quantized one
    assert launches["build_kv_indices"] == 2
    assert launches["paged_attention"] == layers and launches["kivi_attention_batch"] == layers, launches
    assert not launches["kivi_attention"], launches


def test_speccache_reused_rows_fill(stand_in_cuda):
    """SpecCache's prefill fills a request's slots with its chunks' cached rows (the
    unselected ones, keys re-rotated to the chunk's position) through the row-copy kernel;
    the result equals the torch path's."""
    from sglang_vc.speccache import rope
    from sglang_vc.speccache.store import ChunkHit, ChunkStore, ServerPlan

    g = torch.Generator().manual_seed(5)
    h, d, layers = 2, 8, 2
    pool = {lid: (torch.randn(64, h, d, generator=g), torch.randn(64, h, d, generator=g)) for lid in range(layers)}
    angles = torch.rand(d // 2, generator=g)
    rotary = (lambda offset: (torch.cos(angles * offset), torch.sin(angles * offset)), True)
    selected = torch.zeros(20, dtype=torch.bool)
    selected[[1, 9, 12]] = True
    hits = [ChunkHit(0, 8, 8, indices=torch.arange(40, 48)), ChunkHit(8, 10, 7, indices=torch.arange(50, 57))]
    plan = ServerPlan("r", 20, (0, 8), (8, 18), selected, "speccache", 0.15, {}, [], hits=hits)
    row = torch.arange(1, 21)  # the request's slots for positions 0..19

    def fill():
        bufs = {lid: (k.clone(), v.clone()) for lid, (k, v) in pool.items()}
        reuse = ChunkStore._fill(plan, 0, 20, row, lambda l: bufs[l][0], lambda l: bufs[l][1], range(layers),
                                     rotary)
        return reuse, bufs

    want_reuse, want = fill()
    launches = stand_in_cuda()
    got_reuse, got = fill()
    assert torch.equal(got_reuse, want_reuse) and int(want_reuse.sum()) == 8 + 7 - 3
    for lid in range(layers):
        torch.testing.assert_close(got[lid][0], want[lid][0])
        assert torch.equal(got[lid][1], want[lid][1])
    # the second chunk's reused keys are its cached keys moved to position 8
    k_moved = rope.shift(pool[0][0][torch.tensor([50, 52, 53, 55, 56])], 8, *rotary)
    torch.testing.assert_close(got[0][0][row[[8, 10, 11, 13, 14]]], k_moved)
    assert launches["copy_rows"] == 2 * 2 * layers  # K and V, two chunks, each layer


def test_vericache_forward_drafters_are_one_launch_and_full_kv_is_sglangs_extend(stand_in_cuda):
    """VERICACHE's one forward per iteration (a ragged TARGET_VERIFY batch): a KIVI and a
    token-dropped request draft one token each, an uncompressed request forwards three.
    On the Triton path the drafters are one paged attention launch per layer (index lists
    built once per forward) plus the quantized one's payload kernel, equal to the CPU's
    per-request path; the uncompressed request runs SGLang's own extend (torch_native
    here) over its row and equals causal attention over its full KV."""
    from sglang_vc.vericache.attention import VeriCacheAttnBackend

    g = torch.Generator().manual_seed(5)
    hq, d, layers = 4, 16, 2
    starts, lens, rows = [100, 70, 40], [1, 1, 3], [5, 2, 6]
    backend, layer, k_buf, v_buf, req_to_token = _mixed_batch(g, VeriCacheAttnBackend, hq, layers, (101, 71, 43))
    positions = torch.tensor([100, 70, 40, 41, 42])
    fb = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True,
                                           is_target_verify=lambda: True),
        rids=["a", "b", "c"], req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(starts),
        seq_lens_cpu=torch.tensor(starts), positions=positions, encoder_lens=None, batch_size=3,
        out_cache_loc=torch.zeros(5, dtype=torch.int64),
        spec_info=types.SimpleNamespace(ragged_verify_layout=types.SimpleNamespace(verify_lens_cpu=lens)))
    q = [torch.randn(5, hq * d, generator=g) for _ in range(layers)]

    def forward():
        backend.init_forward_metadata(fb)
        return [backend.forward_extend(q[lid], None, None, layer[lid], fb, save_kv_cache=False) for lid in range(layers)]

    want = forward()
    assert backend.verify_forward.draft_index is None  # the CPU: per request
    launches = stand_in_cuda()
    got = forward()
    counted = dict(launches)  # before the reference below launches its own
    assert backend.verify_forward.draft_index is not None
    for lid in range(layers):
        torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5)
        # the uncompressed request: causal attention over its full row
        row = req_to_token[6, :43].long()
        ref = kernels.attend(q[lid][2:5].view(3, hq, d), k_buf[lid][row], v_buf[lid][row], num_prefix=0,
                             key_positions=torch.arange(43), q_start=40, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(got[lid][2:5], ref.reshape(3, -1), atol=1e-5, rtol=1e-5)
    assert counted["build_kv_indices"] == 2  # count + write, once for the forward
    assert counted["paged_attention"] == layers and counted["kivi_attention_batch"] == layers, counted
