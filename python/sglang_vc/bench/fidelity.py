"""Fidelity lab: how far does a lossy KV cache move a model, and how long would VeriCache's
drafts from it be accepted?

    python -m sglang_vc.bench.fidelity --model smollm2-135m --workload code,needle --n 4 \\
        --compressors all,kivi1:1 --compression-ratio 0.25 --kv-bits 2 \\
        --max-new-tokens 64 --draft-lengths 1,4,10,16,30,40 --json benchmark/results/fidelity.json

Offline, HF transformers, pure torch (no SGLang server); the lossy cache is simulated
exactly by :mod:`sglang_vc.bench.lossy_hf` (per-layer, per-kv-head attention masks for token
dropping, dequantized prompt K/V for quantization, H2O's ``update`` online during decode).

Per prompt (``--input`` text/JSONL, or ``--workload``), with the model's chat template
unless ``--no-chat-template``:

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

Query inputs: SnapKV gets the last ``--snapkv-window`` prompt queries, H2O all prompt
queries, KVzip the queries (and keys, ``recon_keys``) of a context-reconstruction pass: the
model is run, on top of the prompt's full KV, on ``--kvzip-prompt`` followed by the
prompt's own tokens (teacher-forced), and the queries of those tokens are captured.
H2O is online: ``update`` runs after every layer during decode, evicting generated tokens
too. For VeriCache rounds the drafter resumes with the H2O state (scores, kept set)
reached at ``p`` along the teacher-forced lossy pass (an approximation: a real drafter's
state would have seen the verified KV of the committed tokens).

Writes ``--json OUT`` and, next to it, ``OUT-stem_cumulative_kl.png`` (VeriCache fig. 4 /
8 style), ``OUT-stem_acceptance.png`` (fig. 9 style) and ``OUT-stem_acceptance_rate.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DRAFT_LENGTHS = (1, 4, 10, 16, 30, 40)
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


def parse_compressors(text: str, ratio: float | None, bits: int | None) -> list[CompressorSpec]:
    """``"snapkv,kivi:4,all"`` -> specs. ``NAME:VALUE`` overrides the ratio/bits of one entry;
    ``all`` adds every registered method not listed explicitly. Token-dropping methods take
    ``ratio`` (default 0.25), quantization methods ``bits`` (default: the method's lowest
    supported width). ``ValueError`` on an unknown name, a bad value, bits given where only
    token-dropping methods are listed, or a ratio given where only quantization methods are.
    """
    from sglang_vc.compress import check_bits, check_ratio, get_compressor, standalone_compressors

    # SpeCache's device copy is read with its host rows: the lab runs it as --specache
    classes = {n: type(get_compressor(n)) for n in standalone_compressors()}

    entries: list[tuple[str, str | None]] = []
    want_all = False
    for raw in [t.strip() for t in str(text).split(",") if t.strip()]:
        if raw.lower() == "all":
            want_all = True
            continue
        name, _, val = raw.partition(":")
        name = name.strip().lower()
        if name not in classes:
            raise ValueError(f"unknown compressor {name!r}; known: {', '.join(classes)}, all "
                             "(SpeCache: --specache VARIANTS)")
        entries.append((name, val.strip() or None))
    if want_all:
        explicit = {n for n, _ in entries}
        entries += [(n, None) for n in classes if n not in explicit]
    if not entries:
        raise ValueError("no compressor given")
    scenarios = {n: classes[n].scenario for n, _ in entries}
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


def read_input(path: str) -> list[dict]:
    """A JSONL of objects with a ``prompt`` field, or a plain text file (one prompt)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--input {path}: no such file")
    text = p.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    as_jsonl = p.suffix == ".jsonl"
    if not as_jsonl and lines:
        try:
            first = json.loads(lines[0])
            as_jsonl = isinstance(first, dict) and "prompt" in first
        except ValueError:
            pass
    if not as_jsonl:
        if not text.strip():
            raise ValueError(f"--input {path}: empty file")
        return [{"id": p.stem, "prompt": text, "workload": "input"}]
    items = []
    for i, ln in enumerate(lines):
        try:
            obj = json.loads(ln)
        except ValueError as e:
            raise ValueError(f"--input {path}: line {i + 1} is not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"--input {path}: line {i + 1} has no string 'prompt' field")
        items.append({"id": str(obj.get("id", f"{p.stem}-{i}")), "prompt": obj["prompt"],
                      "workload": obj.get("workload", "input")})
    if not items:
        raise ValueError(f"--input {path}: no items")
    return items


def _set_value(text: str) -> Any:
    parts = [t.strip() for t in text.split(",")]
    out = []
    for t in parts:
        try:
            out.append(int(t))
        except ValueError:
            try:
                out.append(float(t))
            except ValueError:
                out.append(t)
    return out if len(out) > 1 or text.endswith(",") or "," in text else out[0]


_LIST_PARAMS = {"lengths", "depths", "tasks", "roots", "kinds", "tool_counts"}


def workload_params(sets: Sequence[str], names: Sequence[str]) -> dict[str, dict]:
    """``--set KEY=VALUE`` (every workload) or ``--set NAME.KEY=VALUE`` (one)."""
    out: dict[str, dict] = {n: {} for n in names}
    for it in sets:
        if "=" not in it:
            raise ValueError(f"--set expects KEY=VALUE or NAME.KEY=VALUE, got {it!r}")
        key, val = it.split("=", 1)
        targets = list(names)
        if "." in key:
            wname, key = key.split(".", 1)
            if wname not in out:
                raise ValueError(f"--set {it!r}: workload {wname!r} is not among --workload {','.join(names)}")
            targets = [wname]
        v = _set_value(val)
        if key in _LIST_PARAMS and not isinstance(v, list):
            v = [v]
        for t in targets:
            out[t][key] = v
    return out


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


# ============================================================================ the lab


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _kl(lp_full, lp_lossy) -> float:
    """KL(p_full || p_lossy) in nats from float64 log-probabilities."""
    return float((lp_full.exp() * (lp_full - lp_lossy)).sum())


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
    for spec in specs:
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
        kl = [0.0]
        first_div = None
        for t, lg in enumerate(rows, start=1):
            kl.append(_kl(lp_ref[t], torch.log_softmax(lg.double(), -1)))
            if first_div is None and int(lg.argmax()) != y[t]:
                first_div = t
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
            k = 0
            size = 1 if online else first_chunk
            while k < cap_x:
                n = min(size, cap_x - k)
                inputs = y[p - 1 + k : p - 1 + k + n]  # the last committed token, then the matching drafts
                lg = sess.step(dc, inputs[0])[None] if n == 1 else sess.forward(dc, inputs)
                work["forwards"] += 1
                work["tokens"] += n
                am = lg.argmax(-1).tolist()
                for i in range(n):
                    if am[i] != y[p + k + i]:
                        return k + i
                k += n
                if not online:
                    size *= 2
            return k

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


def _cumsum(xs: Sequence[float]) -> list[float]:
    out, s = [], 0.0
    for x in xs:
        s += x
        out.append(s)
    return out


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


# ============================================================================ output


def plot_paths(json_path: str | Path) -> dict[str, str]:
    p = Path(json_path)
    stem = p.with_suffix("") if p.suffix == ".json" else p
    return {name: f"{stem}_{name}.png" for name in ("cumulative_kl", "acceptance", "acceptance_rate")}


def write_plots(out: dict, json_path: str | Path) -> dict[str, str]:
    from .plots import plot_lines

    paths = plot_paths(json_path)
    res = out["results"]
    model = out.get("model", "")
    n_prompts = len(out.get("prompts", []))
    note = f"{model}, {n_prompts} prompt(s), greedy, full-KV trajectory teacher-forced"
    plot_lines({r["label"]: (list(range(len(r["cumulative_kl"]))), r["cumulative_kl"]) for r in res},
               "decoding step t", "cumulative KL(p_full || p_lossy) [nats]",
               "Sequence-level KL along the full-KV trajectory", paths["cumulative_kl"], note=note)
    xs = sorted({int(x) for r in res for x in r["acceptance_length"]})
    plot_lines({r["label"]: ([int(x) for x in r["acceptance_length"]], list(r["acceptance_length"].values()))
                for r in res},
               "draft length x", "acceptance length (tokens / verify round)",
               "VeriCache acceptance length vs draft length", paths["acceptance"], markers=True,
               reference=("ideal (x + 1)", xs, [x + 1 for x in xs]), note=note)
    plot_lines({r["label"]: ([int(x) for x in r["acceptance_rate"]], list(r["acceptance_rate"].values()))
                for r in res},
               "draft length x", "acceptance rate (accepted / drafted)",
               "VeriCache acceptance rate vs draft length", paths["acceptance_rate"], markers=True, note=note)
    return paths


# ============================================================================ CLI


def _positive_ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_vc.bench.fidelity",
        description="Fidelity of lossy KV caches: per-step KL along the full-KV greedy trajectory, first "
                    "divergence, and VeriCache acceptance length vs draft length (HF transformers, offline).",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="built-in model name or HF folder (default %(default)s)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a text file (one prompt) or a JSONL of objects with a 'prompt' field")
    src.add_argument("--workload", help="workload name(s), comma-separated (sglang_vc.bench.workloads)")
    ap.add_argument("--n", type=int, default=None, help="prompts per workload (or first n items of --input)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="workload prompt budget in tokens (default %(default)s)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                    help="workload option, e.g. --set lengths=1536 --set needle.depths=0.25,0.5")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--compressors", default="all",
                    help="comma-separated compressor names, NAME:VALUE for a per-method ratio/bits, 'all' "
                         "for every registered method not listed (default %(default)s)")
    ap.add_argument("--specache", default="", metavar="VARIANTS",
                    help="SpeCache configurations, comma-separated BITSb[/kK][/rR][/gG][/nonspec]: e.g. "
                         "'1b,2b,1b/nonspec,1b/k16,1b/k256,1b/k0/r128' (k0 = plain KIVI under the same "
                         "simulation; defaults k64, r64, g32). Use --compressors none to run only these")
    ap.add_argument("--compression-ratio", type=float, default=None,
                    help=f"fraction of the KV kept by token-dropping methods, in (0, 1] (default {DEFAULT_RATIO})")
    ap.add_argument("--kv-bits", type=float, default=None,
                    help="bit width for quantization methods (default: each method's lowest, kivi 2, kivi1 1)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="N, trajectory length (default %(default)s)")
    ap.add_argument("--draft-lengths", type=_positive_ints, default=list(DEFAULT_DRAFT_LENGTHS),
                    help="comma-separated draft lengths x (default %(default)s)")
    ap.add_argument("--snapkv-window", type=int, default=32, help="SnapKV observation window (default %(default)s)")
    ap.add_argument("--kvzip-prompt", default=KVZIP_PROMPT, help="text before the context in KVzip's reconstruction pass")
    ap.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk size in tokens")
    ap.add_argument("--json", default="benchmark/results/fidelity.json", help="output JSON (PNGs are written next to it)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    return ap


def _validate(ap: argparse.ArgumentParser, args) -> list[CompressorSpec]:
    if args.compression_ratio is not None and not (0 < args.compression_ratio <= 1):
        ap.error(f"--compression-ratio must be in (0, 1] (fraction of the KV kept), got {args.compression_ratio:g}")
    bits = args.kv_bits
    if bits is not None:
        if not float(bits).is_integer():
            ap.error(f"--kv-bits must be an integer bit width, got {bits:g}")
        bits = int(bits)
    from sglang_vc.specache.config import parse_variant

    try:
        args.specache_configs = [parse_variant(v) for v in args.specache.split(",") if v.strip()]
    except ValueError as e:
        ap.error(f"--specache: {e}")
    labels = [c.label for c in args.specache_configs]
    if len(set(labels)) != len(labels):
        ap.error(f"--specache lists a configuration twice: {', '.join(labels)}")
    if args.compressors.strip().lower() == "none":
        if not args.specache_configs:
            ap.error("--compressors none needs --specache")
        return []
    try:
        specs = parse_compressors(args.compressors, args.compression_ratio, bits)
    except ValueError as e:
        ap.error(str(e))
    if args.max_new_tokens < 2:
        ap.error(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if args.n is not None and args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.snapkv_window < 1:
        ap.error("--snapkv-window must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.prefill_chunk < 1:
        ap.error("--prefill-chunk must be >= 1")
    return specs


def _load_prompts(ap, args, model_dir: str) -> list[dict]:
    if args.input:
        if args.sets:
            ap.error("--set applies to --workload only")
        try:
            items = read_input(args.input)
        except ValueError as e:
            ap.error(str(e))
        return items[: args.n] if args.n else items
    from .workloads import list_workloads, load_workload

    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    known = list_workloads()
    for w in names:
        if w not in known and not (w.endswith(".jsonl") and os.path.exists(w)):
            ap.error(f"unknown workload {w!r}; known: {', '.join(known)} (or a .jsonl file)")
    try:
        params = workload_params(args.sets, names)
    except ValueError as e:
        ap.error(str(e))
    items = []
    for w in names:
        try:
            wl = load_workload(w, tokenizer=model_dir, max_tokens=args.max_tokens, n=args.n, seed=args.seed,
                               **params[w])
        except (ValueError, TypeError) as e:
            ap.error(f"workload {w}: {e}")
        items += [{**it, "workload": wl.name} for it in wl]
    return items


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    specs = _validate(ap, args)

    from sglang_vc import models

    try:
        model_dir = models.resolve(args.model)
    except ValueError as e:
        ap.error(str(e))
    prompts = _load_prompts(ap, args, model_dir)
    if not prompts:
        ap.error("no prompts")

    import torch
    import transformers
    from transformers import AutoTokenizer

    from .lossy_hf import Session, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    _log(f"fidelity: model {args.model} ({model_dir}), {len(prompts)} prompts, "
         f"compressors {', '.join(s.label for s in specs)}, N={args.max_new_tokens}, x={args.draft_lengths}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, args.dtype)
    sess = Session(model, prefill_chunk=args.prefill_chunk)
    chat = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
    t0 = time.perf_counter()
    out = run_fidelity(sess, tokenizer, prompts, specs, args.max_new_tokens, args.draft_lengths,
                       chat_template=chat, snapkv_window=args.snapkv_window, kvzip_prompt=args.kvzip_prompt,
                       specache=args.specache_configs)
    elapsed = time.perf_counter() - t0
    cfg = model.config
    doc = {
        "benchmark": "fidelity",
        "model": args.model,
        "model_path": model_dir,
        "settings": {
            "command": "python -m sglang_vc.bench.fidelity " + " ".join(sys.argv[1:] if argv is None else argv),
            "input": args.input, "workload": args.workload, "n": args.n, "max_tokens": args.max_tokens,
            "workload_params": args.sets, "seed": args.seed,
            "compressors": [s.label for s in specs],
            "specache": [c.label for c in args.specache_configs],
            "compression_ratio": args.compression_ratio if args.compression_ratio is not None else DEFAULT_RATIO,
            "kv_bits": {s.label: s.value for s in specs if s.scenario == "quantization"},
            "max_new_tokens": args.max_new_tokens, "draft_lengths": sorted(set(args.draft_lengths)),
            "chat_template": chat, "snapkv_window": args.snapkv_window, "kvzip_prompt": args.kvzip_prompt,
            "dtype": args.dtype, "threads": torch.get_num_threads(), "prefill_chunk": args.prefill_chunk,
            "attention": "transformers eager attention + per-layer per-kv-head visibility mask (vc_lossy)",
            "model_config": {"layers": cfg.num_hidden_layers, "q_heads": cfg.num_attention_heads,
                             "kv_heads": cfg.num_key_value_heads,
                             "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)},
            "definitions": {
                "kl": "KL(p_full(.|y_<t) || p_lossy(.|y_<t)) in nats at step t along the full-KV greedy "
                      "trajectory y (teacher forced); kl[0] = 0 (first token from the full prefill); mean over prompts",
                "cumulative_kl": "running sum of kl (sequence-level KL, VeriCache eq. 2)",
                "first_divergence": "first step t where free-running lossy greedy differs from full-KV greedy "
                                    "(= tokens matched before it); aggregate: mean over prompts with non-diverged "
                                    "prompts counted as N, null if none diverged",
                "acceptance_length": "tokens committed per VeriCache verify round (accepted drafts + correction or "
                                     "bonus), drafter = compressed prompt KV + exact KV of committed tokens; "
                                     "rounds until N tokens are committed (the first by the prefill); pooled",
                "acceptance_rate": "accepted drafts / drafted tokens (x per round), pooled",
                "h2o": "online: update() after every layer during decode; VeriCache rounds resume with the H2O "
                       "state reached at p along the teacher-forced lossy pass",
                "kvzip": "queries of a reconstruction pass: --kvzip-prompt + the prompt tokens, teacher-forced "
                         "on top of the prompt's full KV; recon_keys passed",
                "quantization": "prompt K/V replaced by dequantized values (residual window exact); "
                                "generated tokens full precision",
                "specache": "bench.specache_hf: the prompt and then the decode tail quantized by KIVI as the "
                            "server does; each step forwards the output and the speculative token, the output "
                            "attends with the previous step's top-k rows in full precision (eq. 1); kl/first "
                            "divergence teacher-forced against the token-by-token full-KV log-probs; "
                            "acceptance_length: SpeCache as VeriCache's drafter, resuming in the state the "
                            "teacher-forced pass reached; prefetch_hit: attention mass of the output token's "
                            "own top-k on the prefetched rows; needle_accuracy: free-running answer contains "
                            "the needle",
            },
        },
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "elapsed_s": round(elapsed, 1)},
        **out,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    _log(f"wrote {path}")
    if not args.no_plot:
        for p in write_plots(doc, path).values():
            _log(f"wrote {p}")
    _log(summary_table(doc))
    return 0


def summary_table(doc: dict) -> str:
    res = doc["results"]
    xs = sorted({int(x) for r in res for x in r["acceptance_length"]})
    head = (f"{'compressor':<20} {'cumKL':>8} {'1st div':>8} {'dev KV':>7} {'needle':>7} "
            + " ".join(f"{'x=' + str(x):>7}" for x in xs))
    lines = [head]
    full = doc.get("full_kv") or {}
    if "needle_accuracy" in full:
        lines.append(f"{'full KV':<20} {0.0:>8.3f} {'-':>8} {1.0:>7.3f} {full['needle_accuracy']:>7.2f}")
    for r in res:
        fd = "-" if r["first_divergence"] is None else f"{r['first_divergence']:.1f}"
        dev = f"{r['device_kv_fraction']:.3f}" if "device_kv_fraction" in r else "-"
        needle = f"{r['needle_accuracy']:.2f}" if "needle_accuracy" in r else "-"
        lines.append(f"{r['label']:<20} {r['final_cumulative_kl']:>8.3f} {fd:>8} {dev:>7} {needle:>7} "
                     + " ".join(f"{r['acceptance_length'][str(x)]:>7.2f}" for x in xs))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
