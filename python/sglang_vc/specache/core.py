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

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from sgl_kernel_ext.dispatch import on_device
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
    idx = on_device(positions.t(), k_full.device)  # [k, H]
    k = k_full.gather(0, idx.unsqueeze(-1).expand(-1, -1, k_full.shape[2]))
    v = v_full.gather(0, idx.unsqueeze(-1).expand(-1, -1, v_full.shape[2]))
    return Rows(positions, k, v)


def substitute(kq: Tensor, vq: Tensor, rows: Optional[Rows]) -> tuple[Tensor, Tensor]:
    """``C' U C_K`` of eq. 1: the dequantized payload with ``rows`` put back in full
    precision (a copy; ``kq``/``vq`` are not modified)."""
    if rows is None or rows.num_rows == 0:
        return kq, vq
    idx = on_device(rows.positions.t(), kq.device)  # [k, H]
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
    return _Scores.of(q, kq, k_tail, q_start, scale).attend(vq, v_tail, rows)


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
    after the attention) and attend again with them substituted. The scores over the
    payload are computed once: the second attention rescores only the fetched rows."""
    scores = _Scores.of(q, kq, k_tail, q_start, scale)
    rows = fetch(select_topk(scores.probs()[0], kq.shape[1], topk))
    return scores.attend(vq, v_tail, rows), rows


@dataclass
class _Scores:
    """Raw scores of one request's queries, grouped by KV head so that GQA needs no
    copy of the keys: query row ``r`` of head ``h`` is query ``r // g``'s head
    ``h * g + r % g``."""

    q: Tensor  # [H, T*g, D] float32
    payload: Tensor  # [H, T*g, n_q]
    tail: Tensor  # [H, T*g, m], -inf where causally hidden
    t: int
    scale: float
    dtype: torch.dtype  # the queries'

    @classmethod
    def of(cls, q: Tensor, kq: Tensor, k_tail: Tensor, q_start: int, scale: float) -> "_Scores":
        t, hq, d = q.shape
        n_q, h, m = kq.shape[0], k_tail.shape[1], k_tail.shape[0]
        qh = q.float().view(t, h, hq // h, d).transpose(0, 1).reshape(h, -1, d)
        s_p = torch.matmul(qh, kq.float().permute(1, 2, 0)) * scale
        s_t = torch.matmul(qh, k_tail.float().permute(1, 2, 0)) * scale
        # tail row j is position n_q + j; query row r is position q_start + r // g
        last = q_start + torch.arange(t, device=q.device).repeat_interleave(hq // h)
        s_t.masked_fill_((n_q + torch.arange(m, device=q.device))[None, :] > last[:, None], float("-inf"))
        return cls(qh, s_p, s_t, t, scale, q.dtype)

    def probs(self) -> Tensor:
        """``[T, Hq, n_q]``: each query's attention probabilities over the payload rows,
        as :meth:`attend` without rows computes them, without the values' product (the
        first pass of :func:`attend_fetching` needs only these)."""
        return self._per_query(self._softmax(self.payload)[0])

    def _per_query(self, x: Tensor) -> Tensor:
        """``[H, T*g, c]`` grouped by KV head -> ``[T, Hq, c]`` per query and query head."""
        h, tg, c = x.shape
        return x.view(h, self.t, tg // self.t, c).transpose(0, 1).reshape(self.t, -1, c)

    def _softmax(self, s_p: Tensor) -> tuple[Tensor, Tensor]:
        top = functools.reduce(torch.maximum, [s.amax(2, keepdim=True) for s in (s_p, self.tail) if s.shape[2]])
        p_p, p_t = torch.exp(s_p - top), torch.exp(self.tail - top)
        norm = p_p.sum(2, keepdim=True) + p_t.sum(2, keepdim=True)
        return p_p.div_(norm), p_t.div_(norm)

    def attend(self, vq: Tensor, v_tail: Tensor, rows: Optional[Rows]) -> Attended:
        tg = self.payload.shape[1]
        s_p = self.payload
        if rows is not None and rows.num_rows:
            idx = rows.positions.unsqueeze(1).expand(-1, tg, -1)  # [H, T*g, k] (on the scores' device)
            s_p = s_p.scatter(2, idx, torch.matmul(self.q, rows.k.float().permute(1, 2, 0)) * self.scale)
        p_p, p_t = self._softmax(s_p)
        out = torch.matmul(p_p, vq.float().transpose(0, 1)) + torch.matmul(p_t, v_tail.float().transpose(0, 1))
        if rows is not None and rows.num_rows:
            # the fetched rows' values replace their low-bit ones: add p * (v_full - v_low)
            v_low = vq.gather(0, rows.positions.t().unsqueeze(-1).expand(-1, -1, vq.shape[2]))
            out += torch.matmul(p_p.gather(2, idx), (rows.v.float() - v_low.float()).transpose(0, 1))
        return Attended(self._per_query(out).to(self.dtype), self._per_query(p_p))
