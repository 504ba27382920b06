"""sgl-kernel-ext: every Triton kernel against its torch reference, run through Triton's
interpreter on this CPU (``SGL_KERNEL_EXT_BACKEND=triton``), on random tensors and on
real KV of the embedded model; and each reference against the project's own torch path
(``kvruntime.kernels.attend``, KIVI's dequantization, SpeCache's ``core``, VeriCache's
reload assembly), so that the kernels compute what the mechanisms compute."""

from __future__ import annotations

import pytest
import torch

import sgl_kernel_ext as ext
from sgl_kernel_ext.copy_rows import copy_rows_reference
from sgl_kernel_ext.kivi_attention import dequantize as kivi_dequantize
from sgl_kernel_ext.kivi_attention import reference as kivi_reference
from sgl_kernel_ext.kv_indices import reference as kv_indices_reference
from sgl_kernel_ext.paged_attention import reference as paged_reference
from sgl_kernel_ext.position_mask import reference as mask_reference
from sgl_kernel_ext.specache_topk import reference as scores_reference

from sglang_vc.compress.kivi import KIVI
from sglang_vc.compress.kivi1 import KIVI1
from sglang_vc.kvruntime import kernels
from sglang_vc.specache import core


@pytest.fixture
def triton_backend(monkeypatch):
    if ext.dispatch.interpreter_problem():
        pytest.skip(ext.dispatch.interpreter_problem())
    monkeypatch.setenv(ext.dispatch.ENV, "triton")
    ext.launches.clear()
    return ext.launches


@pytest.fixture(scope="module")
def real_kv(model_dir):
    """K/V of layer 4 of the embedded model over a real text: ``[N, Hkv, D]`` each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    text = open(kernels.__file__).read()[:1500]
    ids = tok(text, return_tensors="pt")["input_ids"][:, :160]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    k, v = cache.layers[4].keys[0], cache.layers[4].values[0]  # [Hkv, N, D]
    return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), model.config


def _payload(qkv, d: int, dv: int) -> ext.Payload:
    return ext.Payload(qkv.bits, qkv.group_size, qkv.value_group_size, qkv.k_payload, qkv.k_scales, qkv.k_zeros,
                       qkv.v_payload, qkv.v_scales, qkv.v_zeros, d, dv)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(ext.dispatch.ENV, raising=False)
    assert ext.backend_for(torch.zeros(1)) is ext.Backend.TORCH
    monkeypatch.setattr(ext.dispatch, "is_cuda_tensor", lambda t: True)  # a stand-in CUDA platform
    assert ext.backend_for(torch.zeros(1)) is ext.Backend.TRITON
    monkeypatch.setenv(ext.dispatch.ENV, "torch")
    assert ext.backend_for(torch.zeros(1)) is ext.Backend.TORCH
    monkeypatch.setenv(ext.dispatch.ENV, "cuda")
    with pytest.raises(ValueError, match="must be 'triton' or 'torch'"):
        ext.backend_for(torch.zeros(1))


def test_kv_indices_skip_null_slots(triton_backend):
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(1, 500, (4, 300), generator=g, dtype=torch.int32)
    req_to_token[req_to_token % 3 == 0] = 0  # dropped tokens point at the null slot
    rows, starts, ends = torch.tensor([2, 0, 3]), torch.tensor([0, 17, 5]), torch.tensor([300, 200, 6])
    got = ext.build_kv_indices(req_to_token, rows, starts, ends, null_slot=0)
    want = kv_indices_reference(req_to_token, rows, starts, ends, 0)
    assert triton_backend["build_kv_indices"] == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert int(want.indptr[-1]) == sum(int((req_to_token[r, s:e] != 0).sum()) for r, s, e in [(2, 0, 300), (0, 17, 200), (3, 5, 6)])

    # the lengths given by the host: no host read of device values, room for every row,
    # the live entries the same and the rest unused
    from sglang_vc.kvruntime.syncs import SyncCounter

    with SyncCounter() as syncs:
        sized = ext.build_kv_indices(req_to_token, rows, starts, ends, null_slot=0, spans=[300, 183, 1])
    assert syncs.total == 0, syncs.by_kind
    total = int(want.indptr[-1])
    assert sized.indices.numel() == 300 + 183 + 1 > total
    assert torch.equal(sized.indptr, want.indptr)
    assert torch.equal(sized.indices[:total], want.indices) and torch.equal(sized.positions[:total], want.positions)


def _paged_case(k_buf, v_buf, gen, hq):
    """Three requests over a shared pool: a decode, an extend of 5 queries, and a
    selective prefill (queries at scattered positions) with a 4-row prefix (position -1)."""
    n_slots = k_buf.shape[0]
    perm = torch.randperm(n_slots - 1, generator=gen) + 1
    lens = [40, 30, 25]
    slots, pos, indptr = [], [], [0]
    off = 0
    for i, n in enumerate(lens):
        s = perm[off : off + n]
        off += n
        p = torch.arange(n)
        if i == 0:
            p = torch.cat([p[:10], p[20:]])  # a compressed node: positions 10..19 dropped
            s = s[: p.numel()]
        if i == 2:
            p = torch.cat([torch.full((4,), -1), p[:-4]])
        slots.append(s)
        pos.append(p)
        indptr.append(indptr[-1] + s.numel())
    q_req = torch.tensor([0] + [1] * 5 + [2] * 3)
    q_pos = torch.tensor([39] + list(range(25, 30)) + [3, 11, 20])
    q = torch.randn(q_req.numel(), hq, k_buf.shape[2], generator=gen)
    return q, q_req, q_pos, torch.tensor(indptr), torch.cat(slots), torch.cat(pos)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 48)])
def test_paged_attention_matches_reference_and_sdpa(triton_backend, hq, hkv, d):
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(128, hkv, d, generator=g), torch.randn(128, hkv, d, generator=g)
    q, q_req, q_pos, indptr, idx, pos = _paged_case(k_buf, v_buf, g, hq)
    out, lse = ext.paged_attention(q, k_buf, v_buf, q_req, q_pos, indptr, idx, pos, 0.125)
    ref_out, ref_lse = paged_reference(q, k_buf, v_buf, q_req, q_pos, indptr, idx, pos, 0.125)
    assert triton_backend["paged_attention"] == 1
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # the reference is the runtime's own attention (kvruntime.kernels.attend, SDPA)
    for b in range(3):
        sel = (q_req == b).nonzero().flatten()
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        n_prefix = int((pos[rows] < 0).sum())
        k_r, v_r = kernels.gather_kv(k_buf, v_buf, idx[rows])
        want = kernels.attend(q[sel], k_r, v_r, num_prefix=n_prefix, key_positions=pos[rows][n_prefix:],
                              q_start=int(q_pos[sel[0]]), scale=0.125, enable_gqa=hq != hkv,
                              q_positions=q_pos[sel] if b == 2 else None)
        torch.testing.assert_close(ref_out[sel], want, atol=1e-5, rtol=1e-5)


def test_paged_attention_splits_long_kv_per_gqa_group(triton_backend):
    """Requests long enough to spread over several KV splits (one short, one empty, one
    whose visible keys all lie in its first split, one with a prefix of always-visible
    rows), GQA 4:1 and 2:2 groups: the merged splits equal the reference."""
    from sgl_kernel_ext.paged_attention import SPLIT_ROWS, num_splits

    g = torch.Generator().manual_seed(3)
    lens = [1500, 40, 0, 900, 700]
    n_slots = sum(lens) + 1
    for hq, hkv, d in ((8, 2, 64), (4, 2, 32)):
        k_buf, v_buf = torch.randn(n_slots, hkv, d, generator=g), torch.randn(n_slots, hkv, d, generator=g)
        perm = torch.randperm(n_slots - 1, generator=g) + 1
        indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        pos = torch.cat([torch.arange(n) for n in lens])
        pos[indptr[4] : indptr[4] + 30] = -1  # a quantized prefix's rows: visible to every query
        q_req = torch.tensor([0, 0, 1, 2, 3, 4])
        q_pos = torch.tensor([1499, 600, 39, 0, 100, 699])  # request 3: only keys 0..100 visible
        q = torch.randn(q_req.numel(), hq, d, generator=g)
        args = (q, k_buf, v_buf, q_req, q_pos, indptr, perm, pos, d ** -0.5)
        assert num_splits(perm.numel(), len(lens)) == -(-(-(-perm.numel() // len(lens))) // SPLIT_ROWS) > 1
        triton_backend.clear()
        out, lse = ext.paged_attention(*args)
        ref_out, ref_lse = paged_reference(*args)
        assert triton_backend["paged_attention"] == 1 and triton_backend["paged_attention_reduce"] == 1
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert torch.isinf(lse[3]).all() and not out[3].any()  # the empty request: no key


def test_paged_attention_real_kv(triton_backend, real_kv):
    k, v, config = real_kv
    hq = config.num_attention_heads
    n = k.shape[0]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, hq, k.shape[2], generator=g) * k.abs().mean()
    indptr = torch.tensor([0, n])
    idx, pos = torch.arange(n), torch.arange(n)
    args = (q, k, v, torch.tensor([0, 0]), torch.tensor([n - 1, n // 2]), indptr, idx, pos, k.shape[2] ** -0.5)
    out, lse = ext.paged_attention(*args)
    ref_out, ref_lse = paged_reference(*args)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantizer", [KIVI(group_size=32, residual_length=16), KIVI1(group_size=32, residual_length=16)],
                         ids=["kivi2", "kivi1"])
def test_kivi_attention_real_kv(triton_backend, real_kv, quantizer):
    k, v, config = real_kv
    qkv = quantizer.compress(0, k, v, quantizer.supported_bits[0])
    assert qkv.num_quantized == 128 and qkv.bits in (1, 2)
    p = _payload(qkv, k.shape[2], v.shape[2])
    hq = config.num_attention_heads
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, hq, k.shape[2], generator=g) * k.abs().mean()
    scale = k.shape[2] ** -0.5
    out, lse = ext.kivi_attention(q, p, scale)
    ref_out, ref_lse = kivi_reference(q, p, scale)
    assert triton_backend["kivi_attention"] == 1
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # the reference dequantizes as KIVI does
    kq, vq = KIVI.dequantize(qkv)
    assert torch.equal(kivi_dequantize(p)[0], kq) and torch.equal(kivi_dequantize(p)[1], vq)

    # payload (fused) + residual (paged) merged == attention over [dequantized ++ residual]
    n_r = qkv.residual_length
    tail_out, tail_lse = ext.paged_attention(q, qkv.k_residual, qkv.v_residual, torch.zeros(3, dtype=torch.int64),
                                             torch.full((3,), 10**6), torch.tensor([0, n_r]), torch.arange(n_r),
                                             torch.arange(n_r), scale)
    merged, _ = ext.merge_state(out, lse, tail_out, tail_lse)
    want = kernels.attend(q, torch.cat([kq, qkv.k_residual]), torch.cat([vq, qkv.v_residual]), num_prefix=0,
                          key_positions=torch.arange(k.shape[0]), q_start=k.shape[0], scale=scale,
                          enable_gqa=True)
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits,group,value_group", [(2, 16, 24), (4, 64, 16), (8, 32, 48)],
                         ids=["group-below-block,value-group-not-pow2", "4bit-pow2", "8bit-whole-row"])
def test_kivi_attention_any_payload_layout(triton_backend, bits, group, value_group):
    """The fused kernel's general paths: a key group smaller than its row block (scales
    per row, not one per block), value groups that are not a power of two (scales per
    channel, not broadcast), 4- and 8-bit codes; 200 rows, so several splits and a
    partial block. Each equals the torch reference."""
    g = torch.Generator().manual_seed(7)
    n, h, d, hq = 192, 2, 48, 6
    per = 8 // bits
    codes = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    p = ext.Payload(bits, group, value_group, codes(n, h, -(-d // per)), rand(n // group, h, d), rand(n // group, h, d),
                    codes(n, h, -(-d // per)), rand(n, h, d // value_group), rand(n, h, d // value_group), d, d)
    q = torch.randn(2, hq, d, generator=g)
    exclude = torch.rand(h, n, generator=g) < 0.2
    for excl in (None, exclude):
        out, lse = ext.kivi_attention(q, p, d ** -0.5, exclude=excl)
        ref_out, ref_lse = kivi_reference(q, p, d ** -0.5, excl)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=5e-5)  # 8-bit values reach ~250
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=5e-5)
    scores = ext.payload_scores(q[0], lse[0], p, d ** -0.5)
    torch.testing.assert_close(scores, scores_reference(q[0], lse[0], p, d ** -0.5), atol=1e-6, rtol=5e-5)
    assert triton_backend["kivi_attention"] == 2 and triton_backend["specache_scores"] == 1


def test_kivi_attention_exclude_and_specache_topk(triton_backend, real_kv):
    """SpeCache eq. 1 and its top-k: the payload with some rows excluded (attended in full
    precision instead), merged, equals ``specache.core.attend`` with those rows
    substituted; the scores' top-k equals ``core.select_topk``."""
    k, v, config = real_kv
    quantizer = KIVI1(group_size=32, residual_length=16)
    qkv = quantizer.compress(0, k, v, 1)
    p = _payload(qkv, k.shape[2], v.shape[2])
    kq, vq = KIVI.dequantize(qkv)
    hq, hkv = config.num_attention_heads, k.shape[1]
    scale = k.shape[2] ** -0.5
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, hq, k.shape[2], generator=g) * k.abs().mean()
    positions = torch.stack([torch.randperm(qkv.num_quantized, generator=g)[:8].sort().values for _ in range(hkv)])
    rows = core.gather_rows(k[: qkv.num_quantized], v[: qkv.num_quantized], positions)
    exclude = torch.zeros(hkv, qkv.num_quantized, dtype=torch.bool).scatter_(1, positions, True)

    pay_out, pay_lse = ext.kivi_attention(q, p, scale, exclude=exclude)
    ref_out, ref_lse = kivi_reference(q, p, scale, exclude)
    torch.testing.assert_close(pay_out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pay_lse, ref_lse, atol=1e-5, rtol=1e-5)
    # the substituted rows: per KV head its own rows, all visible
    sub_out, sub_lse = zip(*[
        ext.paged_attention(q[:, h * (hq // hkv) : (h + 1) * (hq // hkv)], rows.k[:, h : h + 1], rows.v[:, h : h + 1],
                            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                            torch.tensor([0, 8]), torch.arange(8), torch.full((8,), -1), scale)
        for h in range(hkv)])
    n_r = qkv.residual_length
    tail_out, tail_lse = ext.paged_attention(q, qkv.k_residual, qkv.v_residual, torch.zeros(1, dtype=torch.int64),
                                             torch.tensor([k.shape[0]]), torch.tensor([0, n_r]), torch.arange(n_r),
                                             torch.arange(n_r), scale)
    o, lse = ext.merge_state(pay_out, pay_lse, torch.cat(sub_out, dim=1), torch.cat(sub_lse, dim=1))
    o, lse = ext.merge_state(o, lse, tail_out, tail_lse)
    want = core.attend(q, kq, vq, qkv.k_residual, qkv.v_residual, q_start=k.shape[0], scale=scale, rows=rows)
    torch.testing.assert_close(o, want.out, atol=1e-5, rtol=1e-5)

    scores = ext.payload_scores(q[0], lse[0], p, scale, exclude=exclude)
    torch.testing.assert_close(scores, scores_reference(q[0], lse[0], p, scale, exclude), atol=1e-6, rtol=1e-5)
    assert triton_backend["specache_scores"] == 1
    # the substituted rows' own probabilities are the caller's to add
    sub_probs = torch.stack([torch.exp(torch.einsum("gd,nd->gn", q[0, h * (hq // hkv) : (h + 1) * (hq // hkv)],
                                                    rows.k[:, h]) * scale
                                       - lse[0, h * (hq // hkv) : (h + 1) * (hq // hkv), None]).sum(0)
                             for h in range(hkv)])
    scores.scatter_add_(1, positions, sub_probs)
    want_scores = core.head_scores(want.probs[0], hkv)
    torch.testing.assert_close(scores, want_scores, atol=1e-6, rtol=1e-4)
    assert torch.equal(ext.select_topk(scores, 16), core.select_topk(want.probs[0], hkv, 16))


def test_copy_rows_and_reload_scatter(triton_backend):
    from sglang_vc.vericache.reload import Span

    g = torch.Generator().manual_seed(5)
    src, dst = torch.randn(50, 3, 16, generator=g), torch.randn(60, 3, 16, generator=g)
    src_idx, dst_idx = torch.randperm(50, generator=g)[:20], torch.randperm(60, generator=g)[:20]
    got = ext.copy_rows(dst.clone(), dst_idx, src, src_idx)
    assert torch.equal(got, copy_rows_reference(dst.clone(), dst_idx, src, src_idx))
    assert triton_backend["copy_rows"] == 1

    # VeriCache's reload: kept rows (in the pool) and dropped rows (from the host), each
    # head its own positions, assembled into the verify's full rows
    n, h, d = 24, 3, 16
    full = torch.randn(n, h, d, generator=g)
    kept = torch.stack([torch.randperm(n, generator=g)[:10].sort().values for _ in range(h)])
    dropped = torch.stack([torch.tensor(sorted(set(range(n)) - set(kept[i].tolist()))) for i in range(h)])
    kept_rows = full.gather(0, kept.t().unsqueeze(-1).expand(-1, -1, d))
    dropped_rows = full.gather(0, dropped.t().unsqueeze(-1).expand(-1, -1, d))
    out = torch.empty(n, h, d)
    ext.scatter_head_rows(out, kept, kept_rows)
    ext.scatter_head_rows(out, dropped, dropped_rows)
    assert triton_backend["scatter_head_rows"] == 2
    assert torch.equal(out, full)
    pool = torch.zeros(40, h, d)
    pool[torch.arange(5, 15)] = kept_rows
    span = Span(0, n, dropped_rows, dropped_rows, kept, dropped)
    assert torch.equal(span.full(pool, pool, torch.arange(5, 40))[0], full)

    # SpeCache's fetch: each head's own rows, gathered by index lists that stay where they are
    rows = ext.gather_head_rows(full, kept)
    assert triton_backend["gather_head_rows"] == 1
    assert torch.equal(rows, kept_rows)


def test_position_mask(triton_backend):
    q_pos, k_pos = torch.tensor([3, 11, 20, 7]), torch.tensor([0, 2, 3, 9, 11, 15, 20, 21])
    got = ext.position_mask(q_pos, k_pos, num_prefix=3)
    assert triton_backend["position_mask"] == 1
    assert torch.equal(got, mask_reference(q_pos, k_pos, 3))
    assert got[:, :3].all() and got[1].tolist()[3:] == [True, True, True, True, True, False, False, False]


def _batch_members(gen, lengths, bits=2, d=16, h=2):
    """KIVI payloads of different lengths (as ``compress.kivi`` stores them), one a request."""
    out = []
    for n in lengths:
        qkv = KIVI().compress(0, torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen), bits)
        out.append(_payload(qkv, d, d))
    return out


def test_payload_batch_attention_scores_and_merge(triton_backend):
    """Many requests' payloads in one launch (a table of their addresses): each query row
    over its own payload equals the one-payload reference, with a listed row exclusion,
    merged with two more states in the splits' reduce; the scores over a log-sum-exp of
    two key sets equal the reference's over their union; a member with no rows gets 0,
    -inf and padding."""
    from sgl_kernel_ext.merge_state import reference as merge_reference
    from sgl_kernel_ext.payload_batch import PAD_SCORE, attention_reference, scores_reference

    g = torch.Generator().manual_seed(21)
    members = _batch_members(g, [200, 330, 100, 170])  # 64, 192, 0 and 32 payload rows
    pb = ext.payload_batch(members)
    assert [m.num_tokens for m in members] == [64, 192, 0, 32] and pb.max_tokens == 192
    q = torch.randn(4, 6, 16, generator=g)
    out, lse = ext.kivi_attention_batch(q, pb, 0.25)
    want_out, want_lse = attention_reference(q, pb, 0.25)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()

    exclude = torch.tensor([[[3, 7, -1], [0, 63, 5]], [[191, -1, -1], [10, 11, 12]], [[-1] * 3] * 2,
                            [[31, 30, -1], [-1, -1, 2]]])
    extra = [(torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, generator=g)) for _ in range(2)]
    extra[1][1][2] = float("-inf")  # a side that saw nothing
    got, got_lse = ext.kivi_attention_batch(q, pb, 0.25, exclude=exclude, merge=tuple(extra))
    ref, ref_lse = attention_reference(q, pb, 0.25, exclude)
    for o2, l2 in extra:
        ref, ref_lse = merge_reference(ref, ref_lse, o2, l2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-5, rtol=1e-5)
    # excluding changed the result (the list was applied)
    plain, _ = attention_reference(q, pb, 0.25)
    assert not torch.allclose(plain[0], attention_reference(q, pb, 0.25, exclude)[0][0], atol=1e-4)

    lse2 = torch.randn(4, 6, generator=g)
    scores = ext.payload_scores_batch(q, lse, pb, 0.25, lse2=lse2)
    want = scores_reference(q, torch.logaddexp(lse, lse2), pb, 0.25)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
    assert (scores[0, :, 64:] == PAD_SCORE).all() and (scores[2] == PAD_SCORE).all()
    assert ext.launches["kivi_attention_batch"] == 2 and ext.launches["payload_scores_batch"] == 1
    with pytest.raises(ValueError, match="differ in layout"):
        ext.payload_batch(members[:1] + _batch_members(g, [200], bits=4))


def test_specache_fetch_rows_and_rows_attention(triton_backend):
    """SpeCache's top-k rows of a batch: below a request's shared prefix from the pool
    through its row, the others from its host copy (by address); past its own top-k or
    its payload rows listed as -1; the rows' attention per KV head, and the merge kernel,
    equal their references."""
    from sgl_kernel_ext.merge_state import reference as merge_reference
    from sgl_kernel_ext.specache_rows import fetch_rows_reference, rows_attention_reference

    g = torch.Generator().manual_seed(22)
    bsz, h, d, kk = 3, 2, 16, 5
    k_buf, v_buf = torch.randn(600, h, d, generator=g), torch.randn(600, h, d, generator=g)
    req_to_token = torch.randint(1, 600, (4, 400), generator=g, dtype=torch.int32)
    rows, shared = torch.tensor([2, 0, 3]), torch.tensor([10, 0, 40])
    topk, ntok = torch.tensor([5, 3, 0], dtype=torch.int32), torch.tensor([64, 192, 0], dtype=torch.int32)
    host_k = [torch.randn(400 - int(shared[b]), h, d, generator=g) for b in range(bsz)]
    host_v = [torch.randn(400 - int(shared[b]), h, d, generator=g) for b in range(bsz)]
    host = torch.tensor([[host_k[b].data_ptr(), host_v[b].data_ptr()] for b in range(bsz)])
    pos = torch.stack([torch.stack([torch.randperm(int(n) + kk, generator=g)[:kk] for _ in range(h)])
                       for n in ntok])  # some positions past the payload rows
    pos[0, 0, 0] = 4  # below request 0's shared prefix: from the pool
    got = ext.fetch_rows(pos, host, host_k[0], shared, topk, ntok, rows, req_to_token, k_buf, v_buf)
    want = fetch_rows_reference(pos, host_k, host_v, shared, topk, ntok, rows, req_to_token, k_buf, v_buf)
    assert torch.equal(got.selected, want.selected)
    assert (got.selected[2] == -1).all() and (got.selected[1, :, 3:] == -1).all()
    valid = got.valid.permute(0, 2, 1).unsqueeze(-1)
    assert torch.equal(torch.where(valid, got.k, 0), want.k) and torch.equal(torch.where(valid, got.v, 0), want.v)
    assert torch.equal(got.k[0, 0, 0], k_buf[int(req_to_token[2, 4]), 0])

    q = torch.randn(bsz, 6, d, generator=g)
    out, lse = ext.rows_attention(q, got, 0.25)
    ref_out, ref_lse = rows_attention_reference(q, want, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[2]).all()
    other = (torch.randn(bsz, 6, d, generator=g), torch.randn(bsz, 6, generator=g))
    merged = ext.merge_state(out, lse, *other)
    for a, b in zip(merged, merge_reference(out, lse, *other)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert ext.launches["specache_fetch_rows"] == 1 and ext.launches["specache_rows_attention"] == 1
    assert ext.launches["merge_state"] == 1
