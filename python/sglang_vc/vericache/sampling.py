"""Verification rules of VeriCache (paper §4.1 steps 2-3, footnote 2), batched over
requests, as pure torch functions.

Shapes: ``B`` requests, ``X`` draft slots (padded; ``draft_lens[b] <= X`` are real),
``V`` vocabulary. The target (full-KV) pass yields ``X + 1`` rows per request: row ``k``
predicts the token after draft ``k - 1`` (row 0 follows the last committed token), row
``draft_lens[b]`` is the bonus row.

Both rules return a :class:`VerifyResult`: ``num_accepted[b]`` drafts accepted and
``tokens[b, :num_accepted[b] + 1]`` committed (accepted drafts, then the correction or
bonus token); the rest of ``tokens`` is ``pad_id``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class VerifyResult(NamedTuple):
    num_accepted: torch.Tensor  # [B] long, accepted draft tokens
    tokens: torch.Tensor  # [B, X + 1] long, committed tokens then pad_id
    num_tokens: torch.Tensor  # [B] long, committed tokens = num_accepted + 1


def _lens(draft_tokens: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    B, X = draft_tokens.shape
    if draft_lens is None:
        return torch.full((B,), X, dtype=torch.long, device=draft_tokens.device)
    lens = torch.as_tensor(draft_lens, dtype=torch.long, device=draft_tokens.device)
    if lens.shape != (B,):  # values must lie in [0, X]; not checked (no device sync)
        raise ValueError(f"draft_lens must have shape ({B},), got {tuple(lens.shape)}")
    return lens


def _commit(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor, pad_id: int
) -> VerifyResult:
    """Committed tokens: accepted drafts, then ``last`` at index ``num_accepted``."""
    B, X = draft_tokens.shape
    pos = torch.arange(X + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), pad_id)], dim=1)
    tokens = torch.where(pos < num_accepted[:, None], padded, torch.full_like(padded, pad_id))
    tokens.scatter_(1, num_accepted[:, None], last[:, None].to(tokens.dtype))
    return VerifyResult(num_accepted, tokens, num_accepted + 1)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of a [B, X] bool mask."""
    return accept.long().cumprod(dim=1).sum(dim=1)


# --------------------------------------------------------------------------- greedy


def greedy_verify_ids(
    draft_tokens: torch.Tensor,
    target_ids: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
    pad_id: int = -1,
) -> VerifyResult:
    """Greedy rule (§4.1 step 3) given the verifier's argmax ids ``t*`` [B, X + 1]:
    accept ``t_1 .. t_{j-1}`` up to the first ``j`` with ``t_j != t*_j`` and commit the
    correction ``t*_j``; if all drafts match, commit them plus the bonus ``t*_{x+1}``."""
    B, X = draft_tokens.shape
    if target_ids.shape != (B, X + 1):
        raise ValueError(f"target_ids must be [B, X+1] = {(B, X + 1)}, got {tuple(target_ids.shape)}")
    lens = _lens(draft_tokens, draft_lens)
    pos = torch.arange(X, device=draft_tokens.device)
    match = (draft_tokens == target_ids[:, :X]) & (pos < lens[:, None])
    n_acc = _accepted_prefix(match)
    last = target_ids.gather(1, n_acc[:, None]).squeeze(1)
    return _commit(draft_tokens, n_acc, last, pad_id)


def greedy_verify(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
    pad_id: int = -1,
) -> VerifyResult:
    """Greedy verification from target logits [B, X + 1, V] (argmax, first index on
    ties as torch.argmax)."""
    return greedy_verify_ids(draft_tokens, target_logits.argmax(dim=-1), draft_lens, pad_id)


# ------------------------------------------------------------------ rejection sampling


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pad_id: int = -1,
) -> VerifyResult:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.; the paper's refs
    [28, 44]) for temperature > 0: committed tokens are distributed exactly as sampling
    from the target.

    Draft ``t_k`` (drawn from ``q_k = draft_probs[:, k]``) is accepted with probability
    ``min(1, p_k(t_k) / q_k(t_k))``; at the first rejection a token is drawn from
    ``normalize(max(0, p_k - q_k))``; if all ``draft_lens[b]`` drafts pass, the bonus is
    drawn from ``p`` at row ``draft_lens[b]``.

    Args: ``draft_tokens`` [B, X] long; ``draft_probs`` [B, X, V]; ``target_probs``
    [B, X + 1, V] (rows need not be normalised); ``generator`` for determinism.
    """
    B, X = draft_tokens.shape
    if draft_probs.shape[:2] != (B, X) or target_probs.shape[:2] != (B, X + 1):
        raise ValueError("draft_probs must be [B, X, V] and target_probs [B, X+1, V]")
    device = target_probs.device
    lens = _lens(draft_tokens, draft_lens)
    p = target_probs.float()
    q = draft_probs.float()
    idx = draft_tokens.long()[..., None]
    p_tok = p[:, :X].gather(2, idx).squeeze(2)
    q_tok = q.gather(2, idx).squeeze(2)
    u = torch.rand((B, X), generator=generator, device=device)
    # u < p/q without dividing (q may be 0 for a token a deterministic drafter forced)
    accept = (u * q_tok < p_tok) & (torch.arange(X, device=device) < lens[:, None])
    n_acc = _accepted_prefix(accept)

    # Row to sample from: residual max(0, p - q) at the first rejection, or p itself at
    # the bonus row (there q is taken as 0, which makes the residual equal p).
    p_row = p.gather(1, n_acc[:, None, None].expand(B, 1, p.shape[2])).squeeze(1)
    if X > 0:
        q_idx = n_acc.clamp(max=X - 1)
        q_row = q.gather(1, q_idx[:, None, None].expand(B, 1, q.shape[2])).squeeze(1)
        q_row = torch.where((n_acc < lens)[:, None], q_row, torch.zeros_like(q_row))
    else:
        q_row = torch.zeros_like(p_row)
    residual = (p_row - q_row).clamp_min(0)
    # p == q everywhere means a rejection had probability 0; guard float dust anyway
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_row, residual)
    last = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return _commit(draft_tokens, n_acc, last, pad_id)


# --------------------------------------------------------------------------- dispatch


def probs_from_logits(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) in float32; ``temperature`` scalar or per request [B]."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if t.dim() == 1:
        t = t.view(-1, *([1] * (logits.dim() - 1)))
    return torch.softmax(logits.float() / t, dim=-1)


def verify(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float | torch.Tensor = 0.0,
    draft_probs: torch.Tensor | None = None,
    draft_lens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pad_id: int = -1,
) -> VerifyResult:
    """Per-request rule choice: greedy where ``temperature == 0``, rejection sampling at
    ``softmax(target_logits / T)`` elsewhere (``draft_probs`` then required: the
    drafter's distributions, at the same temperature, that the drafts were drawn from)."""
    B = draft_tokens.shape[0]
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=target_logits.device)
    temp = temp.expand(B) if temp.dim() == 0 else temp
    sampled = temp > 0
    if not bool(sampled.any()):
        return greedy_verify(draft_tokens, target_logits, draft_lens, pad_id)
    if draft_probs is None:
        raise ValueError("draft_probs is required for temperature > 0")
    lens = _lens(draft_tokens, draft_lens)
    if bool(sampled.all()):
        return rejection_verify(
            draft_tokens, draft_probs, probs_from_logits(target_logits, temp),
            lens, generator, pad_id,
        )
    g = (~sampled).nonzero().squeeze(1)
    s = sampled.nonzero().squeeze(1)
    rg = greedy_verify(draft_tokens[g], target_logits[g], lens[g], pad_id)
    rs = rejection_verify(
        draft_tokens[s], draft_probs[s], probs_from_logits(target_logits[s], temp[s]),
        lens[s], generator, pad_id,
    )
    n_acc = draft_tokens.new_zeros(B, dtype=torch.long)
    tokens = torch.full((B, draft_tokens.shape[1] + 1), pad_id, dtype=rg.tokens.dtype,
                        device=draft_tokens.device)
    n_acc[g], n_acc[s] = rg.num_accepted, rs.num_accepted
    tokens[g], tokens[s] = rg.tokens, rs.tokens
    return VerifyResult(n_acc, tokens, n_acc + 1)
