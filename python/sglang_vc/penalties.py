"""Frequency, presence and repetition penalties and ``min_new_tokens`` applied exactly at
every position of a speculative forward.

SGLang's penalizers (``sglang.srt.sampling.penaltylib``) keep one state per request,
advanced by one output token per decode step. A verify window scores ``x + 1`` positions
of a request at once, and position ``k`` must see the state after the ``k`` drafts
before it, as full-KV decoding would have had it when it produced that token. (SGLang's
own speculative workers apply the window's first state to every position: "a relaxed
version of penalties for speculative decoding", ``eagle_utils.py``.)

Here each logits row of a penalised request gets its own state, rebuilt from the
request's committed output ids plus the drafts before that row, with the formulas of
SGLang's penalizers in the order its sampler applies them: the additive penalties
(frequency, presence, ``min_new_tokens``) summed into one tensor and added, then the
multiplicative one (repetition, SGLang's own :func:`apply_scaling_penalties`). The
logits rows are the same floats full-KV decoding would have penalised, so a greedy
request commits the same tokens.

Cost: one ``[rows, vocab]`` scatter per penalty for the penalised requests' rows only,
and one host-to-device copy of their output ids per forward. Requests without
penalties are untouched (no work at all when none has any).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["PenaltyRows", "penalty_rows", "apply_penalties", "has_penalties"]


def has_penalties(sampling_params) -> bool:
    """Whether a request's sampling parameters ask for any penalty or a minimum length."""
    sp = sampling_params
    return (float(sp.frequency_penalty or 0.0) != 0.0 or float(sp.presence_penalty or 0.0) != 0.0
            or float(1.0 if sp.repetition_penalty is None else sp.repetition_penalty) != 1.0
            or int(sp.min_new_tokens or 0) > 0)


def _stop_ids(req) -> set[int]:
    """The tokens ``min_new_tokens`` masks: SGLang's ``BatchedMinNewTokensPenalizer`` set
    (stop ids, the request's EOS ids, the tokenizer's EOS and additional stop ids)."""
    tok = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
    return {i for i in ids if i is not None}


@dataclass(frozen=True)
class PenaltyRows:
    """The penalty state of each penalised logits row (``M`` rows, vocabulary ``V``).

    ``history`` holds each row's output tokens before its position, padded with ``V``
    (a column past the vocabulary that is sliced off); the per-row values are ``[M, 1]``
    and ``None`` where no request of the forward uses that penalty."""

    rows: torch.Tensor  # [M] long, indices into the forward's logits rows
    history: torch.Tensor  # [M, T] long
    lengths: torch.Tensor  # [M, 1] output tokens before each row
    frequency: Optional[torch.Tensor]
    presence: Optional[torch.Tensor]
    repetition: Optional[torch.Tensor]
    min_new_tokens: Optional[torch.Tensor]  # [M, 1] int
    stop_ids: Optional[torch.Tensor]  # [M, S] long, padded with V


def penalty_rows(reqs: Sequence, runs: Sequence[Sequence[int]], row_req: Sequence[int],
                 row_drafts: Sequence[int], vocab_size: int, device) -> Optional[PenaltyRows]:
    """The penalty state of each logits row of a forward, or None when no request has
    a penalty.

    ``runs[i]``: the tokens request ``i`` drafted after its committed ``output_ids``;
    logits row ``j`` belongs to request ``row_req[j]`` and follows ``row_drafts[j]`` of
    those drafts (0 for the row after its last committed token)."""
    penalised = [i for i, req in enumerate(reqs) if has_penalties(req.sampling_params)]
    if not penalised:
        return None
    keep = set(penalised)
    rows = [j for j, i in enumerate(row_req) if i in keep]
    if not rows:
        return None
    hist = {i: list(reqs[i].output_ids) + list(runs[i]) for i in penalised}
    lengths = [len(reqs[row_req[j]].output_ids) + int(row_drafts[j]) for j in rows]
    width = max(1, max(lengths))
    history = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
    for m, j in enumerate(rows):
        if lengths[m]:
            history[m, : lengths[m]] = torch.tensor(hist[row_req[j]][: lengths[m]], dtype=torch.int64)
    params = [reqs[row_req[j]].sampling_params for j in rows]

    def column(values, dtype, neutral):
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    min_new = column([int(sp.min_new_tokens or 0) for sp in params], torch.int64, 0)
    stop = None
    if min_new is not None:
        stops = [sorted(_stop_ids(reqs[row_req[j]])) for j in rows]
        stop = torch.full((len(rows), max(1, max(map(len, stops)))), vocab_size, dtype=torch.int64)
        for m, ids in enumerate(stops):
            if ids:
                stop[m, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        stop = stop.to(device)
    return PenaltyRows(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        history=history.to(device),
        lengths=torch.tensor(lengths, dtype=torch.int64, device=device)[:, None],
        frequency=column([float(sp.frequency_penalty or 0.0) for sp in params], torch.float32, 0.0),
        presence=column([float(sp.presence_penalty or 0.0) for sp in params], torch.float32, 0.0),
        repetition=column([float(1.0 if sp.repetition_penalty is None else sp.repetition_penalty)
                           for sp in params], torch.float32, 1.0),
        min_new_tokens=min_new,
        stop_ids=stop,
    )


def apply_penalties(logits: torch.Tensor, pen: Optional[PenaltyRows]) -> torch.Tensor:
    """``logits`` [N, V] float32 with each penalised row's penalties applied (a new
    tensor; ``logits`` itself is not written). The same arithmetic as SGLang's sampler:
    ``logits + ((0 - frequency) - presence + min_new_tokens mask)``, then the
    repetition scaling."""
    if pen is None:
        return logits
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    rows_n, vocab = pen.rows.shape[0], logits.shape[-1]
    idx = pen.history
    sub = logits.index_select(0, pen.rows).float()
    additive = torch.zeros(rows_n, vocab + 1, dtype=torch.float32, device=logits.device)
    if pen.frequency is not None:
        additive.sub_(torch.zeros_like(additive).scatter_add_(1, idx, pen.frequency.expand(idx.shape)))
    if pen.presence is not None:
        additive.sub_(torch.zeros_like(additive).scatter_(1, idx, pen.presence.expand(idx.shape)))
    if pen.min_new_tokens is not None:
        stop = torch.zeros_like(additive).scatter_(1, pen.stop_ids, float("-inf"))
        additive.add_(torch.where(pen.lengths < pen.min_new_tokens, stop, 0.0))
    sub.add_(additive[:, :vocab])
    if pen.repetition is not None:
        scale = torch.ones(rows_n, vocab + 1, dtype=torch.float32, device=logits.device)
        scale.scatter_(1, idx, pen.repetition.expand(idx.shape))
        sub = sub.contiguous()
        apply_scaling_penalties(sub, scale[:, :vocab].contiguous())
    out = logits.float().clone()
    out.index_copy_(0, pen.rows, sub)
    return out
