"""SpeCache's attention, pure torch, one request and one layer at a time.

Shared by the serving path (the ``specache`` attention backend) and the fidelity lab's
HF simulation, so that both compute the same thing.

A request's keys in one layer are

    [dequantized KIVI payload: positions 0 .. n_q-1]  ++  [full-precision tail: n_q .. ]

(the tail is KIVI's residual plus the tokens decoded since, in the device KV pool). The
payload's full-precision rows live in host memory; eq. 1 of the paper attends over the
payload *with the prefetched rows replaced by their full-precision values*
(:class:`Rows`, per KV head: each head has its own top-k). The attention of one query
row over the payload then picks the next step's top-k rows (algorithm 3:
``ArgTopK(A_{1,:})``, the speculative token's row; algorithm 2 and the non-speculative
mode: the output token's own row). For GQA models a KV head's score of a row is the sum
of its query heads' attention probabilities.

Attention is computed eagerly (scores, float32 softmax, probabilities times values) so
that the probabilities the top-k needs come from the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rows:
    """Full-precision rows of some payload positions, per KV head: row ``j`` of head
    ``h`` is the token at ``positions[h, j]``."""

    positions: Tensor  # [H, k] int64, payload positions
    k: Tensor  # [k, H, D]
    v: Tensor  # [k, H, Dv]

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[1])

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def gather_rows(k_full: Tensor, v_full: Tensor, positions: Tensor) -> Rows:
    """The rows ``positions [H, k]`` of full-precision ``k_full/v_full [N, H, D]``."""
    idx = positions.t().to(k_full.device)  # [k, H]
    k = k_full.gather(0, idx.unsqueeze(-1).expand(-1, -1, k_full.shape[2]))
    v = v_full.gather(0, idx.unsqueeze(-1).expand(-1, -1, v_full.shape[2]))
    return Rows(positions, k, v)


def substitute(kq: Tensor, vq: Tensor, rows: Optional[Rows]) -> tuple[Tensor, Tensor]:
    """``C' U C_K`` of eq. 1: the dequantized payload with ``rows`` put back in full
    precision (a copy; ``kq``/``vq`` are not modified)."""
    if rows is None or rows.num_rows == 0:
        return kq, vq
    idx = rows.positions.t().to(kq.device)  # [k, H]
    k = kq.clone()
    v = vq.clone()
    k.scatter_(0, idx.unsqueeze(-1).expand(-1, -1, k.shape[2]), rows.k.to(k.dtype))
    v.scatter_(0, idx.unsqueeze(-1).expand(-1, -1, v.shape[2]), rows.v.to(v.dtype))
    return k, v


def head_scores(probs: Tensor, num_kv_heads: int) -> Tensor:
    """``probs [Hq, n]`` of one query row -> ``[H, n]``: each KV head's score of a row is
    the sum over its query heads (q head i reads kv head ``i // (Hq / H)``)."""
    hq, n = probs.shape
    return probs.view(num_kv_heads, hq // num_kv_heads, n).sum(1)


def select_topk(probs: Tensor, num_kv_heads: int, k: int) -> Tensor:
    """The ``min(k, n)`` payload rows of highest score per KV head, ``[H, k']`` int64,
    ascending positions (so that a set compares equal whatever the tie order)."""
    from sgl_kernel_ext import select_topk as topk_of_scores

    return topk_of_scores(head_scores(probs, num_kv_heads), k)


def coverage(probs: Tensor, positions: Tensor, num_kv_heads: int, k: int) -> tuple[float, float]:
    """Prefetch hit of one step: ``(covered, total)`` where ``total`` is the attention
    mass of the output token's own top-``k`` rows (per KV head, summed) and ``covered``
    the part of it on rows that were prefetched (``positions [H, k]``)."""
    return coverage_of_scores(head_scores(probs, num_kv_heads), positions, k)


def coverage_of_scores(scores: Tensor, positions: Tensor, k: int) -> tuple[float, float]:
    """:func:`coverage` from the per-KV-head scores ``[H, n]``."""
    kk = min(int(k), scores.shape[1])
    if kk <= 0:
        return 0.0, 0.0
    top = scores.topk(kk, dim=1)
    hit = torch.zeros_like(scores, dtype=torch.bool)
    if positions.numel():
        hit.scatter_(1, positions.to(scores.device), True)
    covered = (top.values * hit.gather(1, top.indices)).sum()
    return float(covered), float(top.values.sum())


@dataclass
class Attended:
    """One layer's SpeCache attention of one request."""

    out: Tensor  # [T, Hq, Dv]
    # [T, Hq, n_q] attention probabilities of each query over the payload rows; None on the
    # fused (Triton) path, which computes a row's scores when asked (``scores_of``)
    probs: Optional[Tensor]
    scores_of: Optional[Callable[[int], Tensor]] = None

    def head_scores(self, t: int, num_kv_heads: int) -> Tensor:
        """``[H, n_q]``: query row ``t``'s attention on each payload row, per KV head."""
        if self.scores_of is not None:
            return self.scores_of(t)
        return head_scores(self.probs[t], num_kv_heads)


def attend(
    q: Tensor,
    kq: Tensor,
    vq: Tensor,
    k_tail: Tensor,
    v_tail: Tensor,
    *,
    q_start: int,
    scale: float,
    rows: Optional[Rows] = None,
) -> Attended:
    """Eq. 1 for one request: queries ``q [T, Hq, D]`` at positions ``q_start ..`` over
    the payload ``kq/vq [n_q, H, D]`` (positions ``0 .. n_q-1``, dequantized; ``rows``
    substituted) followed by the tail ``k_tail/v_tail [m, H, D]`` at positions
    ``n_q .. n_q+m-1``, causal by position."""
    t, hq, _ = q.shape
    n_q, h = kq.shape[0], kq.shape[1]
    k_p, v_p = substitute(kq, vq, rows)
    keys = torch.cat([k_p.to(k_tail.dtype), k_tail]).float()
    vals = torch.cat([v_p.to(v_tail.dtype), v_tail]).float()
    group = hq // h
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.float(), keys) * scale  # [Hq, T, N]
    n = keys.shape[0]
    key_pos = torch.arange(n, device=q.device)
    q_pos = torch.arange(q_start, q_start + t, device=q.device)
    if n - 1 > q_start:  # some key lies after the first query: causal mask
        scores.masked_fill_((key_pos[None, :] > q_pos[:, None])[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("htn,nhd->thd", probs, vals).to(q.dtype)
    return Attended(out, probs[:, :, :n_q].transpose(0, 1))


def attend_fetching(
    q: Tensor,
    kq: Tensor,
    vq: Tensor,
    k_tail: Tensor,
    v_tail: Tensor,
    *,
    q_start: int,
    scale: float,
    topk: int,
    fetch: Callable[[Tensor], Rows],
) -> tuple[Attended, Rows]:
    """The non-speculative comparison (the paper's table 4): attend over the low-bit
    payload, take the output token's own top-``topk`` rows, ``fetch`` them (synchronous,
    after the attention) and attend again with them substituted."""
    first = attend(q, kq, vq, k_tail, v_tail, q_start=q_start, scale=scale)
    positions = select_topk(first.probs[0], kq.shape[1], topk)
    rows = fetch(positions)
    return attend(q, kq, vq, k_tail, v_tail, q_start=q_start, scale=scale, rows=rows), rows
