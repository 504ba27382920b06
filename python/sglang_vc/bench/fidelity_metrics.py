"""The fidelity lab's per-step measures, shared by the compressors' runs
(:mod:`.fidelity_run`) and the in-pool draft views' (:mod:`.draft_views`)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def _kl(lp_full, lp_lossy) -> float:
    """KL(p_full || p_lossy) in nats from float64 log-probabilities."""
    return float((lp_full.exp() * (lp_full - lp_lossy)).sum())


def kl_along(rows, lp_ref, y) -> tuple[list[float], Optional[int]]:
    """Per-step KL of the lossy logits ``rows`` (step ``t`` at ``rows[t - 1]``) from the
    full-KV log-probs ``lp_ref`` along the trajectory ``y``, from a 0 at step 0; and the
    first step whose lossy argmax leaves it (None if none)."""
    import torch

    kl, first_div = [0.0], None
    for t, lg in enumerate(rows, start=1):
        kl.append(_kl(lp_ref[t], torch.log_softmax(lg.double(), -1)))
        if first_div is None and int(lg.argmax()) != y[t]:
            first_div = t
    return kl, first_div


def _cumsum(xs: Sequence[float]) -> list[float]:
    out, s = [], 0.0
    for x in xs:
        s += x
        out.append(s)
    return out


def matched_drafts(forward: Callable, y: Sequence[int], p: int, cap_x: int, first_chunk: int,
                   work: dict, grow: bool = True) -> int:
    """How many drafts from the committed prefix ``y[:p]`` follow the trajectory ``y`` (at
    most ``cap_x``): the last committed token and the matching drafts go through
    ``forward`` (token ids -> logits ``[n, V]``) in chunks of ``first_chunk`` tokens (then
    2x, 4x, ... with ``grow``), stopping at the first argmax that leaves ``y``. ``work``
    counts the forwards and tokens."""
    k, size = 0, first_chunk
    while k < cap_x:
        n = min(size, cap_x - k)
        am = forward(y[p - 1 + k : p - 1 + k + n]).argmax(-1).tolist()
        work["forwards"] += 1
        work["tokens"] += n
        for i in range(n):
            if am[i] != y[p + k + i]:
                return k + i
        k += n
        if grow:
            size *= 2
    return k
