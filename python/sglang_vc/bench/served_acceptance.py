"""``python -m sglang_vc.bench.served_acceptance --input PROMPTS.jsonl --json OUT``: the
acceptance length a VERICACHE server reaches at a fixed draft length on the same prompts
the lab measured (``bench.fidelity --input``), per prompt and pooled, beside the lab's
figure: the lab and the server must agree on what a drafter does.

The server drafts with its default drafter (SpeCache 2-bit; ``--vc-args`` for another),
compresses every request (``--vc-compress-when always``), greedy, EOS ignored, the prompt
encoded as the lab encodes it (its chat template). ``A`` is committed tokens per verify
round (accepted drafts plus the correction or bonus token), pooled over prompts as the lab
pools it. The lab counts rounds until ``N`` tokens are committed; the server's last round
may be cut by ``max_new_tokens``, so the two differ by at most one partial round per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests


def lab_acceptance(lab: dict, label: str, x: int) -> tuple[float, list[float]]:
    """Pooled and per-prompt A(x) of result ``label`` in a ``bench.fidelity`` report."""
    for r in lab["results"]:
        if r["label"] == label:
            per = [pp["rounds"][str(x)]["committed"] / pp["rounds"][str(x)]["rounds"] for pp in r["per_prompt"]]
            return r["acceptance_length"][str(x)], per
    raise KeyError(f"no result labelled {label!r} in the lab report (have: {[r['label'] for r in lab['results']]})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.served_acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="JSONL of {'prompt': ...} (bench.heldout writes one)")
    ap.add_argument("--n", type=int, default=None, help="first n prompts")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-len", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--vc-args", default="", help="extra server flags (e.g. another --vc-compressor)")
    ap.add_argument("--lab-json", default=None, help="a bench.fidelity report on the same prompts")
    ap.add_argument("--lab-label", default="specache@2b/nonspec", help="the lab result to compare with")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.draft_len < 1 or args.max_new_tokens < 2:
        ap.error("--draft-len >= 1 and --max-new-tokens >= 2")
    from transformers import AutoTokenizer

    from sglang_vc import models
    from sglang_vc.bench.fidelity_run import encode
    from sglang_vc.testing.server import ServerProcess

    model_dir = models.resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    items = [json.loads(line) for line in Path(args.input).read_text().splitlines() if line.strip()][: args.n]
    lab = json.loads(Path(args.lab_json).read_text()) if args.lab_json else None
    if lab is not None:
        try:
            lab_a, lab_per = lab_acceptance(lab, args.lab_label, args.draft_len)
        except KeyError as e:
            ap.error(str(e))
        if len(lab_per) != len(items):
            ap.error(f"--lab-json has {len(lab_per)} prompts, --input/--n gives {len(items)}")
    out_dir = Path(args.json).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--model-path", model_dir, "--dtype", "float32", "--speculative-algorithm", "VERICACHE",
             "--speculative-num-draft-tokens", str(args.draft_len), "--vc-compress-when", "always",
             *args.vc_args.split()]
    rows = []
    server = ServerProcess(flags, log_path=out_dir / (Path(args.json).stem + "-server.log"))
    try:
        for i, item in enumerate(items):
            ids = encode(tok, item["prompt"], chat=True)
            r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=7200)
            r.raise_for_status()
            meta = r.json()["meta_info"]
            vc = meta["sglang_vc_vericache"][0]
            row = {"prompt": i, "source": item.get("source"), "prompt_tokens": meta["prompt_tokens"],
                   "verify_rounds": vc["verify_rounds"], "committed": vc["committed"], "drafted": vc["drafted"],
                   "accepted": vc["accepted"], "acceptance": vc["committed"] / max(1, vc["verify_rounds"]),
                   "compression": meta.get("sglang_vc_compression")}
            rows.append(row)
            print(f"[served_acceptance] prompt {i} ({row['prompt_tokens']} tokens): A({args.draft_len}) = "
                  f"{row['acceptance']:.2f} over {row['verify_rounds']} rounds", file=sys.stderr)
        info = server.server_info().get("sglang_vc")
    finally:
        server.stop()
    served = sum(r["committed"] for r in rows) / max(1, sum(r["verify_rounds"] for r in rows))
    report = {"benchmark": "served_acceptance", "model": args.model, "draft_len": args.draft_len,
              "command": " ".join(["python -m sglang_vc.bench.served_acceptance", *(argv or sys.argv[1:])]),
              "settings": vars(args), "served_acceptance": served, "per_prompt": rows,
              "drafter": (info or {}).get("mechanisms", {}).get("vericache", {}).get("compressor")}
    if lab is not None:
        report.update(lab_acceptance=lab_a, lab_per_prompt=lab_per, served_over_lab=served / lab_a)
    Path(args.json).write_text(json.dumps(report, indent=2))
    msg = f"[served_acceptance] pooled A({args.draft_len}): served {served:.2f}"
    if lab is not None:
        msg += f", lab {lab_a:.2f} (served/lab {served / lab_a:.3f})"
    print(msg, file=sys.stderr)
    _plot(report, Path(args.json).with_suffix(".png"))
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_prompt"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in xs], [r["acceptance"] for r in rows], 0.4, label="served")
    if "lab_per_prompt" in report:
        ax.bar([i + 0.2 for i in xs], report["lab_per_prompt"], 0.4, label="lab")
    ax.set_xticks(list(xs), [Path(r["source"] or str(r["prompt"])).name for r in rows], fontsize=7)
    ax.set(ylabel=f"A({report['draft_len']})", title=f"{report['model']}: acceptance at X={report['draft_len']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
