"""SpecCache's selection math on crafted scores, and the cross-tokenizer alignment."""

from __future__ import annotations

import pytest
import torch

from sglang_vc.speccache import align as al
from sglang_vc.speccache import spans as sp


def test_importance_is_the_mean_deep_layer_norm():
    hs = [torch.full((3, 4), float(i)) for i in range(9)]  # layer i: every norm is 2i
    hs[8][1] = 0.0
    imp = sp.importance(hs)  # deep layers: the last third, 6, 7, 8
    assert list(sp.deep_layers(9)) == [6, 7, 8]
    assert torch.allclose(imp, torch.tensor([14.0, 26 / 3, 14.0]))


def test_top_ratio_counts_exactly_and_breaks_ties_by_position():
    assert sp.count(0.15, 100) == 15 and sp.count(0.2, 7) == 2 and sp.count(1.0, 7) == 7
    mask = sp.top_ratio(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2)
    assert mask.tolist() == [False, True, True, False, False]


def test_segment_splits_at_relative_jumps_and_caps_span_length():
    scores = torch.tensor([0.0, 10, 10.5, 11, 5, 5.2, 100, 100, 100])
    # normalized: 0, .1, .105, .11, .05, .052, 1, 1, 1
    assert sp.segment(scores) == [(0, 0), (1, 3), (4, 5), (6, 8)]
    flat = torch.ones(40)
    assert sp.segment(flat) == [(0, 15), (16, 31), (32, 39)]
    assert sp.segment(torch.tensor([0.0, 0.0, 1.0])) == [(0, 1), (2, 2)]  # zero: equal joins


def test_complete_fills_spans_covered_at_tau():
    mask = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    spans = [(0, 3), (4, 6), (7, 9)]  # covered 3/4, 1/3, 1/3
    out = sp.complete(mask, spans, tau_cover=0.7)
    assert out.tolist() == [True] * 4 + [True, False, False, False, False, True]


def test_budget_is_exact_and_keeps_the_completion_it_can_afford():
    scores = torch.tensor([9.0, 8, 1, 7, 6, 5, 4, 3])
    spans = [(0, 2), (3, 7)]

    def expand(m):
        return sp.complete(m, spans, tau_cover=0.6)

    def size(m):
        return int(m.sum())

    # top-2 = {0, 1} covers 2/3 of span (0, 2): completed to {0, 1, 2} (size 3)
    got = sp.fit_budget(scores, 3, expand, size)
    assert got.tolist() == [True, True, True] + [False] * 5
    # budget 4: top-3 -> {0, 1, 2, 3}; top-4 would complete nothing more but be 5 > 4
    got = sp.fit_budget(scores, 4, expand, size)
    assert size(got) == 4 and got[:4].all()
    # with alignment: each speculative token is two target tokens
    alignment = al.Alignment(torch.arange(8) * 2, torch.arange(8) * 2 + 2, 16)
    got = sp.fit_budget(scores, 5, expand, alignment.target_count)
    assert alignment.target_count(got) == 4 and got.tolist()[:2] == [True, True]
    assert not got[2:].any()  # completing {0, 1} would need 6 target tokens


def test_alignment_maps_overlapping_spans():
    # speculative: "ab|cde|f" ; target: "a|bc|d|ef"
    a = al.align([(0, 2), (2, 5), (5, 6), (6, 6)], [(0, 1), (1, 3), (3, 4), (4, 6)])
    assert a.start.tolist() == [0, 1, 3, 4] and a.end.tolist() == [2, 4, 4, 4]  # (6, 6): empty
    assert a.to_target(torch.tensor([False, False, True, True])).tolist() == [False, False, False, True]
    assert a.to_target(torch.tensor([True, False, False, False])).tolist() == [True, True, False, False]
    ident = al.identity(3)
    assert ident.to_target(torch.tensor([True, False, True])).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="text order"):
        al.align([(0, 1)], [(2, 3), (0, 1)])


@pytest.mark.parametrize("text", [
    "naïve café — 文字化け and emoji 🙂🙂 done",
    "a  b   c\t\td\n\n\n  e",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
])
def test_alignment_covers_the_same_characters(text, tokenizer):
    """Two real tokenizations of one string (the model's tokenizer, and the same text
    cut into single characters as a second 'tokenizer'): every selected token's target
    tokens cover its characters, and nothing outside the tokens touching them."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spec = [tuple(o) for o in enc["offset_mapping"]]
    chars = [(i, i + 1) for i in range(len(text))]
    a = al.align(spec, chars)
    for i, (s, e) in enumerate(spec):
        assert (int(a.start[i]), int(a.end[i])) == ((s, e) if e > s else (int(a.start[i]),) * 2)
    back = al.align(chars, spec)  # each character maps to the tokens containing it
    for c in range(len(text)):
        covering = [j for j, (s, e) in enumerate(spec) if s <= c < e]
        assert list(range(int(back.start[c]), int(back.end[c]))) == covering, (c, text[c])


# ----------------------------------------------------------------------------- selectors

from sglang_vc.speccache.selectors import SELECTORS, Chunks, SelectionInput, get_selector  # noqa: E402


def _input(chunks, spec=None, deviation=None):
    return SelectionInput(chunks, spec_scores=spec, first_layer_deviation=deviation, seed=3)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.2, 1.0])
def test_every_selector_honours_the_budget_on_chunk_tokens_only(name, ratio):
    chunks = Chunks(starts=(2, 30), ends=(30, 71), num_tokens=80)  # prefix 2, query 9
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(80, generator=g)
    inp = _input(chunks, spec=lambda: (scores, al.identity(80)), deviation=torch.rand(80, generator=g))
    mask = get_selector(name).select(inp, ratio)
    assert mask.dtype == torch.bool and mask.shape == (80,)
    assert not (mask & ~chunks.mask()).any(), "only chunk tokens are recomputed by choice"
    want = {"full-reuse": 0, "full-recompute": 69}.get(name, chunks.budget(ratio))
    assert int(mask.sum()) == want
    if ratio == 1.0:
        assert torch.equal(mask, chunks.mask()) or name == "full-reuse"
    if ratio == 0.0:
        assert not mask.any() or name == "full-recompute"


def test_epic_takes_each_chunks_first_tokens_in_proportion():
    chunks = Chunks(starts=(0, 10), ends=(10, 40), num_tokens=45)
    mask = get_selector("epic").select(_input(chunks), 0.2)  # budget 8: 2 + 6
    assert mask.nonzero().flatten().tolist() == [0, 1, 10, 11, 12, 13, 14, 15]


def test_cacheblend_takes_the_largest_deviations():
    chunks = Chunks(starts=(0,), ends=(10,), num_tokens=12)
    dev = torch.tensor([0, 5, 1, 9, 0, 0, 7, 0, 0, 0, 100, 100], dtype=torch.float)  # query: not candidates
    mask = get_selector("cacheblend").select(_input(chunks, deviation=dev), 0.3)
    assert mask.nonzero().flatten().tolist() == [1, 3, 6]


def test_speccache_completes_spans_and_maps_through_the_alignment():
    # 12 speculative tokens, each two target tokens; chunk = target tokens [0, 20), query [20, 24)
    scores = torch.tensor([1.0, 1, 1, 1, 9, 9.5, 9.2, 5, 1, 1, 20, 20])
    alignment = al.Alignment(torch.arange(12) * 2, torch.arange(12) * 2 + 2, 24)
    chunks = Chunks(starts=(0,), ends=(20,), num_tokens=24)
    inp = _input(chunks, spec=lambda: (scores, alignment))
    mask = get_selector("speccache").select(inp, 0.3)  # budget 6 target tokens = 3 spec tokens
    # spans: [0-3] [4-6] [7] [8-9] [10-11]; top-3 candidates (10, 11 are the query): 5, 6, 4
    assert mask.nonzero().flatten().tolist() == [8, 9, 10, 11, 12, 13]
    assert inp.notes["spec_tokens_selected"] == 3


@pytest.mark.slow  # prepares qwen2.5-coder-0.5b (a 491 MB download) on a fresh machine
@pytest.mark.parametrize("text", [
    "naïve café — 文字化け and emoji 🙂🙂 done",
    "a  b   c\t\td\n\n\n  e",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
])
def test_alignment_between_smollm2_and_qwen_tokenizers(text, tokenizer):
    """SmolLM2 (speculative) onto Qwen2.5 (target): each SmolLM2 token maps exactly to
    the Qwen tokens whose characters overlap its own, and every Qwen token with
    characters is reached from some SmolLM2 token."""
    from transformers import AutoTokenizer

    from sglang_vc import models

    qwen = AutoTokenizer.from_pretrained(models.resolve("qwen2.5-coder-0.5b"))
    spec = [tuple(o) for o in tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]]
    tgt = [tuple(o) for o in qwen(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]]
    a = al.align(spec, tgt)
    for i, (s, e) in enumerate(spec):
        want = [j for j, (c, d) in enumerate(tgt) if c < e and d > s] if e > s else []
        assert list(range(int(a.start[i]), int(a.end[i]))) == want, (i, text[s:e])
    reached = a.to_target(torch.ones(len(spec), dtype=torch.bool))
    assert all(bool(reached[j]) for j, (c, d) in enumerate(tgt) if d > c)


def test_the_default_selector_is_epic_and_needs_no_small_model_until_asked():
    """The default is the selector measured best (#76, docs/speccache.md): a server given
    only a ratio selects with epic, loads no speculative model at start-up, and a request
    may still ask for the paper's ``speccache``."""
    import argparse

    from sglang_vc.speccache import flags
    from sglang_vc.speccache.frontend import Frontend

    parser = argparse.ArgumentParser()
    flags.add_cli_args(parser)
    settings = flags.settings_of(flags.from_cli_args(parser.parse_args(["--speccache-ratio", "0.2"])))
    assert settings.selector == "epic" and settings.ratio == 0.2
    front = Frontend(tokenizer_manager=None, settings=settings)
    assert front._spec is None and front._spec_error is None
    assert front.request_options({})[0] == "epic"
    assert front.request_options({"speccache_selector": "speccache"})[0] == "speccache"
