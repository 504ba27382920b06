"""SpecCache's selective-recompute prefill, simulated exactly in HF transformers (the
lab the server path is measured against).

A RAG prompt is ``[prefix][chunk 1]...[chunk c][query]``. Each chunk's KV is computed
once, alone, at positions ``0 ..`` (:func:`chunk_kv`); a prompt that reuses it gets its
keys moved to the chunk's absolute position (:func:`assemble`, positional recovery by
RoPE composition). The prefill then runs the target model on the recomputed tokens only
(the selected chunk tokens and every token outside the chunks) at their true positions:
in each layer their new K/V overwrite the reused rows of the fused KV, and each attends
over the fused KV causally by position (:class:`FusedPrefill`, plugged into the lab's
attention function). With every chunk token recomputed this is a full prefill; with
none, full reuse.

CacheBlend's signal (:func:`first_layer_deviation`): the first layer runs over every
token, and each token's deviation is the L2 distance between the K/V it then feeds the
second layer and the reused K/V there (layer-0 K/V depend on the token and position
alone, so they never deviate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from sglang_vc.speccache import rope

from .lossy_hf import Session, _repeat_kv


@dataclass
class FusedKV:
    """Per layer ``[1, Hkv, N, D]`` K and V of one prompt (reused rows; recomputed ones
    overwrite them during the prefill)."""

    k: list[Tensor]
    v: list[Tensor]

    def clone(self) -> "FusedKV":
        return FusedKV([t.clone() for t in self.k], [t.clone() for t in self.v])

    def cache(self):
        from transformers import DynamicCache

        return DynamicCache(list(zip(self.k, self.v)))


class _Stop(Exception):
    pass


class FusedPrefill:
    """The attention of the recomputed tokens (``positions [T]``, ascending) over the
    fused KV. ``probe_layer``: record the new K/V of that layer and stop the forward."""

    def __init__(self, fused: FusedKV, positions: Tensor, probe_layer: int | None = None):
        self.fused, self.positions = fused, positions
        self.probe_layer = probe_layer
        self.probed: tuple[Tensor, Tensor] | None = None

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float, groups: int) -> Tensor:
        if layer == self.probe_layer:
            self.probed = (key, value)
            raise _Stop
        k_all, v_all = self.fused.k[layer], self.fused.v[layer]
        k_all[:, :, self.positions] = key.to(k_all.dtype)
        v_all[:, :, self.positions] = value.to(v_all.dtype)
        k_rep, v_rep = _repeat_kv(k_all, groups), _repeat_kv(v_all, groups)
        scores = torch.matmul(query, k_rep.transpose(2, 3)) * scaling  # [1, Hq, T, N]
        key_pos = torch.arange(k_all.shape[2])
        scores.masked_fill_((key_pos[None, :] > self.positions[:, None])[None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, v_rep).transpose(1, 2).contiguous()


@torch.no_grad()
def chunk_kv(sess: Session, ids: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
    """A chunk's KV computed alone at positions ``0 ..``: per layer ``[1, Hkv, n, D]``."""
    cache, _, _, _ = sess.prefill(ids)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def assemble(num_tokens: int, starts: Sequence[int], kvs: Sequence[list[tuple[Tensor, Tensor]]],
             cos_sin_at) -> FusedKV:
    """The reused KV of a prompt: chunk ``i``'s KV at ``starts[i]``, keys re-rotated to
    it; positions outside the chunks are zeros (they are always recomputed)."""
    k0, v0 = kvs[0][0]
    num_layers = len(kvs[0])
    ks = [k0.new_zeros(1, k0.shape[1], num_tokens, k0.shape[3]) for _ in range(num_layers)]
    vs = [v0.new_zeros(1, v0.shape[1], num_tokens, v0.shape[3]) for _ in range(num_layers)]
    for start, kv in zip(starts, kvs):
        for layer, (k, v) in enumerate(kv):
            n = k.shape[2]
            moved = rope.shift(k[0].transpose(0, 1), start, cos_sin_at)  # [n, H, D]
            ks[layer][0, :, start : start + n] = moved.transpose(0, 1)
            vs[layer][0, :, start : start + n] = v[0]
    return FusedKV(ks, vs)


@torch.no_grad()
def selective_prefill(sess: Session, ids: Sequence[int], reused: FusedKV, recompute: Tensor) -> tuple[Tensor, FusedKV]:
    """Prefill ``ids`` computing only the tokens where ``recompute [N]`` is True (the last
    token must be one of them). Returns the last token's logits (float32 ``[V]``) and the
    fused KV, from which decoding continues (:meth:`FusedKV.cache`)."""
    if not bool(recompute[-1]):
        raise ValueError("the last prompt token must be recomputed (its logits start the answer)")
    fused = reused.clone()
    positions = recompute.nonzero().flatten()
    ids_t = torch.tensor([int(ids[i]) for i in positions.tolist()])
    sess.ctl.fuse = FusedPrefill(fused, positions)
    try:
        out = sess.model(input_ids=ids_t[None], position_ids=positions[None], use_cache=False, logits_to_keep=1)
    finally:
        sess.ctl.fuse = None
    return out.logits[0, -1].float(), fused


@torch.no_grad()
def first_layer_deviation(sess: Session, ids: Sequence[int], reused: FusedKV) -> Tensor:
    """CacheBlend's per-token deviation ``[N]`` (see the module docstring)."""
    n = len(ids)
    positions = torch.arange(n)
    probe = FusedPrefill(reused.clone(), positions, probe_layer=1)
    sess.ctl.fuse = probe
    try:
        sess.model(input_ids=torch.tensor([list(ids)]), position_ids=positions[None], use_cache=False)
    except _Stop:
        pass
    finally:
        sess.ctl.fuse = None
    k_new, v_new = probe.probed
    dk = (k_new - reused.k[1]).float().pow(2).sum(dim=(0, 1, 3))
    dv = (v_new - reused.v[1]).float().pow(2).sum(dim=(0, 1, 3))
    return (dk + dv).sqrt()


@torch.no_grad()
def greedy(sess: Session, first_logits: Tensor, cache, max_new: int, eos: set[int]) -> list[int]:
    """Greedy answer tokens from a prefilled ``cache``."""
    out = [int(first_logits.argmax())]
    while len(out) < max_new and out[-1] not in eos:
        out.append(int(sess.step(cache, out[-1]).argmax()))
    return out
