"""Positional recovery: a chunk's keys, computed at chunk-local positions ``0 .. n-1``,
moved to absolute positions ``o .. o+n-1`` of the prompt that reuses it.

RoPE rotates each pair of key channels by ``position * inv_freq``; rotations compose, so
``R(o + i) = R(o) R(i)`` and one more rotation by the offset ``o`` moves every key of the
chunk (the approach of "CacheBlend" and "EPIC"). Values carry no position. The
rotation's ``cos`` / ``sin`` at ``o`` come from the model's own rotary embedding (its
cache row for position ``o``), so a scaled RoPE (linear, llama3, ...) is handled the way
the model handles it; an embedding that also scales magnitudes (YaRN's attention
factor) is not a pure rotation and is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(k: Tensor, cos: Tensor, sin: Tensor, neox: bool = True) -> Tensor:
    """``k [n, H, D]`` rotated by the angles whose ``cos`` / ``sin`` are ``[rot / 2]``
    (the first ``rot`` channels; the rest pass through). ``neox``: channel ``j`` pairs
    with ``j + rot/2`` (Llama, Qwen); otherwise with its neighbour (GPT-J)."""
    half = cos.shape[-1]
    rot = 2 * half
    x = k[..., :rot].float()
    c, s = cos.float().to(k.device), sin.float().to(k.device)
    if neox:
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([out.to(k.dtype), k[..., rot:]], dim=-1)


def shift(k: Tensor, offset: int, cos_sin_at, neox: bool = True) -> Tensor:
    """Keys computed at positions ``0 ..`` moved to ``offset ..``; ``cos_sin_at(offset)``
    gives the model's ``(cos, sin)`` there. Offset 0 returns ``k`` itself (bytes equal)."""
    if offset == 0:
        return k
    cos, sin = cos_sin_at(offset)
    return rotate(k, cos, sin, neox)


def hf_cos_sin(model):
    """``cos_sin_at`` for an HF transformers decoder (its ``model.rotary_emb``)."""
    rotary = model.model.rotary_emb
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ValueError(f"positional recovery needs a pure rotation; this RoPE scales by {scaling}")

    def at(offset: int):
        dummy = torch.zeros(1, 1, 1, dtype=torch.float32)
        cos, sin = rotary(dummy, torch.tensor([[offset]]))
        half = cos.shape[-1] // 2
        return cos[0, 0, :half], sin[0, 0, :half]

    return at


def sglang_cos_sin(model) -> tuple:
    """``(cos_sin_at, neox)`` for an SGLang model: its rotary embedding's ``cos_sin_cache``
    (row ``p`` is ``cos ++ sin`` of position ``p``). Refused unless every layer shares one
    pure rotation (``cos^2 + sin^2 = 1``; YaRN's magnitude scaling is not)."""
    rotaries = [m for m in model.modules() if hasattr(m, "cos_sin_cache") and hasattr(m, "is_neox_style")]
    if not rotaries:
        raise ValueError("positional recovery needs a RoPE model (no rotary embedding found)")
    cache = rotaries[0].cos_sin_cache
    neox = bool(rotaries[0].is_neox_style)
    half = cache.shape[-1] // 2
    cos, sin = cache[1:2, :half].float(), cache[1:2, half:].float()
    if not torch.allclose(cos * cos + sin * sin, torch.ones_like(cos), atol=1e-4):
        raise ValueError("positional recovery needs a pure rotation; this RoPE also scales magnitudes")

    def at(offset: int):
        if offset >= cache.shape[0]:
            raise ValueError(f"position {offset} is past the rotary cache ({cache.shape[0]} positions)")
        row = cache[offset].float()
        return row[:half], row[half:]

    return at, neox
