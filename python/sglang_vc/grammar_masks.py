"""Structured output (JSON schema, regex, EBNF, structural tags) at every position of a
speculative forward, with SGLang's own grammar objects (xgrammar by default).

A request's grammar (``req.grammar``) stands after its committed output. For a forward
row that follows ``k`` of the request's drafts, the vocabulary mask is the grammar's after
those drafts: the chain ``[last output, d1 .. dm]`` is walked with SGLang's
``traverse_tree`` (the EAGLE verify's walk, here over a chain): accept each draft, fill
that position's mask, roll back, so the grammar ends where it started; the scheduler
advances it over the committed tokens itself (``advance_grammar_fsm``). A draft the
grammar does not allow stops the walk: the verify rejects it (its position's mask bans
it), so the rows after it are never committed.

The mask goes on after the penalties and before ``logit_bias``, the order of SGLang's
sampler. Drafting rows are masked too, so drafts stay inside the grammar and are
accepted more often.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from sgl_kernel_ext.payload_batch import to_device

__all__ = ["apply_grammars"]


def _chain_masks(grammar, chain: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Bitmask rows ``[len(chain), words]``: row ``k`` allows what the grammar allows
    after ``chain[1 .. k]`` (``chain[0]`` is the last committed token)."""
    from sglang.srt.speculative.spec_utils import traverse_tree

    n = len(chain)
    mask = grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=n, device="cpu")
    next_token = torch.arange(1, n + 1, dtype=torch.int64)
    next_token[-1] = -1
    traverse_tree(next_token, torch.full((n,), -1, dtype=torch.int64), torch.tensor(chain, dtype=torch.int64),
                  grammar, mask, vocab_size=vocab_size)
    return mask


def apply_grammars(logits: torch.Tensor, reqs: Sequence, last_tokens: Sequence[int], runs: Sequence[Sequence[int]],
                   row_req: Sequence[int], row_drafts: Sequence[int],
                   masked_rows: Optional[Sequence[bool]] = None) -> torch.Tensor:
    """``logits`` [N, V] with each grammar-constrained request's vocabulary mask applied
    at each of its rows (a new tensor where any request has a grammar; ``logits``
    itself otherwise). Row ``j`` is request ``row_req[j]``'s after ``row_drafts[j]`` of
    its drafts ``runs[i]``; ``last_tokens[i]`` is its last committed token. Given
    ``masked_rows``, only the rows where it is true are masked (``--vc-draft-grammar
    off`` leaves the drafting rows unmasked)."""
    constrained = [i for i, req in enumerate(reqs) if getattr(req, "grammar", None) is not None
                   and not req.grammar.finished and not req.grammar.is_terminated()]
    if not constrained:
        return logits
    vocab = logits.shape[-1]
    masks = {i: _chain_masks(reqs[i].grammar, [last_tokens[i], *runs[i]], vocab) for i in constrained}
    rows = [j for j, i in enumerate(row_req) if i in masks and (masked_rows is None or masked_rows[j])]
    if not rows:
        return logits
    bitmask = torch.stack([masks[row_req[j]][row_drafts[j]] for j in rows])
    grammar = reqs[constrained[0]].grammar
    index = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)  # (pinned, no wait)
    sub = logits.index_select(0, index).contiguous()
    grammar.apply_vocab_mask(sub, grammar.move_vocab_mask(bitmask, logits.device))
    out = logits.clone()
    out.index_copy_(0, index, sub)
    return out
