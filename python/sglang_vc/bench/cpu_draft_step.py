"""``python -m sglang_vc.bench.cpu_draft_step --json OUT``: what one SpeCache draft step
costs the CPU per layer and request, against full-KV decode attention over the same
context, per context length; JSON and a plot.

On the CPU a draft pays off only when it is cheaper than the full-KV token it stands
for. The two calls of :mod:`sglang_vc.vericache.draft_probe` (the server's own price of
an offload drafter), on the same tensors (smollm2-135m's heads by default, float32).

The ratio is what the CPU draft step costs against the full-KV token it replaces; the
throughput benchmark's cost fit (``draft_s_per_request``) is the same cost over all layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_vc.bench.plots import plot_lines
from sglang_vc.vericache.draft_probe import step_times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.cpu_draft_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (smollm2-135m)")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--bits", type=int, default=2, choices=(1, 2, 4))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        hq, h, d = (int(x) for x in args.heads.split(","))
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--heads and --lengths are comma-separated integers, got {args.heads!r}, {args.lengths!r}")
    if hq % h or min(lengths) < 256:
        parser.error("query heads must be a multiple of KV heads, and every length at least 256")
    rows = []
    for n in lengths:
        rows.append(step_times(n, hq, h, d, args.topk, args.bits, args.repeats))
        r = rows[-1]
        print(f"[cpu_draft_step] {n} tokens: full-KV decode {r['full_ms']:.3f} ms, SpeCache draft step "
              f"{r['specache_ms']:.3f} ms (x{r['specache_x_full']:.2f}) per layer and request", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": torch.get_num_threads(), "heads": [hq, h, d], "topk": args.topk, "bits": args.bits,
              "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    xs = [r["tokens"] for r in rows]
    plot_lines({"full-KV decode (torch_native)": (xs, [r["full_ms"] for r in rows]),
                "SpeCache draft step": (xs, [r["specache_ms"] for r in rows])}, "context tokens",
               "ms per layer and request",
               f"One decode step on the CPU ({torch.get_num_threads()} threads, {args.bits}-bit drafts)",
               out.with_suffix(".png"),
               markers=True)
    print(f"[cpu_draft_step] wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
