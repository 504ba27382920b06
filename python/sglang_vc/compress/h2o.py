"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023, arXiv:2306.14048).

Rule: a few "heavy hitter" tokens receive most of the attention. Each KV pair's score is
the attention it has *accumulated* (summed over all queries so far, and over the q heads
of its GQA group); the cache keeps the top heavy hitters plus a window of the most recent
tokens, the budget split evenly between the two as in the paper (``recent_fraction``).

Online: ``compress`` at the end of prefill scores with the prompt's queries (causal);
then after every decode/verify forward the runtime calls ``update``, which adds the new
queries' attention to the scores and evicts the lowest-scored non-recent tokens so that
each head keeps ``num_kept(total_len, ratio)`` tokens (the ratio, not a fixed size, is
held constant as the sequence grows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

from .base import DroppedKV, check_kv, check_ratio, num_kept
from .scorer import ScorerCompressor, grouped_attention


@dataclass
class _State:
    ratio: Fraction
    acc: Tensor  # float32 [H, total_len]: accumulated attention per absolute position
    kept: Tensor | None = None  # [H, m] positions currently cached, ascending per head


@dataclass
class H2O(ScorerCompressor):
    name: ClassVar[str] = "h2o"
    mode: ClassVar[str] = "online"
    needs_queries: ClassVar[str] = "prefill"

    recent_fraction: float = 0.5
    sm_scale: float | None = None
    _states: dict[tuple[Any, int], _State] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.recent_fraction <= 1:
            raise ValueError(f"h2o: recent_fraction must be in [0, 1], got {self.recent_fraction}")

    def protected(self, num_tokens, n_keep, *, queries=None):
        return 0, int(n_keep * self.recent_fraction)

    def _attention(self, queries: Tensor, keys: Tensor, k_pos: Tensor | None, total: int) -> Tensor:
        """Attention each key row received from ``queries`` (the last T positions): [H, m]."""
        t = queries.shape[0]
        if t > total:
            raise ValueError(f"h2o: {t} queries but only {total} tokens")
        q_pos = torch.arange(total - t, total, device=keys.device)
        return grouped_attention(queries, keys, q_pos, k_pos, sm_scale=self.sm_scale).sum(dim=(1, 2))

    def compress(self, layer_idx, k, v, ratio_or_bits, *, queries=None, req_id=None, **inputs) -> DroppedKV:
        ratio = check_ratio(ratio_or_bits, self.name)
        check_kv(k, v, self.name)
        n = k.shape[0]
        acc = (self._attention(queries, k, None, n) if queries is not None
               else torch.zeros(k.shape[1], n, dtype=torch.float32, device=k.device))
        state = self._states[(req_id, layer_idx)] = _State(ratio, acc)
        ckv = super().compress(layer_idx, k, v, ratio, queries=queries, req_id=req_id, **inputs)
        state.kept = ckv.kept_positions
        return ckv

    def score(self, layer_idx, k, v, *, queries=None, req_id=None, **inputs) -> Tensor:
        if queries is None:
            raise ValueError(
                "h2o needs queries=[T, num_q_heads, head_dim]: this layer's prompt queries "
                "(all of them, or the last T) to accumulate attention"
            )
        return self._states[(req_id, layer_idx)].acc

    def update(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor | Sequence[Tensor],
        v: Tensor | Sequence[Tensor] | None = None,
        hidden: Tensor | None = None,
        req_offsets: Tensor | Sequence[int] | None = None,
        *,
        req_ids: Sequence[Any] | None = None,
        positions: Sequence[Tensor] | None = None,
    ) -> list[Tensor]:
        """Accumulate this step's attention and evict, per request.

        ``q [total_q, Hq, D]``: the step's queries of all requests, concatenated;
        ``req_offsets [R + 1]``: where each request's queries start (default one request).
        ``k``: per request the key rows its queries attended to in this layer,
        ``[m_i, H, D]`` in pool layout: the kept rows then the new tokens' rows (a tensor
        for one request). ``v`` and ``hidden`` are not used by H2O.
        ``positions``: per request ``[H, m_i]`` absolute positions of those rows (default:
        the positions kept so far followed by the next new positions).
        ``req_ids``: the ``req_id`` each request was compressed with (default ``None``).
        Returns per request ``[H, n_drop]`` positions evicted now (ascending); the caller
        frees their rows. The most recent ``int(budget * recent_fraction)`` rows stay.
        """
        ks = [k] if isinstance(k, Tensor) else list(k)
        offsets = [0, q.shape[0]] if req_offsets is None else [int(o) for o in req_offsets]
        if len(offsets) != len(ks) + 1:
            raise ValueError(f"h2o.update: {len(ks)} requests but req_offsets has {len(offsets)} entries")
        if req_ids is None and len(ks) > 1:
            raise ValueError("h2o.update: pass req_ids when updating several requests")
        ids = [None] * len(ks) if req_ids is None else list(req_ids)
        drops = []
        for i, keys in enumerate(ks):
            state = self._states.get((ids[i], layer_idx))
            if state is None:
                raise ValueError(f"h2o.update: request {ids[i]!r} layer {layer_idx} was never compressed")
            pos = positions[i] if positions is not None else self._default_positions(state, keys)
            drops.append(self._step(state, q[offsets[i] : offsets[i + 1]], keys, pos))
        return drops

    @staticmethod
    def _default_positions(state: _State, keys: Tensor) -> Tensor:
        h, c = state.kept.shape
        new = keys.shape[0] - c
        if new < 0:
            raise ValueError(f"h2o.update: {keys.shape[0]} key rows but {c} are kept; pass positions")
        seen = state.acc.shape[1]
        fresh = torch.arange(seen, seen + new, device=keys.device).expand(h, new)
        return torch.cat([state.kept, fresh], dim=1)

    def _step(self, state: _State, q: Tensor, keys: Tensor, pos: Tensor) -> Tensor:
        h, m = pos.shape
        total = int(pos.max()) + 1
        if total > state.acc.shape[1]:  # new tokens start with zero accumulated attention
            state.acc = torch.nn.functional.pad(state.acc, (0, total - state.acc.shape[1]))
        if q.shape[0]:
            state.acc.scatter_add_(1, pos, self._attention(q, keys, pos, total))
        budget = num_kept(total, state.ratio)
        n_drop = m - budget
        if n_drop <= 0:
            state.kept = pos
            return pos.new_empty(h, 0)
        row_scores = state.acc.gather(1, pos)
        n_recent = int(budget * self.recent_fraction)
        if n_recent:
            row_scores[:, m - n_recent :] = float("inf")  # rows are ascending: last = recent
        drop_cols = row_scores.topk(n_drop, dim=1, largest=False).indices
        keep = torch.ones_like(pos, dtype=torch.bool).scatter_(1, drop_cols, False)
        state.kept = pos[keep].view(h, budget)
        return pos.gather(1, drop_cols).sort(dim=1).values

    def kept(self, layer_idx: int, req_id: Any = None) -> Tensor:
        """Positions currently cached for a request's layer, ``[H, m]`` ascending."""
        return self._states[(req_id, layer_idx)].kept

    def release(self, req_id: Any = None) -> None:
        for key in [key for key in self._states if key[0] == req_id]:
            del self._states[key]
