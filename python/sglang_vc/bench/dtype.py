"""``python -m sglang_vc.bench.dtype --json OUT``: which dtype to serve on this machine's
CPU. Per dtype (``float32``, ``bfloat16``, ``float16``), one server of the embedded model:

* **speed**: generated tokens per second at concurrency 1 and 8 (decode-dominated:
  128-token prompts, 64 new tokens, ``ignore_eos``), the same prompts for every dtype;
* **fidelity**: greedy agreement with HF transformers in float32 on the foundation test's
  prompts (4 passages of real text, 32 tokens each): tokens equal before the first
  divergence, out of those compared.

Dtypes alternate order in each repeat; the report gives each figure's mean and range
over repeats, each dtype's speed relative to float32, and the choice rule's answer:
the fastest dtype (geometric mean of the two concurrency levels) among float32 and
bfloat16, float16 only if it beats both. The launcher's CPU default
(``sglang_vc.launch_server``) is set from this benchmark's result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from pathlib import Path

from sglang_vc.testing.server import ServerProcess

DTYPES = ("float32", "bfloat16", "float16")
LEVELS = (1, 8)


def log(msg: str) -> None:
    print(f"[dtype] {msg}", file=sys.stderr, flush=True)


def agreement(server: ServerProcess, model_dir: str, prompts: list[list[int]], max_new: int) -> dict:
    from sglang_vc.testing.reference import compare, finish_type, greedy_reference

    matched = compared = 0
    first_divergence = []
    for ids in prompts:
        out = server.generate(input_ids=ids, max_new_tokens=max_new, ignore_eos=True)
        result = compare(greedy_reference(model_dir, ids, max_new), out["output_ids"], finish_type(out))
        matched += result.matched
        compared += max_new
        first_divergence.append(None if result.matched == max_new else result.matched)
    return {"matched": matched, "compared": compared, "first_divergence": first_divergence}


def choose(speed: dict[str, float]) -> str:
    """The rule of the module docstring, on geometric-mean tokens/s per dtype."""
    best = max((d for d in ("float32", "bfloat16") if d in speed), key=lambda d: speed[d])
    if "float16" in speed and speed["float16"] > speed[best]:
        return "float16"
    return best


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["results"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(LEVELS)
    for j, level in enumerate(LEVELS):
        means = [report["results"][d][f"tok_s_c{level}"]["mean"] for d in dtypes]
        lows = [m - report["results"][d][f"tok_s_c{level}"]["min"] for d, m in zip(dtypes, means)]
        highs = [report["results"][d][f"tok_s_c{level}"]["max"] - m for d, m in zip(dtypes, means)]
        ax.bar([i + j * width for i in range(len(dtypes))], means, width, yerr=[lows, highs], capsize=4,
               label=f"concurrency {level}")
    ax.set_xticks([i + width / 2 for i in range(len(dtypes))])
    ax.set_xticklabels([f"{d}\n{report['results'][d]['agreement']['matched']}/"
                        f"{report['results'][d]['agreement']['compared']} greedy tokens = HF fp32"
                        for d in dtypes], fontsize=8)
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{report['model']} on the CPU: serving dtype (choice: {report['choice']})")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from .serving import run_level

    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output JSON (a PNG is written beside it)")
    ap.add_argument("--model", default="smollm2-135m", help="built-in alias or model folder")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per dtype")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes: choose among {', '.join(DTYPES)}")
    if args.repeats <= 0 or args.requests <= 0 or args.prompt_tokens <= 0 or args.max_new_tokens <= 0:
        ap.error("--repeats, --requests, --prompt-tokens and --max-new-tokens must be positive")

    from transformers import AutoTokenizer

    from sglang_vc import models
    from sglang_vc.testing.text import real_text_passages

    model_dir = models.resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = real_text_passages(args.requests, words=args.prompt_tokens)
    prompts = [tok(t)["input_ids"][: args.prompt_tokens] for t in texts]
    fidelity_prompts = [tok(t)["input_ids"] for t in real_text_passages(4)]  # the foundation test's
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    speeds: dict[str, dict[int, list[float]]] = {d: {level: [] for level in LEVELS} for d in dtypes}
    agree: dict[str, dict] = {}
    for rep in range(args.repeats):
        order = dtypes if rep % 2 == 0 else dtypes[::-1]
        for dtype in order:
            log(f"repeat {rep + 1}/{args.repeats}: {dtype}")
            with ServerProcess(["--model-path", model_dir, "--dtype", dtype, "--max-total-tokens", "16384"],
                               log_path=out.parent / f"{out.stem}-{dtype}.log") as server:
                if dtype not in agree:
                    agree[dtype] = agreement(server, model_dir, fidelity_prompts, 32)
                for level in LEVELS:
                    row = asyncio.run(run_level(server.url, prompts, level, args.max_new_tokens))
                    speeds[dtype][level].append(row["output_token_throughput"])
                    log(f"  {dtype} c={level}: {row['output_token_throughput']:.1f} tok/s")

    def stats(values: list[float]) -> dict:
        return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "runs": values}

    geo = {d: math.sqrt(statistics.mean(speeds[d][1]) * statistics.mean(speeds[d][8])) for d in dtypes}
    results = {d: {**{f"tok_s_c{level}": stats(speeds[d][level]) for level in LEVELS},
                   "tok_s_geomean": geo[d], "agreement": agree[d],
                   **({"speed_vs_float32": geo[d] / geo["float32"]} if "float32" in geo else {})}
               for d in dtypes}
    report = {"benchmark": "dtype", "model": args.model,
              "command": " ".join(["python -m sglang_vc.bench.dtype", *(argv if argv is not None else sys.argv[1:])]),
              "settings": vars(args), "results": results, "choice": choose(geo)}
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for d in dtypes:
        r = results[d]
        log(f"{d}: c1 {r['tok_s_c1']['mean']:.1f} tok/s, c8 {r['tok_s_c8']['mean']:.1f} tok/s, "
            f"greedy {r['agreement']['matched']}/{r['agreement']['compared']} = HF float32")
    log(f"choice: {report['choice']}; wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
