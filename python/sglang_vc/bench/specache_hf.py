"""Exact simulation of SpeCache inside HF transformers, for the fidelity lab.

The model's cache (a ``DynamicCache``) holds the full-precision KV: it plays the host
copy. While a :class:`SpeCacheSim` is attached to the lab's controller, every attention
layer computes :func:`sglang_vc.specache.core.attend` instead of plain attention: over the
dequantized KIVI copy of positions ``[0, n_q)`` with the prefetched rows put back in full
precision, then the full-precision tail. Quantization follows the serving path's rule:
the prompt is split by KIVI (``n_q = floor((T - R) / g) * g``), and after each step the
oldest ``g`` tail tokens are quantized once the tail reaches ``R + g``.

Steps (algorithms 2 and 3 of the paper; ``y`` is the output sequence, ``y_0`` the
prefill's token, position ``T`` its position):

* pre-decode: forward ``[y_0]`` over the low-bit copy; its attention picks the first
  top-k rows, its output is the first speculative token ``s_1``;
* step ``t >= 1``: forward ``[y_{t-1}, s_t]``; row 0 (the output token) attends with the
  rows picked last step and gives ``p(y_t | y_<t)``; row 1 (the speculative token) picks
  the next rows and gives ``s_{t+1}``. Only ``y_{t-1}``'s KV stays in the cache.

The non-speculative mode forwards ``[y_{t-1}]`` alone and, in every layer, attends over
the low-bit copy, fetches that token's own top-k rows and attends again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from sglang_vc.specache import core
from sglang_vc.specache.config import SpeCacheConfig
from sglang_vc.specache.step import StepCounters


@dataclass
class Counters(StepCounters):
    steps: int = 0


@dataclass
class SpeCacheSim:
    """SpeCache state of one request in the lab: per layer the dequantized payload, the
    rows prefetched for this step and the rows picked for the next one."""

    config: SpeCacheConfig
    num_layers: int
    num_kv_heads: int
    kq: list = field(default_factory=list)  # per layer [n_q, H, D] dequantized
    vq: list = field(default_factory=list)
    num_quantized: int = 0
    prefetched: list = field(default_factory=list)  # per layer [H, k] positions or None
    picked: list = field(default_factory=list)  # per layer [H, k] for the next step
    select_row: Optional[int] = None  # the query row whose attention picks the next rows
    counters: Counters = field(default_factory=Counters)

    @classmethod
    def from_prompt(cls, config: SpeCacheConfig, prompt_kv: Sequence[tuple[Tensor, Tensor]]) -> "SpeCacheSim":
        """Quantize the prompt (``prompt_kv``: per layer ``[1, H, T, D]`` K and V)."""
        k0 = prompt_kv[0][0]
        sim = cls(config, len(prompt_kv), k0.shape[1])
        n_q = config.quantized_len(k0.shape[2])
        sim.kq = [k[0, :, :0].transpose(0, 1) for k, _ in prompt_kv]
        sim.vq = [v[0, :, :0].transpose(0, 1) for _, v in prompt_kv]
        sim.prefetched = [None] * sim.num_layers
        sim.picked = [None] * sim.num_layers
        if n_q:
            sim._quantize(prompt_kv, 0, n_q)
        return sim

    def _quantize(self, kv: Sequence[tuple[Tensor, Tensor]], start: int, end: int) -> None:
        """Append positions ``[start, end)`` (whole key groups) to the quantized copy."""
        whole = self.config.quantizer(residual=0)
        for li, (k, v) in enumerate(kv):
            ckv = whole.compress(li, k[0, :, start:end].transpose(0, 1), v[0, :, start:end].transpose(0, 1),
                                 self.config.bits)
            kd, vd = whole.dequantize(ckv)
            self.kq[li] = torch.cat([self.kq[li], kd])
            self.vq[li] = torch.cat([self.vq[li], vd])
        self.num_quantized = end

    def stream(self, kv: Sequence[tuple[Tensor, Tensor]], kv_len: int) -> None:
        """After a step: quantize the oldest tail group while the tail is long enough."""
        g = self.config.group_size
        while self.config.stream_due(self.num_quantized, kv_len):
            self._quantize(kv, self.num_quantized, self.num_quantized + g)

    def begin_step(self, select_row: Optional[int]) -> None:
        """The rows picked last step become this step's prefetched rows."""
        self.prefetched = self.picked
        self.picked = [None] * self.num_layers
        self.select_row = select_row
        self.counters.steps += 1

    # ------------------------------------------------------------------ attention

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """One layer: ``query [1, Hq, T, D]``, ``key/value [1, H, L, D]`` (full precision,
        this step's tokens last). Returns ``[1, T, Hq, Dv]``."""
        cfg = self.config
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        k_full, v_full = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [L, H, D]
        n_q = self.num_quantized
        q_start = k_full.shape[0] - q.shape[0]
        kq, vq = self.kq[layer].to(k_full.dtype), self.vq[layer].to(v_full.dtype)
        k_tail, v_tail = k_full[n_q:], v_full[n_q:]

        def fetch(positions: Tensor) -> core.Rows:  # the host copy's rows
            return core.gather_rows(k_full[:n_q], v_full[:n_q], positions)

        if not cfg.speculative and cfg.topk > 0:
            res, rows = core.attend_fetching(q, kq, vq, k_tail, v_tail, q_start=q_start, scale=scaling,
                                             topk=cfg.topk, fetch=fetch)
            self._count(rows, res.probs[0])
            return res.out.unsqueeze(0)
        pos = self.prefetched[layer]
        rows = fetch(pos) if pos is not None and cfg.topk > 0 else None
        res = core.attend(q, kq, vq, k_tail, v_tail, q_start=q_start, scale=scaling, rows=rows)
        if rows is not None:
            self._count(rows, res.probs[0])
        if self.select_row is not None and cfg.topk > 0:
            self.picked[layer] = core.select_topk(res.probs[self.select_row], self.num_kv_heads, cfg.topk)
        return res.out.unsqueeze(0)

    def _count(self, rows: core.Rows, out_probs: Tensor) -> None:
        self.counters.add(rows, core.head_scores(out_probs, self.num_kv_heads), self.config.topk)


def crop(cache, length: int) -> None:
    """Drop cache positions ``>= length`` (the speculative token's KV)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@dataclass
class Run:
    """One SpeCache decode of one prompt in the lab."""

    row0_logits: list  # float32 [V] per step t >= 1: p(y_t | y_<t) of the output token
    argmax: list  # argmax of each
    counters: Counters
    num_quantized: int


def decode(sess, cache, sim: SpeCacheSim, prompt_len: int, first: int, steps: int,
           forced: Optional[Sequence[int]] = None) -> Run:
    """Decode ``steps`` output tokens after ``first`` (= ``y_0``) with SpeCache, on
    ``cache`` (full KV of the prompt, extended in place). ``forced``: teacher forcing,
    the tokens fed at steps ``1 ..`` are ``forced[0 ..]`` (the full-KV trajectory
    ``y_0, y_1, ...``; ``forced[0] == first``); otherwise the model's own outputs."""
    cfg = sim.config
    sess.ctl.specache = sim
    logits_out, argmaxes = [], []
    try:
        spec = None
        if cfg.speculative and cfg.topk > 0:  # pre-decode (algorithm 2)
            sim.begin_step(select_row=0)
            lg = sess.forward(cache, [first])
            spec = int(lg[0].argmax())
            crop(cache, prompt_len)
            sim.counters.steps -= 1  # not a decode step
        prev = first
        for t in range(1, steps + 1):
            tokens = [prev] if spec is None else [prev, spec]
            sim.begin_step(select_row=1 if spec is not None else None)
            lg = sess.forward(cache, tokens)
            if spec is not None:
                spec = int(lg[1].argmax())
                crop(cache, prompt_len + t)
            row0 = lg[0]
            logits_out.append(row0)
            argmaxes.append(int(row0.argmax()))
            prev = forced[t] if forced is not None else argmaxes[-1]
            sim.stream([(layer.keys, layer.values) for layer in cache.layers], prompt_len + t)
    finally:
        sess.ctl.specache = None
    return Run(logits_out, argmaxes, sim.counters, sim.num_quantized)


def _kl(lp_full: Tensor, lp: Tensor) -> float:
    return float((lp_full.exp() * (lp_full - lp)).sum())


def evaluate(sess, tokenizer, config: SpeCacheConfig, prompt_kv, prompt_len: int, y: Sequence[int],
             lp_ref: Sequence[Tensor], n_new: int, draft_lengths: Sequence[int], near_ties: Sequence[int],
             needle_item: Optional[dict] = None) -> dict:
    """The fidelity lab's per-prompt result for one SpeCache configuration (the same
    fields as the other methods'): teacher-forced on the full-KV greedy trajectory ``y``
    (``lp_ref[t]``: its token-by-token log-probs), per-step KL, first divergence, and the
    acceptance length of SpeCache as VeriCache's drafter. A drafter resuming at committed
    prefix ``p`` is taken to be in the state the teacher-forced pass reached at ``p``
    (its prefetch state, and its own KV of the committed tokens, which a real VeriCache
    drafter would have from the verify instead): while drafts match the trajectory its
    inputs are the trajectory's tokens, so its matches are the pass's."""
    import time

    from transformers import DynamicCache

    t0 = time.perf_counter()
    xs = sorted({int(x) for x in draft_lengths})
    steps = min(len(y) - 1, n_new + max(xs) - 2)

    def fresh():
        cache = DynamicCache([(k[:, :, :prompt_len], v[:, :, :prompt_len]) for k, v in prompt_kv])
        return cache, SpeCacheSim.from_prompt(config, prompt_kv)

    cache, sim = fresh()
    run = decode(sess, cache, sim, prompt_len, y[0], steps, forced=y)
    del cache
    kl, first_div = [0.0], None
    match = [True]  # match[t]: the output token at step t is y_t
    for t in range(1, steps + 1):
        lg = run.row0_logits[t - 1]
        if t < n_new:
            kl.append(_kl(lp_ref[t], torch.log_softmax(lg.double(), -1)))
        match.append(run.argmax[t - 1] == y[t])
        if first_div is None and t < n_new and not match[t]:
            first_div = t
    acc = {}
    for x in xs:
        p, rounds, accepted = 1, 0, 0
        while p < n_new:
            a = 0
            while a < x and p + a <= steps and match[p + a]:
                a += 1
            rounds += 1
            accepted += a
            p += a + 1
        acc[x] = {"rounds": rounds, "accepted": accepted, "committed": p - 1}
    cum = []
    total = 0.0
    for v in kl:
        total += v
        cum.append(total)
    k0 = prompt_kv[0][0]
    heads, head_dim, elem = k0.shape[1], k0.shape[3], k0.element_size()
    kv_len = prompt_len + n_new
    device_fraction = config.device_bytes(kv_len, heads, head_dim, elem) / (2 * kv_len * heads * head_dim * elem)
    out = {
        "label": config.label, "compressor": config.label, **config.describe(),
        "kept_fraction": 1.0,
        "stored_bits_per_element": device_fraction * 8 * elem,
        "device_kv_fraction": device_fraction,
        "kl": kl, "cumulative_kl": cum,
        "first_divergence": first_div,
        "first_divergence_near_tie": (first_div in near_ties) if first_div is not None else None,
        "acceptance_length": {str(x): acc[x]["committed"] / acc[x]["rounds"] for x in xs},
        "acceptance_rate": {str(x): acc[x]["accepted"] / (x * acc[x]["rounds"]) for x in xs},
        "rounds": {str(x): acc[x] for x in xs},
        "steps": run.counters.steps,
        "rows_prefetched": run.counters.rows_prefetched,
        "bytes_prefetched": run.counters.bytes_prefetched,
        "prefetch_hit": run.counters.hit_rate,
    }
    if needle_item is not None:
        from .workloads import needle_found

        if first_div is None:
            text_ids = list(y[:n_new])
        else:  # free-running from the start: its own tokens after the divergence
            cache, sim = fresh()
            free = decode(sess, cache, sim, prompt_len, y[0], n_new - 1)
            del cache
            text_ids = [y[0]] + free.argmax
        out["needle_found"] = needle_found(tokenizer.decode(text_ids), needle_item)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
