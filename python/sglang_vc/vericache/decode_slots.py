"""The KV slots a VERICACHE request takes at each decode iteration (staggered schedule).

SGLang's speculative decoding (spec v2) tops every running request up to ``committed +
2 * X`` allocated slots before each decode step (``get_alloc_reserve_per_decode``: room
for a draft chain, doubled for the overlap scheduler), and its retraction check asks for
the same. A plain server asks for one slot per request and step. So in a pool that holds
every request's prompt and new tokens with a few pages to spare, where a plain server
retracts nothing, SGLang retracts a VERICACHE request (an 8k-token re-prefill) for slots
that no forward writes.

Under the staggered schedule an iteration writes at most ONE new position per request: a
drafter its newest draft, a full-KV request its next token, a verifier nothing new (its
draft steps already wrote the run it verifies). So before an iteration a request needs
``committed + outstanding drafts + 1`` slots: at most one more per iteration, as plain
decoding. :func:`decode_alloc_lens` gives SGLang exactly that per request (through
``hooks.py``), and :func:`draft_cap` keeps a request from drafting past its last token,
so it never holds more slots than plain decoding holds at its end: the slots of rejected
drafts are reused by the next cycle, and SGLang frees every allocated slot when the
request leaves (``kv_allocated_len``), as it does for its own speculative workers.

No SGLang dependency.
"""

from __future__ import annotations

from typing import Callable, Optional


def decode_alloc_lens(reqs, ahead: Callable[[object], int], page_size: int) -> tuple[list[int], list[int], int]:
    """SGLang's ``page_aligned_decode_alloc_lens`` with a per-request reserve: for each
    request its allocated length now and after the next decode's allocation (at least
    ``kv_committed_len + ahead(req)``, page-aligned, never less than now), and the slots
    that allocation takes in all."""
    cur, nxt, needed = [], [], 0
    for r in reqs:
        now = r.kv.kv_allocated_len
        want = (r.kv.kv_committed_len + ahead(r) + page_size - 1) // page_size * page_size
        cur.append(now)
        nxt.append(max(now, want))
        needed += nxt[-1] - now
    return cur, nxt, needed


def draft_cap(max_new_tokens: Optional[int], output_len: int) -> Optional[int]:
    """The most drafts a request may hold before its next verify: a verify of ``d`` drafts
    commits at most ``d + 1`` tokens, so ``d`` stays below the tokens it has left (0: its
    last token, which a resident request decodes from its full KV and a compressed one
    verifies after one draft). None: no limit (no ``max_new_tokens``)."""
    if max_new_tokens is None:
        return None
    return max(0, max_new_tokens - output_len - 1)
