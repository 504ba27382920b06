"""``python -m sglang_vc.bench.serving --json OUT``: serving throughput and TTFT of the
embedded model under a few concurrency levels, for plain ``python -m sglang.launch_server``
and for ``python -m sglang_vc.launch_server`` in the same run.

Both launchers get the same model and flags and the same prompts; they run one after the
other (a 2-core machine cannot host both fairly at once), alternating which goes first in
each repeat. The report gives the ratio of the wrapper to plain SGLang per concurrency
level: of the means over repeats, and per repeat (the spread: a repeat's two runs are
neighbours in time, so machine drift affects both alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from sglang_vc.testing.server import ServerProcess

LAUNCHERS = ("sglang", "sglang-vc")


async def _one_request(session, url, input_ids, max_new_tokens) -> dict:
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    last = None
    async with session.post(url + "/generate", json=payload) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(line[5:])
    return {
        "ttft_s": ttft,
        "latency_s": time.perf_counter() - start,
        "output_tokens": last["meta_info"]["completion_tokens"],
        "prompt_tokens": last["meta_info"]["prompt_tokens"],
    }


async def run_level(url: str, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> dict:
    queue = list(prompts)
    results = []

    async def worker(session):
        while queue:
            ids = queue.pop()
            results.append(await _one_request(session, url, ids, max_new_tokens))

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    out_tokens = sum(r["output_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "elapsed_s": elapsed,
        "request_throughput": len(results) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r["prompt_tokens"] for r in results)) / elapsed,
        "ttft_mean_s": statistics.mean(r["ttft_s"] for r in results),
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
    }


def build_prompts(model_dir: str, n: int, prompt_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from sglang_vc.bench.workloads import load_workload

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = load_workload("reading", tokenizer=model_dir, max_tokens=max(prompt_tokens, 1024), n=n)
    return [tok(item["prompt"])["input_ids"][:prompt_tokens] for item in items]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for launcher in LAUNCHERS:
        rows = report["results"][launcher]
        levels = [r["concurrency"] for r in rows]
        axes[0].plot(levels, [r["output_token_throughput"] for r in rows], marker="o", label=launcher)
        axes[1].plot(levels, [r["ttft_mean_s"] for r in rows], marker="o", label=launcher)
    axes[0].set(xlabel="concurrent requests", ylabel="generated tokens/s", title="Throughput")
    axes[1].set(xlabel="concurrent requests", ylabel="mean TTFT (s)", title="Time to first token")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['model']} on {report['device']}: sglang vs sglang-vc launcher")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="output JSON path (a PNG is written beside it)")
    parser.add_argument("--model", default="smollm2-135m", help="built-in alias or model folder")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per launcher")
    parser.add_argument("--server-args", default="--dtype float32 --max-total-tokens 16384",
                        help="flags given to both launchers")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        assert all(level > 0 for level in levels)
    except (ValueError, AssertionError):
        parser.error(f"--concurrency must be positive integers, got {args.concurrency!r}")
    if args.requests <= 0 or args.prompt_tokens <= 0 or args.max_new_tokens <= 0 or args.repeats <= 0:
        parser.error("--requests, --prompt-tokens, --max-new-tokens and --repeats must be positive")

    from sglang_vc import models

    try:
        model_dir = models.resolve(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = build_prompts(model_dir, args.requests, args.prompt_tokens)
    common = ["--model-path", model_dir, "--device", "cpu", *args.server_args.split()]

    runs: dict[str, list[list[dict]]] = {name: [] for name in LAUNCHERS}
    for rep in range(args.repeats):
        order = LAUNCHERS if rep % 2 == 0 else LAUNCHERS[::-1]
        for launcher in order:
            print(f"[serving] repeat {rep + 1}/{args.repeats}: starting {launcher}", file=sys.stderr)
            with ServerProcess(common, launcher=launcher) as server:
                rows = []
                for level in levels:
                    row = asyncio.run(run_level(server.url, prompts, level, args.max_new_tokens))
                    print(f"[serving]   {launcher} c={level}: {row['output_token_throughput']:.1f} tok/s, "
                          f"TTFT {row['ttft_mean_s']:.3f}s", file=sys.stderr)
                    rows.append(row)
                runs[launcher].append(rows)

    def mean_rows(reps: list[list[dict]]) -> list[dict]:
        return [
            {k: (statistics.mean(r[i][k] for r in reps) if isinstance(reps[0][i][k], float) else reps[0][i][k])
             for k in reps[0][i]}
            for i in range(len(levels))
        ]

    results = {name: mean_rows(reps) for name, reps in runs.items()}
    ratios = []
    for i, (level, base, vc) in enumerate(zip(levels, results["sglang"], results["sglang-vc"])):
        per_repeat = [b_vc[i]["output_token_throughput"] / b_sg[i]["output_token_throughput"]
                      for b_sg, b_vc in zip(runs["sglang"], runs["sglang-vc"])]
        ratios.append({
            "concurrency": level,
            "output_token_throughput_ratio": vc["output_token_throughput"] / base["output_token_throughput"],
            "throughput_ratio_per_repeat": per_repeat,
            "throughput_ratio_min": min(per_repeat),
            "throughput_ratio_max": max(per_repeat),
            "ttft_ratio": vc["ttft_mean_s"] / base["ttft_mean_s"],
        })
    report = {
        "benchmark": "serving",
        "model": args.model,
        "device": "cpu",
        "command": " ".join(["python -m sglang_vc.bench.serving", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "results": results,
        "runs": runs,
        "wrapper_over_sglang": ratios,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for r in ratios:
        print(f"[serving] c={r['concurrency']}: throughput ratio {r['output_token_throughput_ratio']:.3f} "
              f"(per repeat {r['throughput_ratio_min']:.3f}-{r['throughput_ratio_max']:.3f}), "
              f"TTFT ratio {r['ttft_ratio']:.3f}", file=sys.stderr)
    print(f"[serving] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
