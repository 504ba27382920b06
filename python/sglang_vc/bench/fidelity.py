"""Fidelity lab: how far does a lossy KV cache move a model, and how long would VeriCache's
drafts from it be accepted?

    python -m sglang_vc.bench.fidelity --model smollm2-135m --workload code,needle --n 4 \\
        --compressors all,kivi1:1 --compression-ratio 0.25 --kv-bits 2 \\
        --max-new-tokens 64 --draft-lengths 1,4,10,16,30,40 --json benchmark/results/fidelity.json

Offline, HF transformers, pure torch (no SGLang server). This module is the command line
(prompts, ``--set`` workload options, JSON report, plots, summary table); the measurement,
its steps and definitions, is :mod:`sglang_vc.bench.fidelity_run`.

In-pool draft views (MagicDec / SparseSpec style, :mod:`sglang_vc.bench.draft_views`) are
given to ``--compressors`` beside the compressors: ``window@B`` (sinks + sliding window) and
``reselect@B`` (PillarAttn-style re-selection at every verify), B = token budget.

Prompts: ``--input`` text/JSONL, or ``--workload``, with the model's chat template unless
``--no-chat-template``.

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
from pathlib import Path
from typing import Any, Sequence

from .fidelity_run import (DEFAULT_RATIO, KVZIP_PROMPT, CompressorSpec, _log, encode, parse_compressors,
                           run_fidelity, run_prompt)

__all__ = [
    # the command line
    "build_parser", "main", "read_input", "workload_params", "plot_paths", "write_plots", "summary_table",
    # re-exported from fidelity_run: the lab's API, imported from here before the split
    "CompressorSpec", "encode", "parse_compressors", "run_fidelity", "run_prompt",
]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DRAFT_LENGTHS = (1, 4, 10, 16, 30, 40)


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
                    help="comma-separated compressor names, NAME:VALUE (or NAME@VALUE) for a per-method "
                         "ratio/bits, 'all' for every registered method not listed, and in-pool draft views "
                         "window@B / reselect@B (B = token budget; bench.draft_views) (default %(default)s)")
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
                "draft_view": "window@B / reselect@B (bench.draft_views): the full KV stays resident, each draft "
                              "query attends a view of B positions: window = 4 sinks + the last B-4, sliding with "
                              "the query; reselect = 4 sinks + last B/4 + top-scored rest, chosen per layer and kv "
                              "head at each round's start from the full-KV verify queries on committed tokens "
                              "(first round: the prompt's last query), plus the round's own positions; drafted "
                              "tokens' KV under the view, committed KV exact; kept_fraction = B / context at the "
                              "first decode step; kl/first divergence: the view teacher-forced as one endless round",
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
