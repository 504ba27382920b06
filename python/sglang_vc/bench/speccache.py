"""``python -m sglang_vc.bench.speccache --json OUT``: SpecCache's TTFT-quality plane in
the lab (HF transformers, :mod:`.speccache_hf`), every selector against full recompute.

Per model pair (target, speculative model) and RAG item (:mod:`.workloads`, ``rag``):
the target's prompt is tokenized piece by piece (intro, each chunk, the question) so
that a chunk's tokens are the same in every prompt; each chunk's KV is computed once,
alone (not timed: it is precomputed). Then, per selector and ratio, one request's TTFT
is measured as its parts, run one after the other in this process:

* ``score``: the speculative model's forward over the whole text with hidden states
  (``speccache``), or the target's first layer over every token (``cacheblend``);
* ``align``: the character-offset alignment of the two tokenizations;
* ``load``: assembling the reused chunk KV at its positions (RoPE re-rotation);
* ``prefill``: the target's selective-recompute prefill up to the first token's logits.

Full recompute is the target's ordinary prefill of the same tokens. Quality is the
workload's exact match and token F1 of the greedy answer; ``kl_first`` is the mean KL
(full recompute || method) over the first answer tokens, teacher-forced on full
recompute's answer. ``goodput`` replays Poisson arrivals (rates per second, seeded)
through one FIFO server whose service time per request is its measured TTFT: good
requests (quality at least 80% of full recompute's mean) per second of the replay. This
is a model of a queue fed with measured times, not a served run.

Not here: the server path (chunk KV in the radix tree's tiers, the selective prefill in
SGLang's scheduler); this benchmark measures the mechanism's compute, which is what a
2-core CPU can show (prefill is compute-bound here as on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from sglang_vc.speccache import align as al
from sglang_vc.speccache import layout
from sglang_vc.speccache import rope
from sglang_vc.speccache import spans as sp
from sglang_vc.speccache.selectors import SELECTORS, Need, SelectionInput, get_selector

from . import speccache_hf as sc
from .lossy_hf import Session, load_model
from .workloads import HOPS

KL_TOKENS = 8
WORKLOAD_CHOICES = ("rag", "rag_multihop")  # bench.workloads' RAG workloads
HOP_HELP = ("rag_multihop: far (facts anywhere, chunks shuffled) or near (the answer chunk right after "
            "the bridge chunk, the two facts adjacent across the boundary: the easier variant)")
GOOD_FRACTION = 0.8  # the paper's eq. 8 threshold: 80% of full recompute's mean score


def log(msg: str) -> None:
    print(f"[speccache] {msg}", file=sys.stderr, flush=True)


@dataclass
class Model:
    name: str
    sess: Session
    tokenizer: object


def _load(name: str) -> Model:
    from transformers import AutoTokenizer

    from sglang_vc import models

    path = models.resolve(name)
    return Model(name, Session(load_model(path)), AutoTokenizer.from_pretrained(path))


def _decode(target: Model, logits, cache, max_new: int) -> list[int]:
    eos = {t for t in (target.tokenizer.eos_token_id,) if t is not None}
    return sc.greedy(target.sess, logits, cache, max_new, eos)


@torch.no_grad()
def _forced_logprobs(sess: Session, first_logits, cache, forced: Sequence[int]) -> list[torch.Tensor]:
    out = [torch.log_softmax(first_logits.double(), -1)]
    for t in forced[: KL_TOKENS - 1]:
        out.append(torch.log_softmax(sess.step(cache, t).double(), -1))
    return out


def _kl(ref: list, got: list) -> float:
    n = min(len(ref), len(got))
    return sum(float((r.exp() * (r - g)).sum()) for r, g in zip(ref[:n], got[:n])) / max(n, 1)


def run_item(item: dict, target: Model, spec: Optional[Model], selectors: Sequence[str], ratios: Sequence[float],
             kv_cache: dict) -> list[dict]:
    from .workloads import score, token_f1

    prompt = layout.tokenize(target.tokenizer, item["chunk_prefix"], item["chunks"], item["question"])
    cos_sin = rope.hf_cos_sin(target.sess.model)
    kvs = []
    for ids in prompt.chunk_ids:  # precomputed once per chunk: not part of any TTFT
        key = (target.name, tuple(ids))
        if key not in kv_cache:
            kv_cache[key] = sc.chunk_kv(target.sess, ids)
        kvs.append(kv_cache[key])
    max_new = int(item.get("max_new_tokens", 8))

    t0 = time.perf_counter()
    cache, logits, _, _ = target.sess.prefill(prompt.ids)
    full_ttft = time.perf_counter() - t0
    ref_answer = _decode(target, logits, cache, max_new)
    cache, logits, _, _ = target.sess.prefill(prompt.ids)
    ref_lp = _forced_logprobs(target.sess, logits, cache, ref_answer)
    rows = [_row(item, "full-recompute", 1.0, target, spec, {"prefill": full_ttft}, ref_answer, 0.0,
                 score, token_f1, prompt)]

    spec_cache: dict = {}

    def spec_scores():
        if "scores" not in spec_cache:
            t = time.perf_counter()
            enc = spec.tokenizer(prompt.text, return_offsets_mapping=True)
            with torch.no_grad():
                out = spec.sess.model.get_decoder()(torch.tensor([enc["input_ids"]]), output_hidden_states=True)
            scores = sp.importance([h[0] for h in out.hidden_states[1:]])
            spec_cache["score"] = time.perf_counter() - t
            t = time.perf_counter()
            alignment = al.align([tuple(o) for o in enc["offset_mapping"]], prompt.offsets)
            spec_cache["align"] = time.perf_counter() - t
            spec_cache["scores"] = (scores, alignment)
        return spec_cache["scores"]

    for name in selectors:
        sel = get_selector(name)
        for ratio in (ratios if name not in ("full-reuse", "full-recompute") else [0.0 if name == "full-reuse" else 1.0]):
            if name == "full-recompute":
                continue  # the reference row above
            times: dict[str, float] = {}
            t = time.perf_counter()
            reused = sc.assemble(len(prompt.ids), prompt.chunks.starts, kvs, cos_sin)
            times["load"] = time.perf_counter() - t
            inp = SelectionInput(prompt.chunks, seed=int(item["id"].split("-")[-1]))
            if sel.needs is Need.SPEC_SCORES:
                if spec is None:
                    raise ValueError("speccache needs a speculative model")
                spec_cache.clear()
                inp.spec_scores = spec_scores
            elif sel.needs is Need.FIRST_LAYER_DEVIATION:
                t = time.perf_counter()
                inp.first_layer_deviation = sc.first_layer_deviation(target.sess, prompt.ids, reused)
                times["score"] = time.perf_counter() - t
            mask = sel.select(inp, ratio)
            if sel.needs is Need.SPEC_SCORES:
                times["score"], times["align"] = spec_cache["score"], spec_cache["align"]
            recompute = mask | ~prompt.chunks.mask()
            t = time.perf_counter()
            logits, fused = sc.selective_prefill(target.sess, prompt.ids, reused, recompute)
            times["prefill"] = time.perf_counter() - t
            answer = _decode(target, logits, fused.cache(), max_new)
            logits, fused = sc.selective_prefill(target.sess, prompt.ids, reused, recompute)
            kl = _kl(ref_lp, _forced_logprobs(target.sess, logits, fused.cache(), ref_answer))
            row = _row(item, name, ratio, target, spec, times, answer, kl, score, token_f1, prompt)
            row["recomputed_fraction"] = float(mask.sum()) / max(prompt.chunks.num_chunk_tokens, 1)
            rows.append(row)
    return rows


def _row(item, selector, ratio, target, spec, times, answer_ids, kl, score, token_f1, prompt) -> dict:
    text = target.tokenizer.decode(answer_ids, skip_special_tokens=True)
    return {"item": item["id"], "task": item["task"], "selector": selector, "ratio": ratio,
            "target": target.name, "spec_model": spec.name if spec is not None else None,
            "ttft_s": sum(times.values()), "breakdown_s": times, "answer": text,
            "exact_match": score(item, text), "f1": token_f1(text, item["answer"]), "kl_first": kl,
            "prompt_tokens": len(prompt.ids), "chunk_tokens": prompt.chunks.num_chunk_tokens}


def goodput(ttfts: Sequence[float], good: Sequence[bool], rate: float, seed: int = 0) -> float:
    """Good requests per second when requests arrive as a Poisson process of ``rate``
    per second and one FIFO server takes each request's TTFT to serve it."""
    rng = random.Random(seed)
    clock, free = 0.0, 0.0
    for s in ttfts:
        clock += rng.expovariate(rate)
        free = max(free, clock) + s
    return sum(good) / free if free > 0 else 0.0


def _mean_or_none(values: list) -> Optional[float]:
    """The mean, or None where a value was not measured (NaN: served runs have no KL)."""
    return None if any(v != v for v in values) else statistics.mean(values)


def summarize(rows: list[dict], rates: Sequence[float]) -> list[dict]:
    out = []
    keys = sorted({(r["target"], r["spec_model"], r["selector"], r["ratio"]) for r in rows},
                  key=lambda k: (k[0], str(k[1]), k[2], k[3]))
    for target, spec, selector, ratio in keys:
        rs = [r for r in rows if (r["target"], r["spec_model"], r["selector"], r["ratio"]) == (target, spec, selector, ratio)]
        ref = [r for r in rows if r["target"] == target and r["spec_model"] == spec and r["selector"] == "full-recompute"]
        threshold = GOOD_FRACTION * statistics.mean(r["f1"] for r in ref)
        ttft = [r["ttft_s"] for r in rs]
        parts = sorted({k for r in rs for k in r["breakdown_s"]})
        entry = {
            "selector": selector, "ratio": ratio, "target": target, "spec_model": spec, "n": len(rs),
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p90_s": sorted(ttft)[max(0, math.ceil(0.9 * len(ttft)) - 1)],
            "breakdown_mean_s": {p: statistics.mean(r["breakdown_s"].get(p, 0.0) for r in rs) for p in parts},
            "quality": statistics.mean(r["f1"] for r in rs),
            "exact_match": statistics.mean(r["exact_match"] for r in rs),
            "kl_first": _mean_or_none([r["kl_first"] for r in rs]),
            "goodput": {str(rate): goodput(ttft, [r["f1"] >= threshold for r in rs], rate) for rate in rates},
        }
        full = statistics.mean(r["ttft_s"] for r in ref)
        entry["ttft_speedup_vs_full"] = full / entry["ttft_mean_s"] if entry["ttft_mean_s"] > 0 else None
        out.append(entry)
    return out


def plot(results: list[dict], path: Path, title: str = "SpecCache lab: TTFT vs quality") -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    for r in results:
        label = f"{r['selector']}" + (f"@{r['ratio']:g}" if r["selector"] not in ("full-recompute", "full-reuse") else "")
        ax.scatter(r["ttft_mean_s"], r["quality"], s=18)
        ax.annotate(f"{label} ({r['target']})", (r["ttft_mean_s"], r["quality"]), fontsize=6)
    ax.set_xlabel("TTFT mean (s, this machine)")
    ax.set_ylabel("quality (token F1)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def log_results(results: list[dict]) -> None:
    for r in results:
        kl = "" if r["kl_first"] is None else f"  KL {r['kl_first']:.3f}"
        log(f"{r['target']:>20} <- {str(r['spec_model']):<20} {r['selector']:>14}@{r['ratio']:<4g} "
            f"TTFT {r['ttft_mean_s']:.2f}s (x{r['ttft_speedup_vs_full']:.2f})  F1 {r['quality']:.2f}  "
            f"EM {r['exact_match']:.2f}{kl}")


def workload_params(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """``load_workload``'s options from the shared flags (``--chunks``, ``--chunk-tokens``,
    ``--hop``); ``--hop near`` on a workload other than ``rag_multihop`` is refused."""
    params = {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
              "max_tokens": max(8192, args.chunks * args.chunk_tokens + 256)}
    if args.workload == "rag_multihop":
        params["hop"] = args.hop
    elif args.hop != "far":
        ap.error(f"--hop {args.hop}: only rag_multihop has hops (got --workload {args.workload})")
    return params


def parse_pairs(ap: argparse.ArgumentParser, text: Optional[str], quick: bool) -> list[tuple[str, str]]:
    """``TARGET:SPEC,...`` (the defaults of the issue: both pairs, or the quick one)."""
    text = text or ("qwen2.5-coder-0.5b:smollm2-135m" if quick else
                    "qwen2.5-coder-1.5b:qwen2.5-coder-0.5b,qwen2.5-coder-1.5b:smollm2-135m")
    pairs = []
    for p in text.split(","):
        t, _, s = p.partition(":")
        if not t or not s:
            ap.error(f"--pairs: want TARGET:SPEC, got {p!r}")
        pairs.append((t.strip(), s.strip()))
    return pairs


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.speccache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output JSON (a PNG is written beside it)")
    ap.add_argument("--pairs", default=None,
                    help="TARGET:SPEC,... (default qwen2.5-coder-1.5b:qwen2.5-coder-0.5b,"
                         "qwen2.5-coder-1.5b:smollm2-135m; --quick: qwen2.5-coder-0.5b:smollm2-135m)")
    ap.add_argument("--selectors", default=",".join(SELECTORS), help="comma-separated selector names")
    ap.add_argument("--ratios", default="0.15,0.2")
    ap.add_argument("--n", type=int, default=None, help="RAG items (default 12, --quick 4)")
    ap.add_argument("--workload", choices=WORKLOAD_CHOICES, default="rag",
                    help="rag (one fact or two linked facts per item) or rag_multihop (a bridge entity, the "
                    "answer in another chunk, a lure and a distractor on the same entities)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--hop", choices=HOPS, default="far", help=HOP_HELP)
    ap.add_argument("--rates", default="0.05,0.1,0.2", help="Poisson arrival rates (req/s) for goodput")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError as exc:
        ap.error(f"--ratios/--rates: {exc}")
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        ap.error("--ratios must be in (0, 1]")
    if not rates or any(r <= 0 for r in rates):
        ap.error("--rates must be > 0")
    selectors = [s.strip() for s in args.selectors.split(",") if s.strip()]
    unknown = [s for s in selectors if s not in SELECTORS]
    if unknown:
        ap.error(f"unknown selector(s) {unknown}; known: {', '.join(SELECTORS)}")
    if "full-recompute" not in selectors:
        selectors.append("full-recompute")
    pairs = parse_pairs(ap, args.pairs, args.quick)
    n = args.n if args.n is not None else (4 if args.quick else 12)
    params = workload_params(ap, args)

    from .workloads import load_workload

    models: dict[str, Model] = {}
    rows: list[dict] = []
    kv_cache: dict = {}
    started = time.perf_counter()
    for target_name, spec_name in pairs:
        for name in (target_name, spec_name):
            if name not in models:
                log(f"loading {name}")
                try:
                    models[name] = _load(name)
                except Exception as exc:  # unknown alias, or a model that cannot be prepared here
                    print(f"speccache: cannot load model {name!r}: {exc}", file=sys.stderr)
                    return 2
        target, spec = models[target_name], models[spec_name]
        items = load_workload(args.workload, tokenizer=target.tokenizer, n=n, **params)
        for i, item in enumerate(items):
            log(f"{target_name} <- {spec_name}: item {i + 1}/{len(items)} ({item['task']}, {item['n_tokens']} tokens)")
            rows += run_item(item, target, spec, selectors, ratios, kv_cache)
    results = summarize(rows, rates)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "speccache", "workload": args.workload, "mode": "lab (HF transformers, this process)", "pairs": pairs,
              "selectors": selectors, "ratios": ratios, "n": n, "chunks": args.chunks,
              "chunk_tokens": args.chunk_tokens, "hop": params.get("hop"), "rates": rates,
              "good_fraction": GOOD_FRACTION,
              "kl_tokens": KL_TOKENS, "elapsed_s": time.perf_counter() - started, "results": results, "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    png = plot(results, out.with_suffix(".png"))
    log_results(results)
    log(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
