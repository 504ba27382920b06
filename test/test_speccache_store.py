"""SpecCache's fill and shrink before an extend forward (``ChunkStore.prepare_extend``),
on a crafted batch: a chunk at positions 2..5 of a 10-token prompt, found in the tree,
prefilled in two ranges (chunked prefill)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_vc.speccache import rope
from sglang_vc.speccache.fetch import ChunkSource
from sglang_vc.speccache.store import ChunkHit, ChunkStore, ServerPlan

H, D, LAYERS = 2, 4, 3


def _rotary():
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))

    def at(offset: int):
        ang = offset * inv
        return ang.cos(), ang.sin()

    return at, True


def _batch(a: int, n: int):
    return SimpleNamespace(
        rids=["r"], extend_prefix_lens_cpu=[a], extend_seq_lens_cpu=[n], req_pool_indices=torch.tensor([0]),
        input_ids=torch.arange(a, a + n) + 1000, positions=torch.arange(a, a + n), out_cache_loc=torch.arange(a, a + n) + 10,
        extend_seq_lens=torch.tensor([n]), extend_start_loc=torch.tensor([0]), extend_num_tokens=n)


def test_reused_rows_are_filled_rotated_and_dropped_from_the_batch():
    torch.manual_seed(0)
    k = [torch.randn(200, H, D) for _ in range(LAYERS)]
    v = [torch.randn(200, H, D) for _ in range(LAYERS)]
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    selected = torch.zeros(10, dtype=torch.bool)
    selected[3] = True  # chunk token at position 3 recomputed
    store = ChunkStore()
    plan = ServerPlan("r", 10, (2,), (6,), selected, "test", 0.25, {}, [])
    plan.hits = [ChunkHit(2, 4, 4, lock="lock", indices=torch.arange(100, 104))]
    store.plans["r"] = plan
    unlocked = []
    row = torch.arange(10, 20).view(1, -1)  # position p lives in slot 10 + p

    fb = _batch(0, 5)
    out = store.prepare_extend(fb, lambda l: k[l], lambda l: v[l], LAYERS, row, _rotary(), unlocked.append)
    # [0, 5): position 2 reused; 3 selected; 4 is the range's last token (its logits are read)
    assert out.q_positions[0].tolist() == [0, 1, 3, 4]
    assert fb.input_ids.tolist() == [1000, 1001, 1003, 1004] and fb.out_cache_loc.tolist() == [10, 11, 13, 14]
    assert fb.extend_seq_lens_cpu == [4] and fb.extend_num_tokens == 4
    for layer in range(LAYERS):
        want = rope.shift(k0[layer][100:101], 2, *_rotary())
        assert torch.allclose(k[layer][12], want[0]) and torch.equal(v[layer][12], v0[layer][100])
        assert torch.equal(k[layer][13], k0[layer][13])  # a selected row is left to the forward
    assert unlocked == []

    fb = _batch(5, 5)
    out = store.prepare_extend(fb, lambda l: k[l], lambda l: v[l], LAYERS, row, _rotary(), unlocked.append)
    assert out.q_positions[0].tolist() == [6, 7, 8, 9]  # chunk row 5 reused
    assert torch.allclose(k[0][15], rope.shift(k0[0][103:104], 2, *_rotary())[0])
    assert plan.counts.tokens_reused == 2 and plan.counts.tokens_recomputed == 8
    assert unlocked == ["lock"]  # the whole prompt is filled: the chunk's lock is dropped


def test_a_chunk_lost_from_the_device_is_recomputed():
    """A chunk evicted between the front end's fetch and the prefill's lookup: the tree
    has only its first 2 of 4 tokens. Those are reused; the rest is recomputed, and the
    chunk is counted lost."""
    torch.manual_seed(0)
    k = [torch.randn(200, H, D) for _ in range(LAYERS)]
    v = [torch.randn(200, H, D) for _ in range(LAYERS)]
    store = ChunkStore()
    plan = ServerPlan("r", 10, (2,), (6,), torch.zeros(10, dtype=torch.bool), "test", 0.0, {}, [ChunkSource.KNOWN])
    store.plans["r"] = plan
    locked = []

    def match(ids):
        assert list(ids) == [12, 13, 14, 15]
        return 2, "node", torch.arange(100, 102)

    store.look_up(plan, list(range(10, 20)), match, lambda node: locked.append(node) or "lock")
    assert locked == ["node"] and plan.lost == [0] and plan.counts.chunks_lost == 1
    fb = _batch(0, 10)
    out = store.prepare_extend(fb, lambda l: k[l], lambda l: v[l], LAYERS, torch.arange(10, 20).view(1, -1),
                               _rotary(), lambda lock: None)
    assert out.q_positions[0].tolist() == [0, 1, 4, 5, 6, 7, 8, 9]  # positions 2, 3 reused
    report = plan.report()
    assert report["chunks_lost"] == 1 and report["lost_chunks"] == [0] and report["chunk_hits_device"] == 0


def test_a_batch_without_speccache_requests_is_left_alone():
    store = ChunkStore()
    fb = _batch(0, 4)
    assert store.prepare_extend(fb, None, None, LAYERS, None, _rotary(), None) is None
    assert fb.input_ids.tolist() == [1000, 1001, 1002, 1003]


def test_cacheblend_picks_the_most_deviating_found_chunk_tokens_of_the_range():
    """``select_from_probe`` on crafted K/V: chunks at 2..5 and 6..9 of a 12-token prompt,
    the second found only up to position 7 (8 and 9 lost). The first pass's layer-1 K/V
    differ from the reused rows by a known amount per position; cacheblend at 0.25 takes
    the ceil(0.25 x 8) = 2 found chunk tokens that differ most."""
    torch.manual_seed(0)
    n = 12
    store = ChunkStore()
    plan = ServerPlan("r", n, (2, 6), (6, 10), torch.zeros(n, dtype=torch.bool), "cacheblend", 0.25, {}, [])
    plan.hits = [ChunkHit(2, 4, 4), ChunkHit(6, 4, 2)]
    store.plans["r"] = plan
    assert plan.selects_in_prefill
    slots = torch.arange(50, 50 + n)
    k_reused, v_reused = torch.zeros(100, H, D), torch.zeros(100, H, D)
    shift = torch.tensor([9.0, 9, 1, 2, 7, 3, 4, 6, 8, 8, 9, 9])  # per position; 0, 1, 10, 11 are no chunk's
    k_new = shift.view(n, 1, 1).expand(n, H, D).clone()
    v_new = torch.zeros(n, H, D)
    fb = SimpleNamespace(rids=["r"], extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n],
                         req_pool_indices=torch.tensor([0]))
    ranges = store.probe_ranges(fb)
    assert [(r.a, r.b, r.offset) for r in ranges] == [(0, n, 0)]
    store.select_from_probe(fb, ranges, k_new, v_new, k_reused, v_reused, slots.view(1, -1), 0.5)
    # found chunk tokens: 2..5 (1, 2, 7, 3) and 6, 7 (4, 6); lost 8, 9 (8, 8) are not candidates
    assert plan.selected.nonzero().flatten().tolist() == [4, 7]
    assert plan.counts.probe_s == 0.5


def test_a_plan_reports_its_selected_positions_only_when_asked():
    from sglang_vc.speccache.names import PLAN_KEY
    from sglang_vc.speccache.store import parse_plan

    raw = {"starts": [2], "ends": [6], "recompute": [3, 5], "selector": "epic", "ratio": 0.5, "sources": []}
    quiet = parse_plan("r", {PLAN_KEY: raw}, 10)
    assert "selected_positions" not in quiet.report()
    asked = parse_plan("r", {PLAN_KEY: {**raw, "return_selection": True}}, 10)
    assert asked.report()["selected_positions"] == [3, 5]
