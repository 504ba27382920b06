"""SpeCache's attention (sglang_vc.specache.core) and configuration, pure torch: eq. 3's
quantizer on crafted tensors, eq. 1's substitution, top-k against brute force, the
prefetch-hit measure and the non-speculative fetch."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vc.specache import core
from sglang_vc.specache.config import SpeCacheConfig, parse_variant


def _kv(n, h=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)


def test_eq3_one_bit_quantizer_on_crafted_groups():
    """A key group (32 tokens of one channel) holding only min and max, and values in
    between: eq. 3 maps the lower half of [min, max] to (3 min + max) / 4 and the upper
    half to (min + 3 max) / 4; plain KIVI at 1 bit would give min and max themselves."""
    cfg = SpeCacheConfig(bits=1, residual=0, group_size=32)
    k = torch.zeros(32, 1, 4)
    k[:, 0, 0] = torch.linspace(-2.0, 6.0, 32)  # min -2, max 6: midpoint 2
    k[:, 0, 1] = 1.0  # constant channel: exact
    k[:, 0, 2] = torch.tensor([0.0, 4.0] * 16)
    k[:, 0, 3] = torch.tensor([-1.0] * 31 + [1.0])
    v = k.clone()
    ckv = cfg.quantizer().compress(0, k, v, 1)
    kd, _ = cfg.quantizer().dequantize(ckv)
    ch0 = kd[:, 0, 0]
    assert torch.equal(ch0[k[:, 0, 0] < 2.0], torch.full_like(ch0[k[:, 0, 0] < 2.0], 0.0))  # (3*-2+6)/4
    assert torch.equal(ch0[k[:, 0, 0] > 2.0], torch.full_like(ch0[k[:, 0, 0] > 2.0], 4.0))  # (-2+18)/4
    assert torch.equal(kd[:, 0, 1], torch.ones(32))
    assert torch.equal(kd[:, 0, 2], torch.tensor([1.0, 3.0] * 16))
    assert torch.equal(kd[:, 0, 3], torch.tensor([-0.5] * 31 + [0.5]))


def test_substitution_puts_full_rows_back_per_head():
    k_full, v_full = _kv(40, h=3)
    kq, vq = k_full + 0.5, v_full - 0.5  # a "dequantized" copy that is off everywhere
    pos = torch.tensor([[0, 7, 39], [1, 2, 3], [5, 6, 38]])
    rows = core.gather_rows(k_full, v_full, pos)
    k, v = core.substitute(kq, vq, rows)
    for h in range(3):
        picked = set(pos[h].tolist())
        for n in range(40):
            want_k = k_full[n, h] if n in picked else kq[n, h]
            want_v = v_full[n, h] if n in picked else vq[n, h]
            assert torch.equal(k[n, h], want_k) and torch.equal(v[n, h], want_v)
    assert torch.equal(kq, k_full + 0.5), "the payload itself is not modified"


@pytest.mark.parametrize("hq, h", [(4, 4), (6, 2), (9, 3)])
def test_topk_equals_brute_force_over_dequantized_keys(hq, h):
    """The rows picked from a query's attention equal a brute-force top-k: softmax of
    q.k / sqrt(d) over the dequantized payload keys and the tail, per query head, summed
    over the query heads of each KV head, k largest payload rows."""
    d, n_q, m, topk = 16, 96, 20, 12
    cfg = SpeCacheConfig(bits=2, residual=0, group_size=32)
    k_full, v_full = _kv(n_q, h=h, d=d, seed=3)
    kq, vq = cfg.quantizer().dequantize(cfg.quantizer().compress(0, k_full, v_full, 2))
    k_tail, v_tail = _kv(m, h=h, d=d, seed=4)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(5))
    scale = 1 / math.sqrt(d)
    res = core.attend(q, kq, vq, k_tail, v_tail, q_start=n_q + m - 2, scale=scale)
    picked = core.select_topk(res.probs[1], h, topk)
    keys = torch.cat([kq, k_tail])
    group = hq // h
    for kv_head in range(h):
        mass = torch.zeros(n_q)
        for qh in range(kv_head * group, (kv_head + 1) * group):
            logits = torch.tensor([float(q[1, qh] @ keys[n, kv_head]) * scale for n in range(n_q + m)])
            mass += torch.softmax(logits, 0)[:n_q]
        brute = sorted(sorted(range(n_q), key=lambda n: -float(mass[n]))[:topk])
        assert picked[kv_head].tolist() == brute


def test_attend_is_causal_and_equals_plain_attention_with_every_row_substituted():
    """With every payload row substituted by its full-precision row, eq. 1 is plain
    causal attention over the full KV (the second query also sees the first's key)."""
    h, d, n_q, m = 2, 8, 64, 10
    k_full, v_full = _kv(n_q + m, h=h, d=d, seed=7)
    kq, vq = torch.zeros(n_q, h, d), torch.zeros(n_q, h, d)
    rows = core.gather_rows(k_full[:n_q], v_full[:n_q], torch.arange(n_q).expand(h, -1))
    q = torch.randn(2, h, d, generator=torch.Generator().manual_seed(8))
    q_start = n_q + m - 2
    res = core.attend(q, kq, vq, k_full[n_q:], v_full[n_q:], q_start=q_start, scale=0.3, rows=rows)
    for i in range(2):
        n = q_start + i + 1  # visible keys
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k_full[:n]) * 0.3, -1)
        want = torch.einsum("hn,nhd->hd", w, v_full[:n])
        assert torch.allclose(res.out[i], want, atol=1e-6)
    assert res.probs.shape == (2, h, n_q)


def test_coverage_is_the_prefetched_share_of_the_top_k_mass():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6]])  # 2 q heads, 1 kv head
    # kv head score = [0.6, 0.4, 0.3, 0.7]; top-2 = rows 3 (0.7) and 0 (0.6)
    covered, total = core.coverage(probs, torch.tensor([[0, 1]]), 1, 2)
    assert total == pytest.approx(1.3) and covered == pytest.approx(0.6)


def test_nonspeculative_fetch_uses_the_output_tokens_own_top_k():
    h, d, n_q, topk = 2, 8, 64, 5
    k_full, v_full = _kv(n_q + 4, h=h, d=d, seed=11)
    cfg = SpeCacheConfig(bits=1, residual=0, group_size=32)
    kq, vq = cfg.quantizer().dequantize(cfg.quantizer().compress(0, k_full[:n_q], v_full[:n_q], 1))
    q = torch.randn(1, h, d, generator=torch.Generator().manual_seed(12))
    asked = []

    def fetch(pos):
        asked.append(pos)
        return core.gather_rows(k_full[:n_q], v_full[:n_q], pos)

    res, rows = core.attend_fetching(q, kq, vq, k_full[n_q:], v_full[n_q:], q_start=n_q + 3, scale=0.35,
                                     topk=topk, fetch=fetch)
    first = core.attend(q, kq, vq, k_full[n_q:], v_full[n_q:], q_start=n_q + 3, scale=0.35)
    assert torch.equal(asked[0], core.select_topk(first.probs[0], h, topk))
    again = core.attend(q, kq, vq, k_full[n_q:], v_full[n_q:], q_start=n_q + 3, scale=0.35, rows=rows)
    assert torch.equal(res.out, again.out)
    assert not torch.allclose(res.out, first.out)


def test_config_split_stream_and_labels():
    cfg = SpeCacheConfig(bits=1, topk=64, residual=64, group_size=32)
    assert cfg.quantized_len(1000) == 928 and cfg.quantized_len(60) == 0
    assert not cfg.stream_due(928, 1023) and cfg.stream_due(928, 1024)
    assert parse_variant("1b") == cfg and cfg.label == "specache@1b"
    assert parse_variant("2b/k16/nonspec").label == "specache@2b/k16/nonspec"
    assert parse_variant("1b/k0/r128").label == "kivi1@1b/r128"
    assert parse_variant("2b/k0/r128").compressor_name == "kivi"
    for bad in ("3b", "1", "1b/x5", "b"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    with pytest.raises(ValueError, match="topk"):
        SpeCacheConfig(topk=-1)


def test_device_bytes_counts_codes_metadata_tail_and_prefetched_rows():
    cfg = SpeCacheConfig(bits=1, topk=64, residual=64, group_size=32)
    # 1000 tokens, 1 head of dim 32, 2-byte elements: 928 quantized, 72 tail
    codes = 2 * 928 * 32 // 8
    meta = 2 * 2 * (928 // 32 * 32 + 928 * 1)
    full = 2 * 2 * 32 * (72 + 64)
    assert cfg.device_bytes(1000, 1, 32, 2) == codes + meta + full
