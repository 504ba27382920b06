"""Grammar masks across a verify window (``sglang_vc.grammar_masks``), with SGLang's
xgrammar backend and the embedded model's tokenizer: each row is masked with the
grammar after the drafts before it, a draft the grammar forbids is rejected by its own
row's mask, and the request's grammar ends where it started (rolled back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_vc.grammar_masks import apply_grammars


@pytest.fixture(scope="module")
def backend(tokenizer):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    return XGrammarGrammarBackend(tokenizer, vocab_size=len(tokenizer))


def _one(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_each_row_masked_after_the_drafts_before_it(backend, tokenizer):
    """Regex ``(ab)+c``: after ``a`` only ``b`` is allowed, after ``ab`` ``a`` or ``c``.
    Rows follow 0, 1, 2 drafts of ``[b, a]``, with the grammar standing after ``a``."""
    a, b, c = _one(tokenizer, "a"), _one(tokenizer, "b"), _one(tokenizer, "c")
    grammar = backend.dispatch_regex("(ab)+c")
    grammar.accept_token(a)  # the committed output so far: "a"
    req = SimpleNamespace(grammar=grammar)
    vocab = len(tokenizer)
    logits = torch.zeros(3, vocab)
    got = apply_grammars(logits, [req], [a], [[b, a]], [0, 0, 0], [0, 1, 2])
    assert b in _allowed(got[0]) and a not in _allowed(got[0]) and c not in _allowed(got[0])
    assert {a, c} <= _allowed(got[1]) and b not in _allowed(got[1])
    assert b in _allowed(got[2]) and c not in _allowed(got[2])
    assert torch.equal(logits, torch.zeros(3, vocab))  # a new tensor: the input is untouched
    # rolled back: the grammar still stands after "a" (only "b" next)
    again = apply_grammars(torch.zeros(1, vocab), [req], [a], [[]], [0], [0])
    assert _allowed(again[0]) == _allowed(got[0])


def test_a_forbidden_draft_is_rejected_by_its_rows_mask(backend, tokenizer):
    """Drafts ``[c, b]`` after ``a``: ``c`` is not allowed there, so row 0 (the one that
    verifies it) bans it -- a greedy verify commits row 0's argmax instead -- and the
    walk stops; the grammar is rolled back all the same."""
    a, b, c = _one(tokenizer, "a"), _one(tokenizer, "b"), _one(tokenizer, "c")
    grammar = backend.dispatch_regex("(ab)+c")
    grammar.accept_token(a)
    req = SimpleNamespace(grammar=grammar)
    logits = torch.zeros(3, len(tokenizer))
    logits[0, c] = 10.0  # the model would pick the forbidden draft
    got = apply_grammars(logits, [req], [a], [[c, b]], [0, 0, 0], [0, 1, 2])
    assert got[0].argmax().item() == b
    grammar.accept_token(b)  # the state is still after "a": "b" is legal next
    assert not grammar.is_terminated()


def test_requests_without_a_grammar_are_untouched(backend, tokenizer):
    a = _one(tokenizer, "a")
    grammar = backend.dispatch_regex("a+")
    plain, constrained = SimpleNamespace(grammar=None), SimpleNamespace(grammar=grammar)
    logits = torch.randn(3, len(tokenizer))
    assert apply_grammars(logits, [plain], [a], [[a]], [0, 0], [0, 1]) is logits
    got = apply_grammars(logits, [plain, constrained], [a, a], [[a], []], [0, 0, 1], [0, 1, 0])
    assert torch.equal(got[:2], logits[:2]) and not torch.isfinite(got[2]).all()
