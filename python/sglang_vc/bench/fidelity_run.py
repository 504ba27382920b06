"""Fidelity lab, the measurement: how far does a lossy KV cache move a model, and how long
would VeriCache's drafts from it be accepted? Compressor specs, the per-prompt run, the
aggregation over prompts; the command line, prompt loading, JSON and plots are
:mod:`sglang_vc.bench.fidelity`.

Offline, HF transformers, pure torch (no SGLang server); the lossy cache is simulated
exactly by :mod:`sglang_vc.bench.lossy_hf` (per-layer, per-kv-head attention masks for token
dropping, dequantized prompt K/V for quantization, H2O's ``update`` online during decode).

Per prompt (tokenized by :func:`encode`, with the model's chat template unless
``chat_template=False``):

1. Prefill the prompt with full KV (queries captured where a method needs them) and
   decode the *full-KV greedy trajectory* ``y_0 .. y_{N+max(x)-1}`` (``y_0`` is the
   prefill's token; EOS is ignored, like ``ignore_eos``).
2. Per compressor: compress every layer's prompt K/V ([T, kv_heads, head_dim], post-RoPE),
   then decode with the lossy cache *teacher-forced* on the trajectory:
   ``kl[t] = KL(p_full(.|y_<t) || p_lossy(.|y_<t))`` in nats for ``t < N``
   (``kl[0] == 0``: the first token comes from the full prefill in both systems);
   ``cumulative_kl`` its running sum (the sequence-level KL of VeriCache eq. 2).
   ``first_divergence``: the first ``t`` where free-running lossy greedy decoding differs
   from the trajectory (= ``t`` tokens matched); until then free-running and teacher
   forcing see identical inputs, so it is the first ``t`` with
   ``argmax p_lossy(.|y_<t) != y_t``. ``null`` if none within N.
3. VeriCache rounds for each draft length x: from a committed prefix ``y_<p`` (starting
   with ``p = 1``, the prefill token) the drafter, i.e. the same model on the compressed
   prompt KV + the *exact* (full-model) KV of the committed tokens, drafts x tokens
   greedily; the full model verifies: the matching prefix ``a`` is accepted plus one
   correction (or bonus) token, so ``p += a + 1``. Rounds run until ``p >= N``;
   ``acceptance_length[x]`` = tokens committed per round (pooled over prompts),
   ``acceptance_rate[x]`` = accepted drafts / drafted tokens. Drafting stops at the first
   mismatch (the rest would be rejected) and match lengths are memoised per ``p``.

Computation: while the drafts match the trajectory the drafter's inputs are the trajectory
tokens, so for offline methods teacher forcing is one multi-token forward and a draft from
``p`` is checked in growing chunks (4, 8, 16, ... tokens) instead of token by token: the
same math, a fraction of the CPU time (decode is weight-bandwidth bound). The offline KL
reference is the full model run the same way (identical caches give KL == 0 bit-exactly);
the batched forwards round differently from token-by-token decoding, which could flip a
greedy token only at an exact near-tie (counted per prompt as ``reference_flips``).
Online methods (H2O) evict after every token and run token by token throughout.

In-pool draft views (``window@B``, ``reselect@B``): the full KV stays resident and each
draft query attends a view of ``B`` positions; same rounds and fields, definitions in
:mod:`sglang_vc.bench.draft_views` (their reselect memo is keyed by the previous round's
start too, since the view is scored by that round's verify).

Query inputs: SnapKV gets the last ``--snapkv-window`` prompt queries, H2O all prompt
queries, KVzip the queries (and keys, ``recon_keys``) of a context-reconstruction pass: the
model is run, on top of the prompt's full KV, on ``--kvzip-prompt`` followed by the
prompt's own tokens (teacher-forced), and the queries of those tokens are captured.
H2O is online: ``update`` runs after every layer during decode, evicting generated tokens
too. For VeriCache rounds the drafter resumes with the H2O state (scores, kept set)
reached at ``p`` along the teacher-forced lossy pass (an approximation: a real drafter's
state would have seen the verified KV of the committed tokens).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .draft_views import VIEW_KINDS, ViewContext, ViewSpec, evaluate_view, parse_view
from .fidelity_metrics import _cumsum, kl_along, matched_drafts

DEFAULT_RATIO = 0.25
KVZIP_PROMPT = "\n\nRepeat the previous context:\n"
NEAR_TIE_REL = 1e-4  # docs/architecture.md, "identical output"
FIRST_CHUNK = 4  # first chunk of a batched draft check (then 8, 16, ...)


# ============================================================================ specs


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor run: registry ``name``, its ``scenario`` and the keep ratio or bits."""

    name: str
    scenario: str  # "token_dropping" | "quantization"
    value: float | int
    mode: str = "offline"
    needs_queries: str | None = None

    @property
    def label(self) -> str:
        if self.scenario == "quantization":
            return f"{self.name}@{self.value}bit"
        return f"{self.name}@{_fmt_ratio(self.value)}"

    def key(self) -> dict:
        return {"bits": int(self.value)} if self.scenario == "quantization" else {"ratio": float(self.value)}


def _fmt_ratio(r: float) -> str:
    return f"{float(r):g}"


def parse_compressors(text: str, ratio: float | None, bits: int | None) -> list[CompressorSpec | ViewSpec]:
    """``"snapkv,kivi:4,all,window@512"`` -> specs. ``NAME:VALUE`` (or ``NAME@VALUE``, the
    result label: ``snapkv@0.25``, ``kivi@2bit``) overrides the ratio/bits of one entry;
    ``all`` adds every registered method not listed explicitly. Token-dropping methods take
    ``ratio`` (default 0.25), quantization methods ``bits`` (default: the method's lowest
    supported width). The in-pool draft views (:mod:`sglang_vc.bench.draft_views`) take a
    token budget, always given: ``window@B``, ``reselect@B`` (never added by ``all``).
    ``ValueError`` on an unknown name, a bad value, bits given where no quantization method
    is listed, or a ratio given where no token-dropping method is.
    """
    from sglang_vc.compress import check_bits, check_ratio, get_compressor, standalone_compressors

    # SpeCache's device copy is read with its host rows: the lab runs it as --specache
    classes = {n: type(get_compressor(n)) for n in standalone_compressors()}

    entries: list[tuple[str, str | None]] = []
    order: list[tuple[str, int]] = []  # ("c", i): entries[i]; ("v", i): views[i]
    views: list[ViewSpec] = []
    want_all = False
    for raw in [t.strip() for t in str(text).split(",") if t.strip()]:
        if raw.lower() == "all":
            want_all = True
            continue
        sep = min((i for i in (raw.find(":"), raw.find("@")) if i >= 0), default=len(raw))
        name, val = raw[:sep].strip().lower(), raw[sep + 1:].strip()
        if name in VIEW_KINDS:
            order.append(("v", len(views)))
            views.append(parse_view(name, val or None))
            continue
        if name not in classes:
            raise ValueError(f"unknown compressor {name!r}; known: {', '.join(classes)}, all "
                             f"(SpeCache: --specache VARIANTS; draft views: {', '.join(k + '@B' for k in VIEW_KINDS)})")
        if raw[sep:sep + 1] == "@" and val.lower().endswith("bit"):  # a label: kivi@2bit
            val = val[:-3].strip()
        order.append(("c", len(entries)))
        entries.append((name, val or None))
    if want_all:
        explicit = {n for n, _ in entries}
        for n in classes:
            if n not in explicit:
                order.append(("c", len(entries)))
                entries.append((n, None))
    if not entries and not views:
        raise ValueError("no compressor given")
    scenarios = {n: classes[n].scenario for n, _ in entries}
    if views and not entries:
        if bits is not None or ratio is not None:
            flag = "--kv-bits" if bits is not None else "--compression-ratio"
            raise ValueError(f"{flag} given but only draft views are listed ({', '.join(v.label for v in views)}), "
                             "which take a token budget (KIND@B)")
        return _no_duplicates(views)
    if bits is not None and "quantization" not in scenarios.values():
        raise ValueError(
            f"--kv-bits {bits} given but no quantization method is listed ({', '.join(scenarios)} "
            "are token-dropping methods, which take --compression-ratio)"
        )
    if ratio is not None and "token_dropping" not in scenarios.values():
        raise ValueError(
            f"--compression-ratio {ratio} given but no token-dropping method is listed "
            f"({', '.join(scenarios)} are quantization methods, which take --kv-bits)"
        )
    specs = []
    for name, val in entries:
        cls = classes[name]
        if cls.scenario == "quantization":
            if val is not None:
                value = _number(val, name)
                check_bits(value, cls.supported_bits, name)
                value = int(float(value))
            elif bits is not None:
                try:
                    value = check_bits(bits, cls.supported_bits, name)
                except ValueError as e:
                    lossy = [b for b in cls.supported_bits if b != 16]
                    raise ValueError(f"{e} (--kv-bits applies to every quantization method listed; "
                                     f"give this one its own width, e.g. {name}:{min(lossy)})") from None
            else:
                value = min(cls.supported_bits)
        else:
            if val is not None:
                value = _number(val, name)
            else:
                value = DEFAULT_RATIO if ratio is None else ratio
            check_ratio(value, name)
            value = float(value)
        specs.append(CompressorSpec(name, cls.scenario, value, getattr(cls, "mode", "offline"),
                                    getattr(cls, "needs_queries", None)))
    return _no_duplicates([specs[i] if kind == "c" else views[i] for kind, i in order])


def _no_duplicates(specs: list) -> list:
    labels = [s.label for s in specs]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise ValueError(f"compressor listed twice with the same setting: {', '.join(dup)}")
    return specs


def _number(text: str, name: str) -> float | int:
    try:
        f = float(text)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a number (NAME:VALUE takes a keep ratio or a bit width)") from None
    return int(f) if f.is_integer() and "." not in text else f


# ============================================================================ prompts


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


# ============================================================================ the lab


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_prompt(sess, tokenizer, ids: list[int], specs: Sequence[CompressorSpec], n_new: int,
               draft_lengths: Sequence[int], *, snapkv_window: int = 32, kvzip_prompt: str = KVZIP_PROMPT,
               req_id: Any = 0, first_chunk: int = FIRST_CHUNK, specache: Sequence[Any] = (),
               needle_item: dict | None = None,
               log: Callable[[str], None] = _log) -> tuple[dict, list[dict]]:
    """One prompt: the full-KV trajectory, then every compressor. Returns
    ``(prompt_info, [per-compressor result])``.

    Offline methods are evaluated with multi-token forwards (teacher forcing is one forward
    of the N-1 trajectory tokens; a draft from ``p`` is checked in growing chunks of
    ``first_chunk``, 2x, 4x ... trajectory tokens, stopping at the first mismatch): while
    drafts match the trajectory, the drafter's inputs *are* the trajectory tokens, so this is
    the same computation as token-by-token drafting, batched. Their KL reference is the
    full model run the same way, so identical caches give KL == 0 bit-exactly. Online
    methods (H2O) must evict after every token, so they run token by token against the
    token-by-token trajectory logits.
    """
    import torch

    from sglang_vc.compress import get_compressor

    from .lossy_hf import PromptCapture, build_cache, cache_kv, compress_prompt

    if n_new < 2:
        raise ValueError("max_new_tokens must be >= 2")
    xs = sorted({int(x) for x in draft_lengths}, reverse=True)
    max_x = xs[0]
    T = len(ids)
    M = n_new + max_x  # trajectory long enough for the last round's drafts and bonus
    if sess.max_positions and T + M > sess.max_positions:
        raise ValueError(f"prompt of {T} tokens + {M} trajectory tokens exceeds the model's "
                         f"{sess.max_positions} positions")

    need_q = any(s.needs_queries in ("observation_window", "prefill") for s in specs)
    sess.activate(None)
    t0 = time.perf_counter()
    cache, logits, qs, _ = sess.prefill(ids, capture=need_q)
    prefill_s = time.perf_counter() - t0
    prompt_base = cache_kv(cache)  # DynamicCache replaces, never mutates, its tensors
    cap = PromptCapture(k=[k[0].transpose(0, 1) for k, _ in prompt_base],
                        v=[v[0].transpose(0, 1) for _, v in prompt_base], queries=qs)

    # ---- full-KV greedy trajectory, token by token
    t0 = time.perf_counter()
    y: list[int] = []
    lp_step = []  # token-by-token full log-probs (reference for online methods)
    gaps, tops = [], []
    for t in range(M):
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        tops.append(float(top2[0]))
        y.append(int(logits.argmax()))
        if t < n_new:
            lp_step.append(torch.log_softmax(logits.double(), -1))
        if t < M - 1:
            logits = sess.step(cache, y[-1])
    traj_base = cache_kv(cache)  # length T + M - 1: exact KV of y_0 .. y_{M-2}
    del cache
    traj_s = time.perf_counter() - t0
    near_ties = [t for t in range(n_new) if gaps[t] < NEAR_TIE_REL * abs(tops[t])]
    info = {
        "n_tokens": T, "prefill_s": round(prefill_s, 2), "trajectory_s": round(traj_s, 2),
        "trajectory_tokens": M, "reference_tokens": y[:n_new],
        "reference_text": tokenizer.decode(y[:n_new]) if tokenizer is not None else None,
        "near_tie_steps": near_ties,
    }
    log(f"  full KV: prefill {T} tok {prefill_s:.1f}s, trajectory {M} tok {traj_s:.1f}s")

    # ---- the same trajectory teacher-forced in one forward: reference for offline methods
    lp_chunk = None
    if any(s.mode != "online" for s in specs):
        c = build_cache(prompt_base, T)
        lg = sess.forward(c, y[: n_new - 1])  # row t-1 predicts y_t
        del c
        lp_chunk = [lp_step[0]] + list(torch.log_softmax(lg.double(), -1).unbind(0))
        # steps where the batched full forward's greedy token differs from the token-by-token
        # one: float rounding at a near-tie; expected 0, reported
        info["reference_flips"] = [t for t in range(1, n_new) if int(lg[t - 1].argmax()) != y[t]]
        if info["reference_flips"]:
            log(f"  note: batched full forward flips greedy tokens at steps {info['reference_flips']}")

    # ---- KVzip's context-reconstruction pass (once per prompt)
    if any(s.needs_queries == "reconstruction" for s in specs):
        t0 = time.perf_counter()
        recon_ids = list(tokenizer(kvzip_prompt, add_special_tokens=False)["input_ids"]) + list(ids)
        rc = build_cache(prompt_base, T)
        _, _, rq, rk = sess.prefill(recon_ids, cache=rc, capture=True)
        del rc
        cap.recon_queries, cap.recon_keys = rq, rk
        info["reconstruction_tokens"] = len(recon_ids)
        info["reconstruction_s"] = round(time.perf_counter() - t0, 2)
        log(f"  kvzip reconstruction pass: {len(recon_ids)} tok {info['reconstruction_s']:.1f}s")

    results = []
    view_ctx = ViewContext(sess, ids, prompt_base, traj_base, T, y, n_new) \
        if any(isinstance(s, ViewSpec) for s in specs) else None
    for spec in specs:
        if isinstance(spec, ViewSpec):  # in-pool draft view (bench.draft_views)
            r = evaluate_view(sess, spec, view_ctx, lp_chunk, n_new, xs, near_ties, first_chunk=first_chunk)
            results.append(r)
            al = r["acceptance_length"]
            log(f"  {spec.label:<20} view {r['kept_fraction']:.3f} of the context  cumKL {r['cumulative_kl'][-1]:.3f}"
                f"  first div {r['first_divergence']}  acc " + " ".join(f"x={x}:{al[str(x)]:.2f}" for x in sorted(xs))
                + f"  ({r['compress_s'] + r['teacher_forced_s'] + r['rounds_s']:.1f}s, "
                  f"{r['draft_forwards']} draft forwards)")
            continue
        t0 = time.perf_counter()
        comp = get_compressor(spec.name)
        lossy, stats = compress_prompt(comp, spec.value, cap, snapkv_window=snapkv_window, req_id=req_id)
        compress_s = time.perf_counter() - t0
        online = lossy.online

        # ---- teacher-forced lossy pass: per-step KL and first divergence
        t0 = time.perf_counter()
        sess.activate(lossy)
        c = build_cache(prompt_base, T, lossy)
        snapshots = {}
        if online:
            rows = []
            for t in range(1, n_new):
                snapshots[t] = lossy.snapshot()  # drafter state at committed prefix p = t
                rows.append(sess.step(c, y[t - 1]))
            lp_ref = lp_step
        else:
            rows = list(sess.forward(c, y[: n_new - 1]).unbind(0))
            lp_ref = lp_chunk
        del c
        kl, first_div = kl_along(rows, lp_ref, y)
        del rows
        tf_s = time.perf_counter() - t0

        # ---- VeriCache rounds
        t0 = time.perf_counter()
        memo: dict[int, tuple[int, int]] = {}
        work = {"forwards": 0, "tokens": 0}

        def draft(p: int, cap_x: int) -> int:
            """Drafts from committed prefix y_<p that match the trajectory (at most cap_x)."""
            st = snapshots[p].snapshot() if online else lossy
            sess.activate(st)
            dc = build_cache(traj_base, T + p - 1, st)  # committed KV is exact
            forward = (lambda ids: sess.step(dc, ids[0])[None] if len(ids) == 1 else sess.forward(dc, ids))
            return matched_drafts(forward, y, p, cap_x, 1 if online else first_chunk, work, grow=not online)

        def matched(p: int, cap_x: int) -> int:
            if p in memo:
                k, c_ = memo[p]
                if k < c_ or c_ >= cap_x:
                    return min(k, cap_x)
            k = draft(p, cap_x)
            memo[p] = (k, cap_x)
            return k

        acc = {}
        for x in xs:
            p, rounds, accepted = 1, 0, 0
            while p < n_new:
                a = matched(p, x)
                rounds += 1
                accepted += a
                p += a + 1
            acc[x] = {"rounds": rounds, "accepted": accepted, "committed": p - 1}
        sess.activate(None)
        rounds_s = time.perf_counter() - t0

        cum = _cumsum(kl)
        r = {
            "label": spec.label, "compressor": spec.name, **spec.key(),
            **stats,
            "kl": kl, "cumulative_kl": cum,
            "first_divergence": first_div,
            "first_divergence_near_tie": (first_div in near_ties) if first_div is not None else None,
            "acceptance_length": {str(x): acc[x]["committed"] / acc[x]["rounds"] for x in sorted(acc)},
            "acceptance_rate": {str(x): acc[x]["accepted"] / (x * acc[x]["rounds"]) for x in sorted(acc)},
            "rounds": {str(x): acc[x] for x in sorted(acc)},
            "match_lengths": [[p, k, c_] for p, (k, c_) in sorted(memo.items())],
            "draft_forwards": work["forwards"], "draft_tokens": work["tokens"],
            "online_updates": lossy.updates if online else None,
            "compress_s": round(compress_s, 2), "teacher_forced_s": round(tf_s, 2), "rounds_s": round(rounds_s, 2),
        }
        results.append(r)
        al = r["acceptance_length"]
        log(f"  {spec.label:<20} kept {stats['kept_fraction']:.3f} bits/el {stats['stored_bits_per_element']:.2f}"
            f"  cumKL {cum[-1]:.3f}  first div {first_div}  acc "
            + " ".join(f"x={x}:{al[str(x)]:.2f}" for x in sorted(acc))
            + f"  ({compress_s + tf_s + rounds_s:.1f}s, {work['forwards']} draft forwards)")
        del lossy, snapshots, comp

    # ---- SpeCache configurations (bench.specache_hf), after the compressors
    if needle_item is not None and tokenizer is not None:
        from .workloads import needle_found

        info["needle_found"] = needle_found(tokenizer.decode(y[:n_new]), needle_item)
    if specache:
        from .specache_hf import evaluate

        sess.activate(None)
        for cfg in specache:
            r = evaluate(sess, tokenizer, cfg, prompt_base, T, y, lp_step, n_new, xs, near_ties,
                         needle_item=needle_item)
            results.append(r)
            al = r["acceptance_length"]
            log(f"  {cfg.label:<20} device KV {r['device_kv_fraction']:.3f}  cumKL {r['cumulative_kl'][-1]:.3f}"
                f"  first div {r['first_divergence']}  hit {r['prefetch_hit'] if r['prefetch_hit'] is None else round(r['prefetch_hit'], 3)}"
                + (f"  needle {r['needle_found']}" if "needle_found" in r else "")
                + "  acc " + " ".join(f"x={x}:{al[str(x)]:.2f}" for x in sorted(xs)) + f"  ({r['seconds']:.1f}s)")
    return info, results


def aggregate(spec: CompressorSpec, per_prompt: list[dict], n_new: int) -> dict:
    """Mean KL per step over prompts, pooled acceptance, first divergence (mean with
    non-diverged prompts counted as N; ``null`` if no prompt diverged)."""
    n = len(per_prompt)
    kl = [sum(pp["kl"][t] for pp in per_prompt) / n for t in range(n_new)]
    fds = [pp["first_divergence"] for pp in per_prompt]
    diverged = [f for f in fds if f is not None]
    xs = sorted({int(x) for pp in per_prompt for x in pp["rounds"]})
    acc_len, acc_rate, rounds = {}, {}, {}
    for x in xs:
        tot = {k: sum(pp["rounds"][str(x)][k] for pp in per_prompt) for k in ("rounds", "accepted", "committed")}
        acc_len[str(x)] = tot["committed"] / tot["rounds"]
        acc_rate[str(x)] = tot["accepted"] / (x * tot["rounds"])
        rounds[str(x)] = tot
    cum = _cumsum(kl)
    return {
        "compressor": spec.name, "label": spec.label, "scenario": spec.scenario, "mode": spec.mode,
        **spec.key(),
        "prompts": n,
        "kl": kl,
        "cumulative_kl": cum,
        "final_cumulative_kl": cum[-1],
        "mean_kl_per_step": sum(kl[1:]) / max(1, n_new - 1),
        "first_divergence": (sum(f if f is not None else n_new for f in fds) / n) if diverged else None,
        "first_divergence_per_prompt": fds,
        "diverged_prompts": len(diverged),
        "first_divergence_at_near_tie": sum(1 for pp in per_prompt if pp["first_divergence_near_tie"]),
        "acceptance_length": acc_len,
        "acceptance_rate": acc_rate,
        "rounds": rounds,
        "kept_fraction": sum(pp["kept_fraction"] for pp in per_prompt) / n,
        "stored_bits_per_element": sum(pp["stored_bits_per_element"] for pp in per_prompt) / n,
        **_means(per_prompt, ("device_kv_fraction", "prefetch_hit")),
        **_needle(per_prompt),
        "per_prompt": per_prompt,
    }


def _means(per_prompt: list[dict], keys: Sequence[str]) -> dict:
    """Means of the per-prompt fields some methods report (SpeCache's), where present."""
    out = {}
    for k in keys:
        vals = [pp[k] for pp in per_prompt if pp.get(k) is not None]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def _needle(per_prompt: list[dict]) -> dict:
    found = [pp["needle_found"] for pp in per_prompt if "needle_found" in pp]
    return {"needle_accuracy": sum(found) / len(found), "needle_prompts": len(found)} if found else {}


@dataclass(frozen=True)
class SpeCacheSpec:
    """A SpeCache configuration as a row of the lab's results (``compressor`` names the
    variant, e.g. ``specache@1b``; ``kivi1@1b/r128`` is plain KIVI under the same
    simulation)."""

    config: Any  # sglang_vc.specache.config.SpeCacheConfig
    scenario: str = "quantization"
    mode: str = "specache"

    @property
    def name(self) -> str:
        return self.config.label

    @property
    def label(self) -> str:
        return self.config.label

    def key(self) -> dict:
        return self.config.describe()


def run_fidelity(sess, tokenizer, prompts: Sequence[dict], specs: Sequence[CompressorSpec], n_new: int,
                 draft_lengths: Sequence[int], *, chat_template: bool = True, snapkv_window: int = 32,
                 kvzip_prompt: str = KVZIP_PROMPT, specache: Sequence[Any] = (),
                 log: Callable[[str], None] = _log) -> dict:
    """Run the lab over ``prompts`` (dicts with ``prompt``, optional ``id``/``workload``);
    returns ``{"prompts": [...], "results": [...]}`` (aggregated per compressor, then per
    SpeCache configuration)."""
    specs = list(specs) + [SpeCacheSpec(c) for c in specache]
    per_spec: list[list[dict]] = [[] for _ in specs]
    infos = []
    t_all = time.perf_counter()
    for i, item in enumerate(prompts):
        ids = encode(tokenizer, item["prompt"], chat_template)
        pid = str(item.get("id", f"prompt-{i}"))
        log(f"[{i + 1}/{len(prompts)}] {pid} ({item.get('workload', '-')}, {len(ids)} tokens)")
        info, res = run_prompt(sess, tokenizer, ids, [s for s in specs if not isinstance(s, SpeCacheSpec)],
                               n_new, draft_lengths, snapkv_window=snapkv_window, kvzip_prompt=kvzip_prompt,
                               req_id=i, specache=list(specache),
                               needle_item=item if "needle" in item else None, log=log)
        meta = {"id": pid, "workload": item.get("workload")}
        infos.append({**meta, **info})
        for j, r in enumerate(res):
            per_spec[j].append({**meta, **r})
    log(f"done: {len(prompts)} prompts x {len(specs)} compressors in {time.perf_counter() - t_all:.0f}s")
    results = [aggregate(s, pp, n_new) for s, pp in zip(specs, per_spec)]
    needles = [info["needle_found"] for info in infos if "needle_found" in info]
    full_kv = {"needle_accuracy": sum(needles) / len(needles), "needle_prompts": len(needles)} if needles else {}
    by_workload = {}
    for w in sorted({str(it.get("workload")) for it in prompts}):
        by_workload[w] = {}
        for s, pp in zip(specs, per_spec):
            sub = [p for p in pp if str(p["workload"]) == w]
            a = aggregate(s, sub, n_new)
            by_workload[w][s.label] = {k: a[k] for k in ("prompts", "final_cumulative_kl", "first_divergence",
                                                         "diverged_prompts", "acceptance_length",
                                                         "needle_accuracy", "device_kv_fraction") if k in a}
    return {"prompts": infos, "results": results, "by_workload": by_workload, "full_kv": full_kv}
