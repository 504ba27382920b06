"""Per-token signals for choosing which reused chunk tokens to recompute, on tensors a
model already produced (pure torch, no model).

* :func:`kv_deviation`: per layer, how far each token's reused K/V (its chunk prefilled
  alone, keys re-rotated to its position) is from the K/V of a full prefill: the L2
  norm of the K and V differences over all heads, ``sqrt(|dK|^2 + |dV|^2)``. On the
  target this is the oracle CacheBlend and SpecCache approximate; at layer 1 it is
  CacheBlend's own signal (layer-0 K/V never deviate: they depend on the token and
  position alone).
* :func:`value_norm`: per layer, each token's value-vector norm (SpecCache's argument
  for eq. 1 is that large hidden states make large values).
* :func:`layer_mean`: one score per token from per-layer scores, each layer first
  divided by its mean over the candidate tokens, so that no layer's scale dominates.
* :func:`depths`: the layer sets reported: ``first`` (1), ``middle``, ``deep`` (the
  last third, as SpecCache's eq. 1) and ``all`` (every layer but 0).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .spans import deep_layers

KV = Sequence[tuple[Tensor, Tensor]]  # per layer (K, V), each [1, Hkv, N, D]


def kv_deviation(full: KV, reused: KV) -> Tensor:
    """``[L, N]`` float32: per layer and token, ``sqrt(|K_full - K_reused|^2 +
    |V_full - V_reused|^2)`` summed over heads and channels."""
    rows = []
    for (kf, vf), (kr, vr) in zip(full, reused):
        n = min(kf.shape[2], kr.shape[2])
        dk = (kf[:, :, :n].float() - kr[:, :, :n].float()).pow(2).sum(dim=(0, 1, 3))
        dv = (vf[:, :, :n].float() - vr[:, :, :n].float()).pow(2).sum(dim=(0, 1, 3))
        rows.append((dk + dv).sqrt())
    return torch.stack(rows)


def value_norm(kv: KV) -> Tensor:
    """``[L, N]`` float32: each token's value norm over all heads, per layer."""
    return torch.stack([v.float().pow(2).sum(dim=(0, 1, 3)).sqrt() for _, v in kv])


def layer_mean(per_layer: Tensor, layers: Sequence[int], mask: Optional[Tensor] = None) -> Tensor:
    """``[N]``: the mean over ``layers`` of ``per_layer [L, N]``, each layer divided by
    its mean over ``mask`` (all tokens when ``None``) first; a layer whose mean is 0
    (nothing deviates there) adds 0."""
    rows = per_layer[list(layers)].float()
    sel = rows if mask is None else rows[:, mask]
    scale = sel.mean(dim=1, keepdim=True) if sel.numel() else torch.ones(rows.shape[0], 1)
    scaled = torch.where(scale > 0, rows / scale.clamp_min(1e-30), torch.zeros_like(rows))
    return scaled.mean(dim=0)


def depths(num_layers: int) -> dict[str, list[int]]:
    """The layer sets the oracle is reported at (layer 0 never deviates)."""
    if num_layers < 2:
        raise ValueError("a deviation needs at least 2 layers")
    return {"first": [1], "middle": [num_layers // 2], "deep": list(deep_layers(num_layers)),
            "all": list(range(1, num_layers))}
