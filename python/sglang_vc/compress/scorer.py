"""Shared base for token-dropping methods (kvpress's ScorerPress pattern).

A method only defines ``score`` (higher = more important, one score per KV head and
position) and, where its paper protects them, a sink prefix and a recent window via
``protected``. The base turns scores into the kept set: the protected positions plus the
top-k of the remaining ones per head, all heads keeping ``num_kept(n, ratio)`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Compressor, DroppedKV, check_kv, check_ratio, num_kept


def grouped_attention(
    queries: Tensor,
    keys: Tensor,
    q_pos: Tensor,
    k_pos: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """Causal softmax attention probabilities, float32 ``[num_kv_heads, group, num_q, num_k]``.

    ``queries [num_q, Hq, D]``, ``keys [num_k, Hkv, D]``; q head ``i`` reads kv head
    ``i // (Hq // Hkv)`` (GQA). Key ``j`` is visible to query ``t`` iff
    ``k_pos[.., j] <= q_pos[t]``; ``k_pos`` is ``[num_k]`` or per head ``[Hkv, num_k]``
    (default ``arange(num_k)``). Scale defaults to ``1/sqrt(D)``.
    """
    t, hq, d = queries.shape
    n, hkv, dk = keys.shape
    if dk != d:
        raise ValueError(f"queries head_dim {d} != keys head_dim {dk}")
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv} (GQA)")
    q = queries.float().view(t, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    logits = torch.einsum("hgtd,nhd->hgtn", q, keys.float())
    logits = logits * (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))
    if k_pos is None:
        k_pos = torch.arange(n, device=keys.device)
    k_pos = k_pos.view(-1, 1, 1, n) if k_pos.dim() == 2 else k_pos.view(1, 1, 1, n)
    hidden = k_pos > q_pos.view(1, 1, t, 1)
    probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    return probs.nan_to_num(0.0)  # a query that sees no key contributes nothing


@dataclass
class ScorerCompressor(Compressor):
    """Token dropping by per-head scores. Subclasses implement ``score``."""

    scenario: ClassVar[str] = "token_dropping"

    def score(self, layer_idx: int, k: Tensor, v: Tensor, *, queries: Tensor | None = None,
              **inputs: Any) -> Tensor:
        """Importance ``[num_kv_heads, num_tokens]``; higher is kept first.

        ``inputs`` holds ``req_id`` and the method's ``extra_inputs``."""
        raise NotImplementedError

    def protected(self, num_tokens: int, n_keep: int, *, queries: Tensor | None = None) -> tuple[int, int]:
        """``(n_sink, n_recent)`` positions always kept, if the budget allows. Default none."""
        return 0, 0

    def compress(self, layer_idx, k, v, ratio_or_bits, *, queries=None, req_id=None, **inputs) -> DroppedKV:
        ratio = check_ratio(ratio_or_bits, self.name)
        check_kv(k, v, self.name)
        self._check_inputs(inputs)
        n, h = k.shape[0], k.shape[1]
        n_keep = num_kept(n, ratio)
        if n_keep == n:  # identity, bit-exact and without scoring (needs no queries)
            pos = torch.arange(n, device=k.device).expand(h, n).contiguous()
            return DroppedKV(layer_idx, n, 8 * k.element_size(), pos, k, v)
        scores = self.score(layer_idx, k, v, queries=queries, req_id=req_id, **inputs)
        if scores.shape != (h, n):
            raise RuntimeError(f"{self.name}.score returned {tuple(scores.shape)}, expected {(h, n)}")
        pos = self.select(scores, n_keep, *self.protected(n, n_keep, queries=queries))
        rows = pos.t()  # [n_keep, H]
        k_kept = k.gather(0, rows.unsqueeze(-1).expand(-1, -1, k.shape[2]))
        v_kept = v.gather(0, rows.unsqueeze(-1).expand(-1, -1, v.shape[2]))
        return DroppedKV(layer_idx, n, 8 * k.element_size(), pos, k_kept, v_kept)

    @staticmethod
    def select(scores: Tensor, n_keep: int, n_sink: int = 0, n_recent: int = 0) -> Tensor:
        """Kept positions ``[H, n_keep]`` ascending: sinks, recent window, then top scores.

        If the protected windows alone exceed the budget, keep the first ``n_sink`` sinks
        (as many as fit) and fill the rest with the most recent tokens, same for all heads.
        """
        h, n = scores.shape
        dev = scores.device
        n_sink = min(max(n_sink, 0), n)
        n_recent = min(max(n_recent, 0), n - n_sink)
        if n_sink + n_recent >= n_keep:
            s = min(n_sink, n_keep)
            pos = torch.cat([torch.arange(s, device=dev), torch.arange(n - (n_keep - s), n, device=dev)])
            return pos.expand(h, n_keep).contiguous()
        middle = scores[:, n_sink : n - n_recent].float()
        top = middle.topk(n_keep - n_sink - n_recent, dim=1).indices + n_sink
        fixed = torch.cat([torch.arange(n_sink, device=dev), torch.arange(n - n_recent, n, device=dev)])
        pos = torch.cat([fixed.expand(h, -1), top], dim=1)
        return pos.sort(dim=1).values

    def decompress(self, ckv: DroppedKV) -> tuple[Tensor, Tensor, Tensor]:
        if not isinstance(ckv, DroppedKV):
            raise ValueError(f"{self.name}: expected a DroppedKV, got {type(ckv).__name__}")
        return ckv.k, ckv.v, ckv.kept_positions
