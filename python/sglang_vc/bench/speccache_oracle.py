"""``python -m sglang_vc.bench.speccache_oracle --json OUT``: how well each selector finds
the tokens whose reused KV is most wrong for the *target* model (issue #76).

Per RAG item (``rag_multihop``, laid out as :mod:`sglang_vc.speccache.layout`), in the
HF lab (:mod:`.speccache_hf`):

* **oracle**: the target's own per-layer KV deviation between chunk-wise reuse (each
  chunk prefilled alone, keys re-rotated to its position) and the full prefill
  (:func:`sglang_vc.speccache.signals.kv_deviation`). Its top-``budget`` chunk tokens
  at each depth (``first`` = layer 1, ``middle``, ``deep`` = last third, ``all``) are
  the oracle sets;
* **recall** of a selector at a depth: ``|selected & oracle top-k| / k`` at the same
  budget ``k = ceil(ratio * chunk tokens)``; also the share of each planted fact's tokens
  it recomputes (:func:`.speccache_serve.selection_report`) and, unless ``--no-kl``,
  the KL (full || selective) of the first answer token.

Selectors: ``oracle:DEPTH``; ``cacheblend``, ``epic``, ``random``; and
``speccache:SIGNAL[/nospan][@target]``: the project's ``speccache`` selector (span
completion, alignment, budget unchanged) fed a speculative signal (:data:`SIGNALS`);
``/nospan`` turns span completion off, ``@target`` uses the target itself as the
speculative model (does the signal track the deviation even on the same model?).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from sglang_vc.speccache import align as al
from sglang_vc.speccache import layout, rope
from sglang_vc.speccache import signals as sg
from sglang_vc.speccache import spans as sp
from sglang_vc.speccache.selectors import SelectionInput, get_selector
from sglang_vc.speccache.selectors.base import top_chunk_tokens
from sglang_vc.speccache.selectors.speccache import SpecCacheSelector

from . import speccache_hf as sc
from .lossy_hf import cache_kv
from .speccache import Model, _load, log
from .speccache_serve import selection_report

# the speculative model's per-token signal, all over its deep layers (the last third)
SIGNALS = {
    "norm": "eq. 1 as served: mean L2 norm of HF hidden_states[1:] (the last one is after the final norm)",
    "norm-prenorm": "eq. 1 on every layer's raw output (the last layer before the final norm)",
    "vnorm": "mean L2 norm of the value vectors (the paper's argument for eq. 1)",
    "dev": "the speculative model's own KV deviation, chunk-wise reuse vs full prefill",
    "dev-first": "the same at layer 1 only (CacheBlend run on the speculative model)",
}
DEFAULT_SELECTORS = ("oracle:first,oracle:middle,oracle:deep,cacheblend,epic,random,"
                     "speccache:norm,speccache:norm/nospan,speccache:norm-prenorm,speccache:vnorm,"
                     "speccache:dev,speccache:dev-first,speccache:norm@target")
DEPTHS = ("first", "middle", "deep", "all")
NOSPAN_COVER = 2.0  # a coverage threshold no span reaches: completion off


@dataclass
class TargetItem:
    """One item prepared on the target."""

    item: dict
    target_name: str
    prompt: layout.Prompt
    reused: sc.FusedKV
    deviation: Tensor  # [L, N] the oracle's per-layer deviation
    full_logits: Tensor  # the full prefill's last-token logits


def _chunk_kvs(model: Model, prompt: layout.Prompt, kv_cache: dict) -> list:
    out = []
    for ids in prompt.chunk_ids:  # precomputed once per chunk, as the server's tree holds them
        key = (model.name, tuple(ids))
        if key not in kv_cache:
            kv_cache[key] = sc.chunk_kv(model.sess, ids)
        out.append(kv_cache[key])
    return out


@torch.no_grad()
def reuse_deviation(model: Model, prompt: layout.Prompt, kv_cache: dict) -> tuple[sc.FusedKV, Tensor, Tensor]:
    """``(reused KV, [L, N] deviation from the full prefill, full last logits)`` of
    ``model`` on ``prompt`` (its own tokenization)."""
    kvs = _chunk_kvs(model, prompt, kv_cache)
    reused = sc.assemble(len(prompt.ids), prompt.chunks.starts, kvs, rope.hf_cos_sin(model.sess.model))
    cache, logits, _, _ = model.sess.prefill(prompt.ids)
    dev = sg.kv_deviation(cache_kv(cache), list(zip(reused.k, reused.v)))
    return reused, dev, logits


def prepare_target(target: Model, item: dict, kv_cache: dict) -> TargetItem:
    prompt = layout.tokenize(target.tokenizer, item["chunk_prefix"], item["chunks"], item["question"])
    reused, dev, logits = reuse_deviation(target, prompt, kv_cache)
    return TargetItem(item, target.name, prompt, reused, dev, logits)


@torch.no_grad()
def _hidden_and_values(model: Model, text: str) -> tuple[list[Tensor], list[Tensor], list[Tensor], list]:
    """One forward of ``model`` over ``text`` (one tokenizer call, as the server's
    :class:`~sglang_vc.speccache.spec_model.SpecModel`): HF's ``hidden_states[1:]``, each
    decoder layer's raw output (hooks), the per-layer KV, and the token offsets."""
    enc = model.tokenizer(text, return_offsets_mapping=True)
    decoder = model.sess.model.get_decoder()
    raw: list[Tensor] = []

    def hook(_mod, _inp, out):
        raw.append((out[0] if isinstance(out, tuple) else out)[0].detach())

    handles = [layer.register_forward_hook(hook) for layer in decoder.layers]
    try:
        out = decoder(torch.tensor([enc["input_ids"]]), output_hidden_states=True, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    hidden = [h[0] for h in out.hidden_states[1:]]
    return hidden, raw, cache_kv(out.past_key_values), [tuple(o) for o in enc["offset_mapping"]]


def _memo(kv_cache: dict, key: tuple, make):
    """``make()`` once per item (keys start with ``"signal"``: dropped after each item)."""
    if key not in kv_cache:
        kv_cache[key] = make()
    return kv_cache[key]


def _spec_deviation(spec: Model, t: TargetItem, kv_cache: dict) -> tuple[layout.Prompt, Tensor]:
    item = t.item
    sprompt = layout.tokenize(spec.tokenizer, item["chunk_prefix"], item["chunks"], item["question"])
    if sprompt.ids == t.prompt.ids and spec.name == t.target_name:  # the target itself: the oracle's
        return sprompt, t.deviation
    return sprompt, reuse_deviation(spec, sprompt, kv_cache)[1]


def spec_signal(spec: Model, t: TargetItem, signal: str, kv_cache: dict) -> tuple[Tensor, al.Alignment]:
    """The speculative ``signal`` (:data:`SIGNALS`) over ``spec``'s tokens, and their
    alignment to the target's."""
    key = ("signal", spec.name, t.item["id"], signal)
    if key in kv_cache:
        return kv_cache[key]
    if signal in ("norm", "norm-prenorm", "vnorm"):
        hidden, raw, kv, offsets = _memo(kv_cache, ("signal", spec.name, t.item["id"], "forward"),
                                         lambda: _hidden_and_values(spec, t.prompt.text))
        layers = sp.deep_layers(len(hidden))
        scores = {"norm": sp.importance(hidden), "norm-prenorm": sp.importance(raw),
                  "vnorm": sg.layer_mean(sg.value_norm(kv), layers)}[signal]
    elif signal in ("dev", "dev-first"):
        sprompt, dev = _memo(kv_cache, ("signal", spec.name, t.item["id"], "deviation"),
                             lambda: _spec_deviation(spec, t, kv_cache))
        in_chunk = sprompt.chunks.mask()
        layers = sp.deep_layers(dev.shape[0]) if signal == "dev" else [1]
        # tokens outside the chunks have no reused KV (their "deviation" is their whole KV):
        # zero, so that the span segmentation's min-max normalization sees chunk tokens only
        scores = torch.where(in_chunk, sg.layer_mean(dev, layers, in_chunk), torch.zeros(()))
        offsets = sprompt.offsets
    else:
        raise ValueError(f"unknown signal {signal!r}; known: {', '.join(SIGNALS)}")
    out = (scores.float(), al.align(offsets, t.prompt.offsets))
    kv_cache[key] = out
    return out


def select(name: str, t: TargetItem, ratio: float, target: Model, spec: Model, kv_cache: dict) -> Tensor:
    """The ``[N]`` bool chunk tokens selector ``name`` recomputes at ``ratio``."""
    chunks = t.prompt.chunks
    budget = chunks.budget(ratio)
    if name.startswith("oracle:"):
        layers = sg.depths(t.deviation.shape[0])[name.split(":", 1)[1]]
        return top_chunk_tokens(sg.layer_mean(t.deviation, layers, chunks.mask()), chunks, budget)
    inp = SelectionInput(chunks, seed=int(t.item["id"].split("-")[-1]))
    if name.startswith("speccache:"):
        rest = name.split(":", 1)[1]
        rest, _, who = rest.partition("@")
        signal, _, opt = rest.partition("/")
        model = target if who == "target" else spec
        inp.spec_scores = lambda: spec_signal(model, t, signal, kv_cache)
        sel = SpecCacheSelector(tau_cover=NOSPAN_COVER) if opt == "nospan" else SpecCacheSelector()
        return sel.select(inp, ratio)
    sel = get_selector(name)
    if name == "cacheblend":  # the lab's own CacheBlend signal, not the oracle's layer 1
        inp.first_layer_deviation = sc.first_layer_deviation(target.sess, t.prompt.ids, t.reused)
    return sel.select(inp, ratio)


def recall(selected: Tensor, oracle: Tensor) -> float:
    """``|selected & oracle| / |oracle|`` (1.0 for an empty oracle)."""
    k = int(oracle.sum())
    return float((selected & oracle).sum()) / k if k else 1.0


def _kl(ref_logits: Tensor, logits: Tensor) -> float:
    p, q = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def run_item(t: TargetItem, target: Model, spec: Model, selectors: Sequence[str], ratios: Sequence[float],
             kv_cache: dict, kl: bool = True) -> list[dict]:
    chunks = t.prompt.chunks
    depth_layers = sg.depths(t.deviation.shape[0])
    rows = []
    for ratio in ratios:
        budget = chunks.budget(ratio)
        oracles = {d: top_chunk_tokens(sg.layer_mean(t.deviation, ls, chunks.mask()), chunks, budget)
                   for d, ls in depth_layers.items()}
        for name in selectors:
            mask = select(name, t, ratio, target, spec, kv_cache)
            row = {"item": t.item["id"], "selector": name, "ratio": ratio, "budget": budget,
                   "selected": int(mask.sum()), "recall": {d: recall(mask, o) for d, o in oracles.items()},
                   **selection_report(t.item, t.prompt, mask.nonzero().flatten().tolist())}
            if kl:
                logits, _ = sc.selective_prefill(target.sess, t.prompt.ids, t.reused, mask | ~chunks.mask())
                row["kl_first"] = _kl(t.full_logits, logits)
            rows.append(row)
    return rows


def served_rows(served: dict, target: Model, kv_cache: dict, depth_oracles: Sequence[str] = ("oracle:deep",)) -> list[dict]:
    """Recall of the choices a served run recorded (``bench.speccache_serve``'s
    ``selection.positions``, the server's target tokens) against ``target``'s oracle on
    the same items; ``depth_oracles`` are added as rows of their own (what the oracle
    would recompute of each fact)."""
    from .workloads import load_workload

    mine = [r for r in served["rows"] if r["target"] == target.name and r["ratio"] > 0
            and "positions" in r.get("selection", {})]
    if not mine:
        raise ValueError(f"the served run has no recorded selections of target {target.name!r}")
    index = {int(r["item"].split("-")[-1]) for r in mine}
    items = load_workload(served["workload"], tokenizer=target.tokenizer, n=max(index) + 1, chunks=served["chunks"],
                          chunk_tokens=served["chunk_tokens"], hop=served["hop"] or "far",
                          max_tokens=max(8192, served["chunks"] * served["chunk_tokens"] + 256))
    wanted = {r["item"] for r in mine}
    rows = []
    for item in [it for it in items if it["id"] in wanted]:
        log(f"oracle {target.name} (served run): item {item['id']}")
        t = prepare_target(target, item, kv_cache)
        n, chunks = len(t.prompt.ids), t.prompt.chunks
        for r in [r for r in mine if r["item"] == item["id"]]:
            oracles = {d: top_chunk_tokens(sg.layer_mean(t.deviation, ls, chunks.mask()), chunks, chunks.budget(r["ratio"]))
                       for d, ls in sg.depths(t.deviation.shape[0]).items()}
            mask = torch.zeros(n, dtype=torch.bool)
            mask[[p for p in r["selection"]["positions"] if p < n]] = True
            mask &= chunks.mask()
            name = r["selector"] + ("" if r["selector"] != "speccache" else f"({r['spec_model']})")
            rows.append({"hop": served["hop"], "item": item["id"], "selector": name, "ratio": r["ratio"],
                         "selected": int(mask.sum()), "recall": {d: recall(mask, o) for d, o in oracles.items()},
                         "fact_recomputed": r["selection"]["fact_recomputed"], "exact_match": r["exact_match"]})
        for name in depth_oracles:
            for ratio in sorted({r["ratio"] for r in mine if r["item"] == item["id"] and r["ratio"] > 0}):
                rows.extend({"hop": served["hop"], **x} for x in run_item(t, target, target, [name], [ratio], kv_cache, kl=False))
        kv_cache = {k: v for k, v in kv_cache.items() if k[0] != "signal"}
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Means per (hop, selector, ratio) over items."""
    out = []
    keys = list(dict.fromkeys((r["hop"], r["selector"], r["ratio"]) for r in rows))
    for hop, name, ratio in keys:
        rs = [r for r in rows if (r["hop"], r["selector"], r["ratio"]) == (hop, name, ratio)]
        entry = {"hop": hop, "selector": name, "ratio": ratio, "n": len(rs),
                 "recall": {d: statistics.mean(r["recall"][d] for r in rs) for d in DEPTHS}}
        facts = sorted({f for r in rs for f in r["fact_recomputed"]})
        entry["fact_recomputed"] = {f: statistics.mean(r["fact_recomputed"].get(f, 0.0) for r in rs) for f in facts}
        if all("exact_match" in r for r in rs):  # --served: the server's answers
            entry["exact_match"] = statistics.mean(r["exact_match"] for r in rs)
        if all("kl_first" in r for r in rs):
            entry["kl_first"] = statistics.mean(r["kl_first"] for r in rs)
        out.append(entry)
    return out


def table(results: list[dict]) -> str:
    """The summary as a Markdown table."""
    lines = ["| hop | ratio | selector | n | recall first | middle | deep | all | bridge | answer | lure | KL first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in results:
        f, r = e["fact_recomputed"], e["recall"]
        kl = f"{e['kl_first']:.3f}" if "kl_first" in e else ""
        lines.append(f"| {e['hop']} | {e['ratio']:g} | {e['selector']} | {e['n']} | {r['first']:.2f} | "
                     f"{r['middle']:.2f} | {r['deep']:.2f} | {r['all']:.2f} | {f.get('bridge', 0):.2f} | "
                     f"{f.get('answer', 0):.2f} | {f.get('lure', 0):.2f} | {kl} |")
    return "\n".join(lines)


def _write(out: Path, args: argparse.Namespace, selectors: list[str], ratios: list[float], rows: list[dict],
           started: float) -> str:
    results = summarize(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "speccache_oracle", "target": args.target, "spec": args.spec,
                               "selectors": selectors, "ratios": ratios, "signals": SIGNALS,
                               "elapsed_s": time.perf_counter() - started, "results": results, "rows": rows},
                              indent=2))
    md = table(results)
    out.with_suffix(".md").write_text(md + "\n")
    return md


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.speccache_oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output JSON (a Markdown table is written beside it)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--spec", default="smollm2-135m")
    ap.add_argument("--selectors", default=DEFAULT_SELECTORS)
    ap.add_argument("--ratios", default="0.15")
    ap.add_argument("--hops", default="near,far")
    ap.add_argument("--n", type=int, default=10, help="items per hop")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--no-kl", action="store_true", help="skip the selective prefills (recall only)")
    ap.add_argument("--served", metavar="SERVED.json", default=None,
                    help="score the selections a bench.speccache_serve run recorded, on its items, against "
                    "its target's oracle (its selectors, ratios and items; the other flags unused)")
    args = ap.parse_args(argv)
    if args.served:
        return _main_served(args)
    selectors = [s.strip() for s in args.selectors.split(",") if s.strip()]
    ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    from .workloads import load_workload

    target = _load(args.target)
    spec = target if args.spec == args.target else _load(args.spec)
    kv_cache: dict = {}
    rows: list[dict] = []
    md = ""
    started = time.perf_counter()
    for hop in [h.strip() for h in args.hops.split(",") if h.strip()]:
        items = load_workload("rag_multihop", tokenizer=target.tokenizer, n=args.n, chunks=args.chunks,
                              chunk_tokens=args.chunk_tokens, hop=hop,
                              max_tokens=max(8192, args.chunks * args.chunk_tokens + 256))
        for i, item in enumerate(items):
            log(f"oracle {args.target} <- {args.spec} {hop}: item {i + 1}/{len(items)} ({item['n_tokens']} tokens)")
            t = prepare_target(target, item, kv_cache)
            for r in run_item(t, target, spec, selectors, ratios, kv_cache, kl=not args.no_kl):
                rows.append({"hop": hop, **r})
            kv_cache = {k: v for k, v in kv_cache.items() if k[0] != "signal"}  # signals are per item
            md = _write(Path(args.json), args, selectors, ratios, rows, started)
    print(md)  # (written after each item: a run stopped early keeps its rows)
    log(f"wrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0


def _main_served(args: argparse.Namespace) -> int:
    try:
        served = json.loads(Path(args.served).read_text())
    except (OSError, ValueError) as exc:
        log(f"--served: cannot read {args.served}: {exc}")
        return 2
    if served.get("benchmark") != "speccache_serve" or served.get("workload") != "rag_multihop":
        log(f"--served: {args.served} is not a bench.speccache_serve run of rag_multihop")
        return 2
    started = time.perf_counter()
    try:
        rows = served_rows(served, _load(served["pairs"][0][0]), {})  # the served target
    except ValueError as exc:
        log(f"--served: {exc}")
        return 2
    md = _write(Path(args.json), args, sorted({r["selector"] for r in rows}),
                sorted({r["ratio"] for r in rows}), rows, started)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
