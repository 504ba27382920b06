"""KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv:2505.23416).

Rule: a KV pair is important if the model needs it to *reconstruct the context*. The
runtime runs the model once more on "<context KV> + 'Repeat the previous context
exactly.' + <context tokens>" (teacher-forced). Each context KV pair's importance is the
maximum attention it receives from any query of that reconstruction pass, maxed over the
q heads of its GQA group. Query-agnostic: scored once, reused for every later question.
As in the reference implementation, the first ``n_sink`` tokens are always kept.

Inputs: ``queries`` = this layer's queries of the reconstruction pass
``[T, num_q_heads, head_dim]`` (the runtime produces them by running the prompt above; this
library never runs a model). Optional ``recon_keys`` ``[T, num_kv_heads, head_dim]``: the
reconstruction tokens' own keys, so the softmax is normalised over everything those
queries really see (context + causal reconstruction prefix); without them it is
normalised over the context only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .scorer import ScorerCompressor, grouped_attention


@dataclass
class KVzip(ScorerCompressor):
    name: ClassVar[str] = "kvzip"
    needs_queries: ClassVar[str] = "reconstruction"
    extra_inputs: ClassVar[tuple[str, ...]] = ("recon_keys",)

    n_sink: int = 4
    sm_scale: float | None = None

    def score(self, layer_idx, k, v, *, queries=None, recon_keys=None, **inputs) -> Tensor:
        n = k.shape[0]
        if queries is None or queries.dim() != 3:
            raise ValueError(
                "kvzip needs queries=[T, num_q_heads, head_dim]: this layer's queries of the "
                "context-reconstruction pass"
            )
        t = queries.shape[0]
        keys, k_pos = k, torch.arange(n, device=k.device)
        if recon_keys is not None:
            if recon_keys.shape != (t, k.shape[1], k.shape[2]):
                want = f"[T={t}, {k.shape[1]}, {k.shape[2]}]"
                raise ValueError(f"kvzip: recon_keys must be {want}, got {tuple(recon_keys.shape)}")
            keys = torch.cat([k, recon_keys.to(k.dtype)])
            k_pos = torch.arange(n + t, device=k.device)
        q_pos = torch.arange(n, n + t, device=k.device)  # reconstruction follows the context
        probs = grouped_attention(queries, keys, q_pos, k_pos, sm_scale=self.sm_scale)
        return probs[..., :n].amax(dim=(1, 2))  # max over group and queries -> [H, n]

    def protected(self, num_tokens, n_keep, *, queries=None):
        return self.n_sink, 0
