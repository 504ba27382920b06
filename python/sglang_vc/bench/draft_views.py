"""Fidelity lab: in-pool self-speculation draft views (MagicDec / SparseSpec style).

The full KV stays resident; a draft step attends only to a sparse *view* of the request's
own rows under a fixed budget of ``B`` token positions; the verify is full attention. Two
views, given to ``--compressors`` as ``KIND@B`` (or ``KIND:B``) beside the compressors:

* ``window@B`` (sink + sliding window): a draft query at position ``t`` (context
  ``[0, T)``, ``T = t + 1``) sees all of ``[0, T)`` when ``T <= B``, else the first
  ``S`` positions (attention sinks) and the last ``B - S``, ``[T - (B - S), T)``. The
  window slides: it is recomputed for every draft query from its own position (unlike
  ``streamingllm``, which compresses the prompt once).
* ``reselect@B`` (SparseSpec's PillarAttn): at every verify, i.e. at the start of each
  draft round at committed prefix ``y_<p`` (context ``n = T_prompt + p - 1`` positions),
  per layer and per kv head the view is ``S`` sinks + the ``B // 4`` most recent positions
  + the ``B - S - B // 4`` other positions with the most attention from the full-KV
  verify queries (softmax probabilities summed over those queries and over the q heads of
  the kv head's group). The first round scores with the prompt's last query (the
  prefill's last position). The view stays fixed for the round's drafts, and the round's
  own positions (the bonus token and the drafts, ``>= n``) are always attended.
  ``n <= B``: everything is visible.

``S = min(4, B // 2)`` (4 for every budget >= 8).

Simulation (same definitions as the compressors, :mod:`sglang_vc.bench.fidelity_run`):
the drafter resumes on the *exact* (full-KV) KV of the committed tokens; the KV of the
tokens it feeds (the last committed token, then its drafts) is computed under the view.
``window`` replaces the attention of every layer (``Controller.specache`` hook of
:mod:`sglang_vc.bench.lossy_hf`) by eager attention with a per-query causal + window mask,
so a multi-token forward is token-by-token drafting batched (each row has its own view);
``reselect`` is a per-layer, per-kv-head visibility mask over ``[0, n)`` (``LossyKV``),
the compressors' mechanism. The verify queries that score a reselect view are the
full-KV queries of the verify's rows whose inputs are committed tokens: the last round's
bonus token and its accepted drafts (``y_{p_prev-1} .. y_{p-2}``). The server's verify
also has rows on the rejected drafts; those inputs are off the trajectory and are left
out (an approximation).

KL and first divergence: the view teacher-forced along the whole trajectory as one
endless draft round from the prefill (``window`` sliding; ``reselect`` keeps its first
round's view, chosen with the prompt's last query).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

VIEW_KINDS = ("window", "reselect", "shared")
SINKS = 4


# ============================================================================ specs


@dataclass(frozen=True)
class ViewSpec:
    """A draft view run: ``kind`` (``window`` | ``reselect``) under a budget of ``budget``
    token positions. Quacks like :class:`~sglang_vc.bench.fidelity_run.CompressorSpec`."""

    kind: str
    budget: int
    scenario: str = "draft_view"
    mode: str = "view"
    needs_queries: str | None = None

    @property
    def name(self) -> str:
        return self.kind

    @property
    def value(self) -> int:
        return self.budget

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.budget}"

    def key(self) -> dict:
        return {"budget": int(self.budget)}


def parse_view(name: str, val: str | None) -> ViewSpec:
    """``window`` / ``reselect`` with the text after ``@`` or ``:`` -> a spec;
    ``ValueError`` unless the budget is a positive integer number of tokens."""
    if name not in VIEW_KINDS:
        raise ValueError(f"unknown draft view {name!r}; known: {', '.join(VIEW_KINDS)}")
    if val is None or not val.strip():
        raise ValueError(f"{name} needs a token budget: {name}@B, e.g. {name}@512")
    try:
        b = int(val.strip())
    except ValueError:
        b = 0
    if b < 1:
        raise ValueError(f"{name}@{val}: the budget must be a positive integer number of tokens, e.g. {name}@512")
    return ViewSpec(name, b)


def sink_count(budget: int) -> int:
    return min(SINKS, budget // 2)


# ============================================================================ the views


def window_positions(T: int, budget: int) -> Tensor:
    """Positions a draft query with context ``[0, T)`` (its own position ``T - 1``) sees
    under ``window@budget``: all when ``T <= budget``, else ``S`` sinks + the last
    ``budget - S``."""
    if T <= budget:
        return torch.arange(T)
    s = sink_count(budget)
    return torch.cat([torch.arange(s), torch.arange(T - (budget - s), T)])


def window_mask(q_start: int, q_len: int, length: int, budget: int) -> Tensor:
    """bool ``[q_len, length]``: query ``i`` (position ``q_start + i``) attends key ``j``;
    causal and, past the budget, sinks + sliding window (row ``i`` is
    :func:`window_positions` of ``T = q_start + i + 1``)."""
    s = sink_count(budget)
    t = torch.arange(q_start, q_start + q_len)[:, None] + 1  # T per query
    j = torch.arange(length)[None, :]
    causal = j < t
    return causal & ((t <= budget) | (j < s) | (j >= t - (budget - s)))


def reselect_visible(scores: Tensor, budget: int) -> Tensor | None:
    """``scores [Hkv, n]`` (attention each kv head's verify queries gave the ``n`` context
    positions) -> bool ``[Hkv, n]`` of ``reselect@budget``: ``S`` sinks, the ``budget // 4``
    most recent, and the ``budget - S - budget // 4`` highest-scored others; ``None``
    (all visible) when ``n <= budget``."""
    h, n = scores.shape
    if n <= budget:
        return None
    s, r = sink_count(budget), budget // 4
    k = budget - s - r
    vis = torch.zeros(h, n, dtype=torch.bool)
    vis[:, :s] = True
    vis[:, n - r:] = True
    if k > 0:
        rest = scores.float().masked_fill(vis, float("-inf"))
        vis.scatter_(1, rest.topk(k, dim=1).indices, True)
    return vis


def verify_scores(q: Tensor, k: Tensor, q_pos: Tensor, n: int, scaling: float) -> Tensor:
    """Attention probabilities of queries ``q [m, Hq, D]`` (at positions ``q_pos [m]``,
    causal) over keys ``k [>= n, Hkv, D]``, summed over the queries and the q heads of each
    kv head's group, restricted to positions ``< n``: ``[Hkv, n]``."""
    hq, hkv = q.shape[1], k.shape[1]
    groups = hq // hkv
    length = int(q_pos.max()) + 1
    kk = k[:length].transpose(0, 1).float()  # [Hkv, L, D]
    kk = kk.repeat_interleave(groups, dim=0)  # q head i reads kv head i // groups
    logits = torch.matmul(q.transpose(0, 1).float(), kk.transpose(1, 2)) * scaling  # [Hq, m, L]
    future = torch.arange(length)[None, :] > q_pos[:, None]
    probs = logits.masked_fill(future[None], float("-inf")).softmax(-1)
    per_kv = probs.sum(1).view(hkv, groups, length).sum(1)  # [Hkv, L]
    out = torch.zeros(hkv, n)
    m = min(n, length)
    out[:, :m] = per_kv[:, :m]
    return out


class WindowAttention:
    """Replaces every layer's attention (``Controller.specache`` hook): transformers' eager
    attention with the causal + sliding-window mask of :func:`window_mask` per query."""

    def __init__(self, budget: int):
        self.budget = budget
        self._mask: tuple[tuple[int, int], Tensor] | None = None

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """``query [1, Hq, q, D]``, ``key/value [1, Hkv, L, D]`` (this step's rows last);
        returns ``[1, q, Hq, D]`` like the eager attention."""
        from .lossy_hf import _repeat_kv

        q_len, length = query.shape[2], key.shape[2]
        if self._mask is None or self._mask[0] != (q_len, length):
            self._mask = ((q_len, length), window_mask(length - q_len, q_len, length, self.budget))
        groups = query.shape[1] // key.shape[1]
        w = torch.matmul(query, _repeat_kv(key, groups).transpose(2, 3)) * scaling
        w = w.masked_fill(~self._mask[1][None, None], float("-inf"))
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(w, _repeat_kv(value, groups)).transpose(1, 2).contiguous()


class ViewContext:
    """Per prompt: the full-KV queries that score reselect views, computed once on demand.
    ``queries[l][j]`` ``[Hq, D]`` is the full-KV query at position ``T - 1 + j``
    (``j = 0``: the prompt's last token, the prefill's last query; ``j >= 1``: ``y_{j-1}``)."""

    def __init__(self, sess, ids: Sequence[int], prompt_base, traj_base, T: int, y: Sequence[int], n_new: int):
        self.sess, self.ids, self.prompt_base, self.traj_base, self.T, self.y = sess, ids, prompt_base, traj_base, T, y
        self.n_new = n_new
        self._queries: list[Tensor] | None = None
        self.scaling = float(getattr(sess.ctl.attn_modules[0], "scaling", 0.0)) or None

    @property
    def queries(self) -> list[Tensor]:
        if self._queries is None:
            from .lossy_hf import build_cache

            self.sess.activate(None)
            c = build_cache(self.prompt_base, self.T - 1)
            # rounds start at p < n_new: queries up to j = n_new - 2 are read
            _, _, qs, _ = self.sess.prefill([self.ids[-1]] + list(self.y[: self.n_new - 1]), cache=c, capture=True)
            self._queries = qs
        return self._queries

    def reselect(self, budget: int, p_prev: int, p: int, shared: bool = False):
        """The ``LossyKV`` of ``reselect@budget`` for the round at committed prefix ``y_<p``
        whose verify had queries at ``j in [p_prev, p)`` (first round: ``p_prev = 0, p = 1``).
        ``shared`` (``shared@budget``): one selection for every layer and KV head, from
        the scores summed over them all (one row list per request, as a paged-attention
        kernel reads it with one page table)."""
        from .lossy_hf import LossyKV

        n = self.T + p - 1
        n_layers = len(self.traj_base)
        lossy = LossyKV.identity(n_layers)
        if n <= budget:
            return lossy
        qs = self.queries
        head_dim = qs[0].shape[-1]
        scaling = self.scaling or head_dim ** -0.5
        q_pos = torch.arange(self.T - 1 + p_prev, self.T - 1 + p)
        scores = []
        for li in range(n_layers):
            k = self.traj_base[li][0][0].transpose(0, 1)  # [L, Hkv, D]
            scores.append(verify_scores(qs[li][p_prev:p], k, q_pos, n, scaling))
        if shared:
            one = reselect_visible(torch.stack(scores).sum(dim=(0, 1))[None], budget)
            lossy.visible = [one.expand(sc.shape[0], -1) for sc in scores]
        else:
            lossy.visible = [reselect_visible(sc, budget) for sc in scores]
        return lossy


# ============================================================================ evaluation


def evaluate_view(sess, spec: ViewSpec, ctx: ViewContext, lp_ref: Sequence[Tensor], n_new: int,
                  xs: Sequence[int], near_ties: Sequence[int], *, first_chunk: int) -> dict:
    """One view on one prompt: a result row with the compressors' fields (see the module
    docstring for the definitions). ``lp_ref[t]``: the full model's log-probs of step ``t``
    run the same way (one teacher-forced forward)."""
    from .fidelity_metrics import _cumsum, kl_along, matched_drafts
    from .lossy_hf import build_cache

    T, y = ctx.T, ctx.y
    window = spec.kind == "window"
    hook = WindowAttention(spec.budget) if window else None

    def use(view):  # window: attention hook; reselect: the round's LossyKV
        if window:
            sess.activate(None)
            sess.ctl.specache = hook
        else:
            sess.activate(view)

    def release():
        sess.ctl.specache = None
        sess.activate(None)

    # ---- teacher-forced pass: one endless round from the prefill
    t0 = time.perf_counter()
    shared = spec.kind == "shared"
    first_view = None if window else ctx.reselect(spec.budget, 0, 1, shared)
    select_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        use(first_view)
        rows = list(sess.forward(build_cache(ctx.prompt_base, T, first_view), y[: n_new - 1]).unbind(0))
    finally:
        release()
    kls, first_div = kl_along(rows, lp_ref, y)
    del rows
    tf_s = time.perf_counter() - t0

    # ---- VeriCache rounds
    t0 = time.perf_counter()
    memo: dict[Any, tuple[int, int]] = {}
    work = {"forwards": 0, "tokens": 0, "select_s": 0.0}

    def draft(p_prev: int, p: int, cap_x: int) -> int:
        if window:
            view = None
        else:
            ts = time.perf_counter()
            view = first_view if (p_prev, p) == (0, 1) else ctx.reselect(spec.budget, p_prev, p, shared)
            work["select_s"] += time.perf_counter() - ts
        try:
            use(view)
            dc = build_cache(ctx.traj_base, T + p - 1, view)  # committed KV is exact
            return matched_drafts(lambda ids: sess.forward(dc, ids), y, p, cap_x, first_chunk, work)
        finally:
            release()

    def matched(p_prev: int, p: int, cap_x: int) -> int:
        key = p if window else (p_prev, p)  # a window view depends on positions only
        if key in memo:
            k, c = memo[key]
            if k < c or c >= cap_x:
                return min(k, cap_x)
        k = draft(p_prev, p, cap_x)
        memo[key] = (k, cap_x)
        return k

    acc = {}
    for x in sorted(xs, reverse=True):
        p, p_prev, rounds, accepted = 1, 0, 0, 0
        while p < n_new:
            a = matched(p_prev, p, x)
            rounds += 1
            accepted += a
            p_prev, p = p, p + a + 1
        acc[x] = {"rounds": rounds, "accepted": accepted, "committed": p - 1}
    rounds_s = time.perf_counter() - t0

    elem_bits = 8 * ctx.prompt_base[0][0].element_size()
    cum = _cumsum(kls)
    return {
        "label": spec.label, "compressor": spec.name, **spec.key(),
        # the share of the context the first decode query reads; the full KV stays resident
        "kept_fraction": min(spec.budget, T + 1) / (T + 1),
        "stored_bits_per_element": float(elem_bits),
        "kl": kls, "cumulative_kl": cum,
        "first_divergence": first_div,
        "first_divergence_near_tie": (first_div in near_ties) if first_div is not None else None,
        "acceptance_length": {str(x): acc[x]["committed"] / acc[x]["rounds"] for x in sorted(acc)},
        "acceptance_rate": {str(x): acc[x]["accepted"] / (x * acc[x]["rounds"]) for x in sorted(acc)},
        "rounds": {str(x): acc[x] for x in sorted(acc)},
        # window: [p, k, cap]; reselect: [p_prev, p, k, cap] (its view depends on the last round)
        "match_lengths": [[*(kk if isinstance(kk, tuple) else (kk,)), k, c] for kk, (k, c) in sorted(memo.items())],
        "draft_forwards": work["forwards"], "draft_tokens": work["tokens"],
        "online_updates": None,
        "compress_s": round(select_s + work["select_s"], 2), "teacher_forced_s": round(tf_s, 2),
        "rounds_s": round(rounds_s, 2),
    }
