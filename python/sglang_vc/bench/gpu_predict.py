"""``python -m sglang_vc.bench.gpu_predict --gpu-step STEP.json [--gpu-step ...] --acceptance
DRAFTER=X:A ... --json OUT``: what VeriCache would give on the GPU that ran ``bench.gpu_step``,
for an 8B model at its context length, two ways, both labelled predictions:

* **B.1** (appendix B.1's best feasible point, ``perf_model.best_feasible``) with that
  GPU's *measured* bandwidths (full-KV decode attention's HBM rate, the pinned host link)
  instead of nominal ones: what the paper's bandwidth model promises;
* **measured costs**: the same operating point (batch, offloaded requests, ``x``) priced
  with the per-layer times ``gpu_step`` measured on that GPU for this project's own
  paths: the weights at the iteration's token count, each drafter's step per request,
  the verify window per request (SDPA's flash path over the prefix, the stand-in for the
  FlashInfer prefill SGLang runs; interpolated between the ``--gpu-step`` reports' draft
  lengths), and the reloads on the copy stream (overlapped, as measured). Where the two
  disagree, the difference is what this project's drafter or verify costs beyond the
  bandwidth model.

``--acceptance`` may give several draft lengths per drafter (its curve ``A(x)``): each is
priced, and the X with the best measured-cost ratio is the one chosen (as the server's
``draft_length`` chooses it from the curve it measures). Beside them, B.1 alone at nominal
figures for two settings the issue names: an 8B model at 32k on an H100 (PCIe 5, 64 GB/s),
and the paper's own example (a Mistral-24B-like model on a 96 GB RTX PRO 6000).

Full KV at the same memory is the baseline both ways (B.1's batch; its iteration priced
from the measured weights and full-KV decode attention). ``A`` is the acceptance length a
drafter reached at draft length ``X`` on real text (``bench.fidelity`` or a served run):
give the figure you measured; nothing is assumed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_vc.vericache import perf_model as pm

# gpu_step's drafter rows, and the kept fraction each stands for on the device
# (every token dropper keeps the same quarter, read by the same paged kernel)
DRAFTERS = {"snapkv": "draft_snapkv", "streamingllm": "draft_snapkv", "kvzip": "draft_snapkv",
            "kivi2": "draft_kivi2", "specache": "draft_specache"}
TOKEN_DROPPERS = {name for name, row in DRAFTERS.items() if row == "draft_snapkv"}
# the server's batched calls (what its worker runs on CUDA), where the report has them
BATCHED = {"kivi2": "draft_kivi2_batched", "specache": "draft_specache_batched"}


def draft_row(step: dict, drafter: str) -> str:
    """The report's row that prices ``drafter``'s step: the server's batched call where it
    was measured, else the per-request one (older reports)."""
    row = BATCHED.get(drafter)
    return row if row in step else DRAFTERS[drafter]


@dataclass
class Prediction:
    drafter: str
    draft_len: int
    accept_len: float
    compression: float
    batch_size: int
    offloaded: int
    b1_tokens_per_s: float
    b1_ratio_to_full: float
    measured_tokens_per_s: float
    measured_ratio_to_full: float
    measured_iter_ms: float
    draft_share: float  # of the measured iteration's compute
    binding: list[str]


def _weights_us(step: dict, tokens: float) -> float:
    """The layer's matrix products at ``tokens`` rows: linear through gpu_step's two points."""
    a, b = step["weights_decode"], step["weights_verify"]
    slope = (b["us"] - a["us"]) / max(1, b["tokens"] - a["tokens"])
    return max(a["us"], a["us"] + slope * (tokens - a["tokens"]))


# B.1 alone at nominal figures (GB = 1e9): an 8B model at 32k on an H100, and the paper's
# sec. 4.2.1 example (M = 50 GB, KV_full = 4 GB, a 96 GB GPU at ~1.71 TB/s, PCIe 5)
NOMINAL = {
    "h100_8b_32k": {"weights_bytes": 16e9, "kv_full_bytes": 2 * 32 * 8 * 128 * 2 * 32768, "hbm_bw": 3.35e12,
                    "interconnect_bw": 64e9, "gpu_mem_bytes": 80e9},
    "paper_mistral24b_rtx6000": {"weights_bytes": 50e9, "kv_full_bytes": 4e9, "hbm_bw": 60e9 / 0.035,
                                 "interconnect_bw": 64e9, "gpu_mem_bytes": 96e9},
}


def _verify_us(reports: list[dict], x: int) -> float:
    """One request's verify window at draft length ``x``: linear between the reports'
    draft lengths (flat beyond them); the flash path where the report has it."""
    pts = sorted((r["settings"]["draft_len"], r["per_layer"].get("verify_flash", r["per_layer"]["verify_sdpa"])["us"]
                  / r["settings"]["batch"]) for r in reports)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _kept(step: dict, settings: dict, kv_layer: float) -> dict[str, float]:
    payload = step["draft_kivi2"]["payload_bytes_per_req"] / kv_layer
    return {**{name: settings["keep"] for name in TOKEN_DROPPERS}, "kivi2": payload, "specache": payload}


def predict(reports: list[dict], curves: dict[str, dict[int, float]], gpu_mem_bytes: float) -> dict:
    """Every (drafter, x) of ``curves`` priced both ways; ``reports[0]`` gives every cost
    but the verify window, which comes from all of them by draft length."""
    report = reports[0]
    step, model, settings = report["per_layer"], report["model"], report["settings"]
    batch, n, layers = settings["batch"], settings["tokens"], model["layers"]
    weights_bytes = step["weights_decode"]["bytes"] * layers
    kv_full = 2 * n * model["kv_heads"] * model["head_dim"] * 2 * layers  # float16 K and V
    hbm_bw = step["full_decode_sdpa"]["gb_s"] * 1e9
    link_bw = step["reload_h2d"]["gb_s"] * 1e9
    kept = _kept(step, settings, kv_full / layers)

    base_b = pm.full_kv_batch(gpu_mem_bytes, weights_bytes, kv_full)
    base_b1 = pm.full_kv_from_hardware(weights_bytes=weights_bytes, kv_full_bytes=kv_full, hbm_bw=hbm_bw,
                                       gpu_mem_bytes=gpu_mem_bytes, batch_size=base_b)[0]
    decode_us = step["full_decode_sdpa"]["us"] / batch
    base_iter_us = layers * (_weights_us(step, base_b) + base_b * decode_us)
    base_measured = base_b / (base_iter_us * 1e-6)

    out = {"label": "PREDICTION from one layer's measured costs, not a served measurement",
           "device": report["device"], "gpu_mem_bytes": gpu_mem_bytes, "context_tokens": n,
           "weights_bytes": weights_bytes, "kv_full_bytes": kv_full, "hbm_bw": hbm_bw, "link_bw": link_bw,
           "verify_us_per_request": {x: _verify_us(reports, x) for x in sorted({x for c in curves.values() for x in c})},
           "full": {"batch_size": base_b, "b1_tokens_per_s": base_b1, "measured_tokens_per_s": base_measured},
           "predictions": [], "chosen": {}, "nominal_b1": {}}
    reload_us = step["reload_h2d"]["us"]  # one request's whole layer
    for drafter, curve in curves.items():
        c = kept[drafter]
        draft_us = step[draft_row(step, drafter)]["us"] / batch
        for x, a in sorted(curve.items()):
            reload_frac = 1 - c if drafter in TOKEN_DROPPERS else 1.0  # a quantizer's verify reloads every row
            best = pm.best_feasible(weights_bytes=weights_bytes, kv_full_bytes=kv_full, compression=c,
                                    acceptance={x: a}, hbm_bw=hbm_bw, interconnect_bw=link_bw,
                                    gpu_mem_bytes=gpu_mem_bytes, reload_fraction=reload_frac)
            b, b_c, b_g = best.batch_size, best.offloaded, best.on_device
            # staggered steady state: each offloaded request drafts x iterations and
            # verifies one; a request kept at full KV on the device decodes every iteration
            drafting, verifying = b_c * x / (x + 1), b_c / (x + 1)
            tokens = drafting + verifying * (x + 1) + b_g
            compute = (_weights_us(step, tokens) + drafting * draft_us + verifying * _verify_us(reports, x)
                       + b_g * decode_us)
            # the offloaded verifiers' reloads: only the dropped rows for a token-dropping drafter
            link = (b_c / (x + 1)) * reload_us * reload_frac
            iter_us = layers * max(compute, link)  # measured: a reload on the copy stream hides behind compute
            tps = (b_c * a / (x + 1) + b_g) / (iter_us * 1e-6)
            out["predictions"].append(asdict(Prediction(
                drafter, x, a, c, b, b_c, best.tokens_per_s, best.tokens_per_s / base_b1, tps, tps / base_measured,
                iter_us / 1e3, drafting * draft_us / compute, [v.value for v in best.binding])))
        mine = [p for p in out["predictions"] if p["drafter"] == drafter]
        out["chosen"][drafter] = {"measured_costs": max(mine, key=lambda p: p["measured_ratio_to_full"])["draft_len"],
                                  "b1": max(mine, key=lambda p: p["b1_ratio_to_full"])["draft_len"]}
        for name, hw in NOMINAL.items():
            o = pm.best_feasible(compression=c, acceptance=dict(curve),
                                 reload_fraction=None if drafter in TOKEN_DROPPERS else 1.0, **hw)
            out["nominal_b1"].setdefault(name, {})[drafter] = {
                "draft_len": o.draft_len, "accept_len": o.accept_len, "batch_size": o.batch_size,
                "offloaded": o.offloaded, "full_kv_batch": o.full_kv_batch, "ratio_to_full": o.ratio_to_full,
                "binding": [v.value for v in o.binding]}
    return out


def _acceptance(values: list[str], parser) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for v in values:
        try:
            name, rest = v.split("=")
            x, a = rest.split(":")
            x, a = int(x), float(a)
        except ValueError:
            parser.error(f"--acceptance takes DRAFTER=X:A (e.g. specache=30:26.3), got {v!r}")
        if name not in DRAFTERS:
            parser.error(f"--acceptance: drafter {name!r} is not one of {', '.join(DRAFTERS)}")
        if x < 1 or not 1 <= a <= x + 1:
            parser.error(f"--acceptance {v}: X >= 1 and 1 <= A <= X + 1")
        if x in out.get(name, {}):
            parser.error(f"--acceptance: {name} at X={x} given twice")
        out.setdefault(name, {})[x] = a
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.gpu_predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-step", required=True, action="append",
                        help="a bench.gpu_step JSON; repeat with reports at other --draft-len (same GPU and shapes) "
                             "to price the verify window at each X")
    parser.add_argument("--acceptance", action="append", required=True, metavar="DRAFTER=X:A",
                        help="repeat per drafter and draft length (a curve)")
    parser.add_argument("--gpu-mem-gb", type=float, default=None,
                        help="the GPU's memory (default: what gpu_step recorded)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    reports = []
    for path in args.gpu_step:
        try:
            report = json.loads(Path(path).read_text())
            report["per_layer"]["reload_h2d"], report["settings"]["draft_len"]
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--gpu-step {path}: not a bench.gpu_step report ({e})")
        reports.append(report)
    if len({(r["device"], r["settings"]["tokens"], r["settings"]["batch"]) for r in reports}) > 1:
        parser.error("--gpu-step: the reports differ in device, --tokens or --batch")
    mem = args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else reports[0].get("gpu_mem_bytes")
    if not mem or mem <= 0:
        parser.error("--gpu-mem-gb: the report does not record the GPU's memory; give it")
    out = predict(reports, _acceptance(args.acceptance, parser), mem)
    out["command"] = " ".join(["python -m sglang_vc.bench.gpu_predict", *(argv if argv is not None else sys.argv[1:])])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    full = out["full"]
    print(f"[gpu_predict] {out['label']}: {out['device']}, 8B at {out['context_tokens']} tokens; full KV batch "
          f"{full['batch_size']}: B.1 {full['b1_tokens_per_s']:.0f} tok/s, measured costs "
          f"{full['measured_tokens_per_s']:.0f} tok/s", file=sys.stderr)
    for p in out["predictions"]:
        mark = " <- chosen" if out["chosen"][p["drafter"]]["measured_costs"] == p["draft_len"] else ""
        print(f"[gpu_predict] {p['drafter']} X={p['draft_len']} A={p['accept_len']}: batch {p['batch_size']} "
              f"({p['offloaded']} offloaded): B.1 x{p['b1_ratio_to_full']:.2f}, measured costs "
              f"x{p['measured_ratio_to_full']:.2f} (drafting {p['draft_share']:.0%} of compute){mark}", file=sys.stderr)
    for name, rows in out["nominal_b1"].items():
        for drafter, o in rows.items():
            print(f"[gpu_predict] B.1 nominal, {name}: {drafter} at X={o['draft_len']} (A={o['accept_len']}): "
                  f"batch {o['batch_size']} vs {o['full_kv_batch']}, x{o['ratio_to_full']:.2f}", file=sys.stderr)
    _plot(out, path.with_suffix(".png"))


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, drafter in enumerate(out["chosen"]):
        pts = [p for p in out["predictions"] if p["drafter"] == drafter]
        xs = [p["draft_len"] for p in pts]
        ax.plot(xs, [p["b1_ratio_to_full"] for p in pts], "--o", color=f"C{i}", label=f"{drafter}: B.1, measured bandwidths")
        ax.plot(xs, [p["measured_ratio_to_full"] for p in pts], "-s", color=f"C{i}", label=f"{drafter}: measured costs")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="draft length X", ylabel="x full KV (same memory)", yscale="log",
           title=f"PREDICTION: VeriCache on {out['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
