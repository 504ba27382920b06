"""Compressor library: budgets, identities, quantization bounds, per-paper selections,
and rejected configurations. Pure torch on small random tensors with fixed seeds."""

import pytest
import torch

from sglang_vc.compress import (
    H2O,
    KIVI,
    KIVI1,
    DroppedKV,
    KNorm,
    KVzip,
    QuantizedKV,
    SnapKV,
    StreamingLLM,
    get_compressor,
    kivi_split,
    list_compressors,
    num_kept,
    pack_bits,
    packed_size,
    unpack_bits,
    unpack_float,
)

DROPPERS = ["streamingllm", "knorm", "snapkv", "keydiff", "h2o", "kvzip"]
QUANTIZERS = ["kivi", "kivi1"]


def rand_kv(n, h=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g).to(dtype), torch.randn(n, h, d, generator=g).to(dtype))


def rand_q(t, hq=4, d=16, seed=1):
    return torch.randn(t, hq, d, generator=torch.Generator().manual_seed(seed))


def compress_any(name, k, v, arg, **kw):
    """Compress with whatever queries the method needs (8 random ones)."""
    comp = get_compressor(name, **kw)
    queries = rand_q(min(8, k.shape[0] - 1), hq=2 * k.shape[1], d=k.shape[2]) if comp.needs_queries else None
    return comp, comp.compress(0, k, v, arg, queries=queries)


def one_hot(d, i, scale=1.0):
    e = torch.zeros(d)
    e[i] = scale
    return e


# ----------------------------------------------------------------------------- registry


def test_registry_lists_all_methods_with_their_kind():
    assert list_compressors() == sorted(DROPPERS + QUANTIZERS + ["specache"])  # SpeCache's copy: below
    for name in DROPPERS:
        assert get_compressor(name).scenario == "token_dropping"
    for name in QUANTIZERS:
        assert get_compressor(name).scenario == "quantization"
    modes = {name: get_compressor(name).mode for name in list_compressors()}
    assert modes.pop("h2o") == "online" and set(modes.values()) == {"offline"}
    assert get_compressor("SnapKV").name == "snapkv"
    assert get_compressor("kivi", group_size=64).group_size == 64


def test_unknown_compressor_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown compressor 'foo'; known: h2o, keydiff, kivi"):
        get_compressor("foo")


def test_fresh_instances_do_not_share_state():
    assert get_compressor("h2o") is not get_compressor("h2o")


# ----------------------------------------------------------------------------- budgets


@pytest.mark.parametrize(
    "n, ratio, expected",
    [
        (10, 0.3, 3),  # 0.3 * 10 is 3.0000000000000004 in binary floats
        (100, 0.29, 29),  # 0.29 * 100 is 28.999999999999996
        (7, 0.5, 3),
        (3, 0.1, 1),  # at least one token per head
        (1000, 0.2, 200),
        (5, 1.0, 5),
        (5, 1, 5),
        (1, 0.01, 1),
        (1024, 0.125, 128),
        (17, 0.99, 16),
    ],
)
def test_num_kept_is_floor_of_decimal_ratio_at_least_one(n, ratio, expected):
    assert num_kept(n, ratio) == expected


@pytest.mark.parametrize("name", DROPPERS)
@pytest.mark.parametrize("n", [9, 33, 100])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.9])
def test_exact_budget_same_count_across_heads(name, n, ratio):
    k, v = rand_kv(n, h=3, seed=n)
    comp, ckv = compress_any(name, k, v, ratio)
    assert isinstance(ckv, DroppedKV)
    n_keep = num_kept(n, ratio)
    assert ckv.kept_positions.shape == (3, n_keep)
    assert ckv.k.shape == (n_keep, 3, 16) and ckv.v.shape == (n_keep, 3, 16)
    pos = ckv.kept_positions
    assert pos.dtype == torch.int64
    assert bool((pos[:, 1:] > pos[:, :-1]).all()), "ascending and unique per head"
    assert int(pos.min()) >= 0 and int(pos.max()) < n
    for h in range(3):  # row j of head h is the token at kept_positions[h, j]
        assert torch.equal(ckv.k[:, h], k[pos[h], h]) and torch.equal(ckv.v[:, h], v[pos[h], h])
    dk, dv, dpos = comp.decompress(ckv)
    assert dk is ckv.k and dv is ckv.v and dpos is pos
    dropped = ckv.dropped_positions()
    assert dropped.shape == (3, n - n_keep)
    for h in range(3):
        assert sorted(dropped[h].tolist() + pos[h].tolist()) == list(range(n))


@pytest.mark.parametrize("name", DROPPERS)
def test_token_dropping_bits_per_element(name):
    k, v = rand_kv(64, h=2, d=16, dtype=torch.float16)
    _, ckv = compress_any(name, k, v, 0.25)
    assert ckv.bit_scheme == 16
    assert ckv.bits_per_element(include_positions=False) == 16 * 16 / 64
    assert ckv.nbytes() == 2 * 16 * 2 * 16 * 2 + 2 * 16 * 8  # K+V fp16, int64 positions


@pytest.mark.parametrize("name", DROPPERS)
@pytest.mark.parametrize("ratio", [1.0, 1])
def test_ratio_one_is_identity(name, ratio):
    k, v = rand_kv(20)
    comp = get_compressor(name)
    ckv = comp.compress(0, k, v, ratio)  # no queries needed: nothing is scored
    dk, dv, pos = comp.decompress(ckv)
    assert dk is k and dv is v
    assert torch.equal(pos, torch.arange(20).expand(2, 20))


# ----------------------------------------------------------------------------- per-paper selections


def test_streamingllm_keeps_sinks_and_recent_window():
    k, v = rand_kv(50)
    ckv = StreamingLLM().compress(0, k, v, 0.2)  # 10 = 4 sinks + 6 recent
    expected = [0, 1, 2, 3, 44, 45, 46, 47, 48, 49]
    assert ckv.kept_positions.tolist() == [expected, expected]
    # a budget smaller than the sinks keeps the first sinks only
    ckv = StreamingLLM(n_sink=4).compress(0, k, v, 0.05)
    assert ckv.kept_positions.tolist() == [[0, 1], [0, 1]]


def test_knorm_keeps_the_smallest_norm_keys_per_head():
    k, v = rand_kv(40)
    k = k + 3.0  # every key has a large norm ...
    small = {0: [5, 17, 30, 31], 1: [2, 3, 22, 39]}
    for h, rows in small.items():
        k[rows, h] = 0.01 * torch.randn(len(rows), 16)  # ... except these, per head
    ckv = KNorm().compress(0, k, v, 0.1)  # 4 per head
    assert ckv.kept_positions.tolist() == [small[0], small[1]]


def test_keydiff_keeps_the_outlier_key():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(16, generator=g)
    k = base + 0.05 * torch.randn(30, 2, 16, generator=g)  # all keys near one direction
    v = torch.randn(30, 2, 16, generator=g)
    k[11, 0] = -base  # the one key pointing away from the mean key
    k[25, 1] = torch.randn(16, generator=g) * 5
    ckv = get_compressor("keydiff").compress(0, k, v, 1 / 30)
    assert ckv.kept_positions.tolist() == [[11], [25]]


def _snapkv_case():
    """kv head 0 has its needle at 10, kv head 1 at 20; decoys at the swapped directions."""
    n, d = 32, 8
    k, v = rand_kv(n, h=2, d=d, seed=4)
    k *= 0.1
    k[10, 0], k[20, 1] = one_hot(d, 0, 5), one_hot(d, 1, 5)
    k[5, 1], k[25, 0] = one_hot(d, 0, 5), one_hot(d, 1, 5)  # would win if GQA grouping were wrong
    q = torch.zeros(4, 4, d)  # W = 4 window queries, 4 q heads -> 2 per kv head
    q[:, 0:2] = one_hot(d, 0, 5)  # q heads 0, 1 read kv head 0 and look for direction 0
    q[:, 2:4] = one_hot(d, 1, 5)  # q heads 2, 3 read kv head 1 and look for direction 1
    return k, v, q


def test_snapkv_keeps_what_the_observation_window_attends_to():
    k, v, q = _snapkv_case()
    ckv = SnapKV(kernel_size=1).compress(0, k, v, 5 / 32, queries=q)  # window 4 + 1
    assert ckv.kept_positions.tolist() == [[10, 28, 29, 30, 31], [20, 28, 29, 30, 31]]


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_pooling_keeps_the_neighbourhood(pooling):
    k, v, q = _snapkv_case()
    ckv = SnapKV(kernel_size=5, pooling=pooling).compress(0, k, v, 9 / 32, queries=q)  # 4 + 5
    assert ckv.kept_positions.tolist() == [
        [8, 9, 10, 11, 12, 28, 29, 30, 31],
        [18, 19, 20, 21, 22, 28, 29, 30, 31],
    ]


def _h2o_case(d=8):
    """20 tokens; the last prompt query attends mostly to 2, then to 7."""
    k, v = rand_kv(20, h=2, d=d, seed=5)
    k *= 0.1
    k[2], k[7], k[18] = one_hot(d, 0, 5), one_hot(d, 1, 5), one_hot(d, 2, 5)
    q = (one_hot(d, 0, 3) + one_hot(d, 1, 2.5)).expand(1, 4, d).clone()  # T = 1 prompt query
    return k, v, q


def test_h2o_keeps_heavy_hitters_and_recent_window():
    k, v, q = _h2o_case()
    comp = H2O(sm_scale=1.0)
    ckv = comp.compress(0, k, v, 0.2, queries=q)  # 4 = 2 heavy + 2 recent
    assert ckv.kept_positions.tolist() == [[2, 7, 18, 19]] * 2


@pytest.mark.parametrize("attend, dropped", [(2, 18), (18, 7)])
def test_h2o_update_accumulates_attention_and_evicts_the_lightest(attend, dropped):
    k, v, q = _h2o_case()
    comp = H2O(sm_scale=1.0)
    comp.compress(0, k, v, 0.2, queries=q)
    # decode one token; its query attends to `attend` (direction of that key)
    new_k = 0.1 * torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(6))
    kept_k = k[[2, 7, 18, 19]]
    q_dec = (k[attend, 0] * 2).expand(1, 4, 8).clone()
    keys = torch.cat([kept_k, new_k])  # pool layout: kept rows, then the new token
    drops = comp.update(0, q_dec, keys, keys)
    # budget floor(21 * 0.2) = 4: one of the non-recent rows {2, 7, 18} goes
    assert [d.tolist() for d in drops] == [[[dropped], [dropped]]]
    # next step: positions default to the survivors followed by the new token
    keep = [p for p in [2, 7, 18, 19, 20] if p != dropped]
    assert comp.kept(0).tolist() == [keep, keep]
    # and the next step's rows are those survivors plus one more new token
    keys = torch.cat([keys[[i for i, p in enumerate([2, 7, 18, 19, 20]) if p != dropped]], new_k])
    (drop2,) = comp.update(0, q_dec, keys, keys)  # budget floor(22 * 0.2) = 4 again
    assert drop2.shape == (2, 1) and comp.kept(0).shape == (2, 4)
    assert comp.kept(0)[0, -1].item() == 21


def test_h2o_update_batches_requests_by_offsets():
    k, v, q = _h2o_case()
    comp = H2O(sm_scale=1.0)
    for rid in ("a", "b"):
        comp.compress(0, k, v, 0.2, queries=q, req_id=rid)
    keys = torch.cat([k[[2, 7, 18, 19]], torch.zeros(1, 2, 8)])
    q_dec = torch.stack([(k[2, 0] * 2).expand(4, 8), (k[18, 0] * 2).expand(4, 8)])  # [2, Hq, D]
    offsets = torch.tensor([0, 1, 2])
    drops = comp.update(0, q_dec, [keys, keys], [keys, keys], None, offsets, req_ids=["a", "b"])
    assert [d[0].tolist() for d in drops] == [[18], [7]]
    comp.release("a")
    with pytest.raises(KeyError):
        comp.kept(0, "a")
    assert comp.kept(0, "b").tolist() == [[2, 18, 19, 20]] * 2


def test_kvzip_scores_by_max_reconstruction_attention():
    n, d = 20, 8
    k = torch.zeros(n, 2, d)
    v = torch.randn(n, 2, d, generator=torch.Generator().manual_seed(7))
    k[6], k[13] = one_hot(d, 0, 1), one_hot(d, 1, 1)
    q = torch.zeros(4, 4, d)
    q[0] = one_hot(d, 0, 10)  # one query puts ~all its attention on 6
    q[1:] = one_hot(d, 1, 2.74)  # three queries each put ~45% on 13: a larger sum, smaller max
    comp = KVzip(n_sink=0, sm_scale=1.0)
    assert comp.compress(0, k, v, 1 / 20, queries=q).kept_positions.tolist() == [[6], [6]]
    # default: the 4 sink tokens are always kept besides
    ckv = KVzip(sm_scale=1.0).compress(0, k, v, 5 / 20, queries=q)
    assert ckv.kept_positions.tolist() == [[0, 1, 2, 3, 6]] * 2
    # reconstruction keys only change the normalisation: the argmax stays
    recon = torch.zeros(4, 2, d)
    ckv = comp.compress(0, k, v, 2 / 20, queries=q, recon_keys=recon)
    assert ckv.kept_positions.tolist() == [[6, 13]] * 2


# ----------------------------------------------------------------------------- quantization


def test_kivi_split_keeps_full_key_groups():
    assert kivi_split(200, 32, 16) == (160, 40)
    assert kivi_split(256, 32, 0) == (256, 0)
    assert kivi_split(100, 32, 128) == (0, 100)
    assert kivi_split(160, 32, 128) == (32, 128)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 16, 33])
def test_pack_unpack_roundtrip(bits, n):
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 2**bits, (3, 2, n), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, packed_size(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    assert torch.equal(unpack_float(packed, bits, n), codes.float())


def _check_bound(x, deq, scales, expand):
    """|x - deq| <= scale / 2 + float slack, with the group's scale broadcast to elements."""
    s = expand(scales.float())
    assert bool(((x.float() - deq.float()).abs() <= s / 2 + 1e-5 * (1 + x.abs())).all())


@pytest.mark.parametrize("name, bits", [("kivi", 2), ("kivi", 4), ("kivi1", 1)])
@pytest.mark.parametrize("group_size", [16, 32])
def test_quantization_error_within_half_a_step(name, bits, group_size):
    k, v = rand_kv(200, h=2, d=64, seed=bits)
    k[:, :, 3] *= 20  # an outlier channel, as KIVI motivates per-channel keys
    comp = get_compressor(name, group_size=group_size, residual_length=16)
    ckv = comp.compress(0, k, v, bits)
    n_q, n_r = kivi_split(200, group_size, 16)
    assert isinstance(ckv, QuantizedKV) and (ckv.num_quantized, ckv.residual_length) == (n_q, n_r)
    dk, dv, pos = comp.decompress(ckv)
    assert dk.shape == k.shape and dv.shape == v.shape and dk.dtype == k.dtype
    assert torch.equal(pos, torch.arange(200).expand(2, 200))
    assert torch.equal(dk[n_q:], k[n_q:]) and torch.equal(dv[n_q:], v[n_q:])  # residual exact
    g, gv = ckv.group_size, ckv.value_group_size
    _check_bound(k[:n_q], dk[:n_q], ckv.k_scales, lambda s: s.repeat_interleave(g, dim=0))
    _check_bound(v[:n_q], dv[:n_q], ckv.v_scales, lambda s: s.repeat_interleave(gv, dim=-1))
    assert float((dk[:n_q] - k[:n_q]).abs().max()) > 0  # it did quantize


def test_kivi_zero_point_and_scale_follow_eq2():
    k, v = rand_kv(64, h=1, d=8)
    ckv = KIVI(group_size=32, residual_length=0).compress(0, k, v, 2)
    grp = k[:32, 0]  # first key group: per channel over 32 tokens
    assert torch.allclose(ckv.k_zeros[0, 0], grp.amin(0))
    assert torch.allclose(ckv.k_scales[0, 0], (grp.amax(0) - grp.amin(0)) / 3)
    tok = v[0, 0]  # first value group: per token over 8 channels
    assert torch.allclose(ckv.v_zeros[0, 0, 0], tok.min())
    assert torch.allclose(ckv.v_scales[0, 0, 0], (tok.max() - tok.min()) / 3)


def test_kivi1_uses_specache_eq3_midpoints():
    k, v = rand_kv(64, h=2, d=16, seed=9)
    ckv = KIVI1(group_size=32, residual_length=0).compress(0, k, v, 1)
    dk, dv, _ = KIVI1().decompress(ckv)
    grp, deq = k[:32], dk[:32]  # first key group, per channel
    mn, mx = grp.amin(0), grp.amax(0)
    assert torch.allclose(ckv.k_zeros[0], (3 * mn + mx) / 4)
    assert torch.allclose(ckv.k_scales[0], (mx - mn) / 2)
    low, high = (3 * mn + mx) / 4, (mn + 3 * mx) / 4
    expected = torch.where(grp < (mn + mx) / 2, low, high)
    assert torch.allclose(deq, expected, atol=1e-6)


@pytest.mark.parametrize("name, bits", [("kivi", 2), ("kivi", 4), ("kivi1", 1)])
@pytest.mark.parametrize("group_size", [32, 64])
def test_bits_per_element_from_nbytes(name, bits, group_size):
    # no residual, full groups: codes + one fp16 scale and zero per group of K and of V
    k, v = rand_kv(256, h=2, d=64, dtype=torch.float16)
    ckv = get_compressor(name, group_size=group_size, residual_length=0).compress(0, k, v, bits)
    assert ckv.bit_scheme == bits
    assert ckv.bits_per_element() == bits + 32 / group_size
    # with a residual window: count every stored byte
    ckv = get_compressor(name, group_size=group_size, residual_length=40).compress(0, k, v, bits)
    n_q, n_r = kivi_split(256, group_size, 40)
    codes = 2 * n_q * 2 * 64 * bits // 8
    meta = 2 * 2 * 2 * (n_q // group_size * 64 + n_q * 64 // group_size)  # scale + zero, fp16, K + V
    assert ckv.nbytes() == codes + meta + 2 * n_r * 2 * 64 * 2


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sixteen_bits_is_identity(name, dtype):
    k, v = rand_kv(300, dtype=dtype)
    comp = get_compressor(name)
    ckv = comp.compress(0, k, v, 16)
    dk, dv, _ = comp.decompress(ckv)
    assert dk is k and dv is v
    assert ckv.nbytes() == k.numel() * k.element_size() * 2


def test_low_precision_inputs_roundtrip_close():
    k, v = rand_kv(160, d=64, dtype=torch.bfloat16)
    comp = KIVI(residual_length=32)
    dk, dv, _ = comp.decompress(comp.compress(0, k, v, 4))
    assert dk.dtype == torch.bfloat16
    rel = (dk.float() - k.float()).norm() / k.float().norm()
    assert rel < 0.15


# ----------------------------------------------------------------------------- many layers


def test_compress_layers_passes_per_layer_inputs():
    ks, vs = zip(*(rand_kv(24, seed=i) for i in range(3)))
    qs = [rand_q(4, seed=i) for i in range(3)]
    out = get_compressor("snapkv").compress_layers(ks, vs, 0.5, queries=qs)
    assert [c.layer_idx for c in out] == [0, 1, 2]
    assert all(c.kept_positions.shape == (2, 12) for c in out)
    with pytest.raises(ValueError, match="queries has 2 layers, expected 3"):
        get_compressor("snapkv").compress_layers(ks, vs, 0.5, queries=qs[:2])


def test_offline_update_is_a_noop():
    k, v = rand_kv(10)
    assert get_compressor("knorm").update(0, rand_q(1), k, v, None, [0, 1]) == []


# ----------------------------------------------------------------------------- rejected configs


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_bad_ratio_rejected(bad):
    k, v = rand_kv(10)
    with pytest.raises(ValueError, match="keep ratio"):
        get_compressor("knorm").compress(0, k, v, bad)


@pytest.mark.parametrize("name", DROPPERS)
def test_bits_passed_to_token_dropping_rejected(name):
    k, v = rand_kv(10)
    with pytest.raises(ValueError, match=f"{name} is a token-dropping method.*looks like a bit width"):
        get_compressor(name).compress(0, k, v, 4)


@pytest.mark.parametrize(
    "name, bad, msg",
    [
        ("kivi", 0.5, "kivi is a quantization method.*looks like a keep ratio"),
        ("kivi", 3, r"unsupported bit width 3; supported: \{2, 4, 16\}"),
        ("kivi", 1, "unsupported bit width 1"),
        ("kivi", 8, "unsupported bit width 8"),
        ("kivi1", 2, r"unsupported bit width 2; supported: \{1, 16\}"),
        ("kivi1", True, "bits must be one of"),
        ("kivi", None, "bits must be one of"),
    ],
)
def test_bad_bits_rejected(name, bad, msg):
    k, v = rand_kv(64)
    with pytest.raises(ValueError, match=msg):
        get_compressor(name).compress(0, k, v, bad)


@pytest.mark.parametrize("name", ["snapkv", "kvzip", "h2o"])
def test_missing_queries_rejected(name):
    k, v = rand_kv(20)
    with pytest.raises(ValueError, match=f"{name} needs queries="):
        get_compressor(name).compress(0, k, v, 0.5)


def test_snapkv_window_must_fit_and_gqa_must_divide():
    k, v = rand_kv(8)
    with pytest.raises(ValueError, match="observation window W=8"):
        SnapKV().compress(0, k, v, 0.5, queries=rand_q(8))
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        SnapKV().compress(0, k, v, 0.5, queries=rand_q(2, hq=3))


def test_bad_shapes_and_inputs_rejected():
    k, v = rand_kv(10)
    with pytest.raises(ValueError, match=r"must be \[num_tokens, num_kv_heads, head_dim\]"):
        get_compressor("knorm").compress(0, k[:, 0], v, 0.5)
    with pytest.raises(ValueError, match="differ in tokens or heads"):
        get_compressor("kivi").compress(0, k, v[:5], 2)
    with pytest.raises(ValueError, match="empty KV"):
        get_compressor("knorm").compress(0, k[:0], v[:0], 0.5)
    with pytest.raises(ValueError, match=r"unknown inputs \['recon_keys'\]"):
        get_compressor("knorm").compress(0, k, v, 0.5, recon_keys=k)
    with pytest.raises(ValueError, match="recon_keys must be"):
        KVzip().compress(0, k, v, 0.5, queries=rand_q(3), recon_keys=k)


def test_bad_method_config_rejected():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        KIVI(group_size=0)
    with pytest.raises(ValueError, match="residual_length must be >= 0"):
        KIVI1(residual_length=-1)
    with pytest.raises(ValueError, match="kernel_size must be a positive odd"):
        SnapKV(kernel_size=4)
    with pytest.raises(ValueError, match="pooling must be"):
        SnapKV(pooling="sum")
    with pytest.raises(ValueError, match="recent_fraction"):
        H2O(recent_fraction=1.5)
    k, v = rand_kv(64, d=48)
    with pytest.raises(ValueError, match="value group size 32 must divide head_dim 48"):
        KIVI(group_size=32).compress(0, k, v, 2)
    with pytest.raises(TypeError):
        get_compressor("knorm", n_sink=2)


def test_decompress_rejects_the_other_kind():
    k, v = rand_kv(64)
    dropped = KNorm().compress(0, k, v, 0.5)
    quant = KIVI().compress(0, k, v, 2)
    with pytest.raises(ValueError, match="expected a QuantizedKV"):
        KIVI().decompress(dropped)
    with pytest.raises(ValueError, match="expected a DroppedKV"):
        KNorm().decompress(quant)


def test_h2o_update_needs_a_compressed_request():
    k, v = rand_kv(10)
    with pytest.raises(ValueError, match="was never compressed"):
        H2O().update(0, rand_q(1), k, v)
    comp = H2O()
    comp.compress(0, k, v, 0.5, queries=rand_q(10), req_id="a")
    with pytest.raises(ValueError, match="pass req_ids"):
        comp.update(0, rand_q(2), [k, k], [v, v], None, [0, 1, 2])


def test_specache_copy_is_kivi_at_two_bits_and_eq3_at_one_bit():
    """SpeCache's device copy (``specache``) stores exactly KIVI's payload at 2 bits and
    kivi1's (eq. 3) at 1 bit, at SpeCache's residual of 64; it is not a stand-alone
    method (it is read with host rows), so the lab, EvicPress and lossy serving skip it."""
    from sglang_vc.compress import KIVI, KIVI1, standalone_compressors

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(200, 2, 64, generator=g), torch.randn(200, 2, 64, generator=g)
    copy = get_compressor("specache")
    assert copy.residual_length == 64 and copy.needs_full_rows
    for bits, ref in ((2, KIVI(residual_length=64)), (1, KIVI1(residual_length=64))):
        a, b = copy.compress(0, k, v, bits), ref.compress(0, k, v, bits)
        assert a.num_quantized == b.num_quantized == 128
        for field in ("k_payload", "v_payload", "k_scales", "k_zeros", "v_scales", "v_zeros"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (bits, field)
    with pytest.raises(ValueError, match="specache"):
        copy.compress(0, k, v, 4)
    assert "specache" not in standalone_compressors() and "kivi1" in standalone_compressors()
