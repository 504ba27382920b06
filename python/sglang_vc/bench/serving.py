"""``python -m sglang_vc.bench.serving --json OUT``: serving throughput and TTFT of the
embedded model under a few concurrency levels, for plain ``python -m sglang.launch_server``
and for ``python -m sglang_vc.launch_server`` in the same run.

Both launchers get the same model and flags and the same prompts. Both servers are up
for the whole run (idle, a CPU server sleeps), and each measurement is a pair: one level on
one launcher, then the same level on the other, the order alternating between repeats. A
pair's two runs are neighbours in time, so the drift of a shared machine (measured here:
the same launcher's throughput at concurrency 16 moved from 62 to 37 tok/s between
repeats minutes apart) affects both alike. The report gives, per level, the median of the
pairs' throughput ratios with their spread, and the same for the servers' CPU seconds per
generated token (all their processes; less sensitive to the machine's load than time).

``--profile`` then samples every process of each server with py-spy during one more run
at the highest level (outside the timed runs) and reports which share of the samples is
in sglang-vc's own code (``sglang_vc`` frames), per process: the wrapper's per-batch work.
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
import psutil

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

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for launcher in LAUNCHERS:
        rows = report["results"][launcher]
        levels = [r["concurrency"] for r in rows]
        axes[0].plot(levels, [r["output_token_throughput"] for r in rows], marker="o", label=launcher)
        axes[1].plot(levels, [r["cpu_s_per_output_token"] * 1e3 for r in rows], marker="o", label=launcher)
    ratios = report["wrapper_over_sglang"]
    levels = [r["concurrency"] for r in ratios]
    for key, label in (("throughput_ratio", "throughput"), ("cpu_per_token_ratio", "CPU per token")):
        per_repeat = [r[f"{key}_per_repeat"] for r in ratios]
        med = [r[f"{key}_median"] for r in ratios]
        axes[2].errorbar(levels, med, yerr=[[m - min(p) for m, p in zip(med, per_repeat)],
                                            [max(p) - m for m, p in zip(med, per_repeat)]],
                         marker="o", capsize=4, label=f"{label} (median, pair range)")
    for bound in (0.98, 1.02):
        axes[2].axhline(bound, color="grey", linestyle="--", linewidth=0.8)
    axes[0].set(xlabel="concurrent requests", ylabel="generated tokens/s", title="Throughput (mean of repeats)")
    axes[1].set(xlabel="concurrent requests", ylabel="CPU ms per generated token", title="Server CPU time")
    axes[2].set(xlabel="concurrent requests", ylabel="sglang-vc / sglang", title="Paired ratios")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['model']} on {report['device']}: sglang vs sglang-vc launcher")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants so far."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(server: ServerProcess, prompts, level: int, max_new_tokens: int) -> dict:
    cpu_before = cpu_seconds(server.proc.pid)
    row = asyncio.run(run_level(server.url, prompts, level, max_new_tokens))
    out_tokens = row["output_token_throughput"] * row["elapsed_s"]
    row["cpu_s_per_output_token"] = (cpu_seconds(server.proc.pid) - cpu_before) / out_tokens
    return row


def _role(cmdline: list[str]) -> str:
    joined = " ".join(cmdline)
    for role in ("scheduler", "detokenizer"):
        if f"sglang::{role}" in joined:
            return role
    return "launcher" if "launch_server" in joined else "other"


def profile_servers(servers: dict, prompts, level: int, max_new_tokens: int, seconds: int) -> dict:
    """py-spy samples of every process of each server while it serves ``level``
    concurrent requests: total samples and the share with a ``sglang_vc`` frame."""
    import shutil
    import subprocess
    import tempfile

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("python -m sglang_vc.bench.serving: error: --profile needs py-spy (pip install py-spy)")
    report = {}
    for name, server in servers.items():
        root = psutil.Process(server.proc.pid)
        procs = [p for p in [root, *root.children(recursive=True)] if _role(p.cmdline()) != "other"]
        with tempfile.TemporaryDirectory() as tmp:
            spies = [
                (_role(p.cmdline()), Path(tmp) / f"{p.pid}.txt",
                 subprocess.Popen([spy, "record", "-p", str(p.pid), "-d", str(seconds), "-r", "50", "-f", "raw",
                                   "--nonblocking", "-o", str(Path(tmp) / f"{p.pid}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                for p in procs
            ]
            time.sleep(1.0)  # py-spy attaches
            asyncio.run(run_level(server.url, prompts, level, max_new_tokens))
            roles = {}
            for role, path, proc in spies:
                if proc.wait() != 0 or not path.exists():
                    sys.exit(f"python -m sglang_vc.bench.serving: error: py-spy could not sample the {role} "
                             "(it needs ptrace permission)")
                roles[role] = _sample_shares(path)
        report[name] = roles
        print(f"[serving] profile {name}: " + ", ".join(
            f"{role} {r['sglang_vc_share']:.2%} of {r['samples']} samples in sglang_vc" for role, r in roles.items()),
            file=sys.stderr)
    return report


def _sample_shares(path: Path) -> dict:
    total, ours, functions = 0, 0, {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        # the launcher's own entry point (the root frames) is not per-batch work
        first = next((i for i, f in enumerate(frames) if "<frozen runpy>" not in f and "sglang_vc/" not in f), 0)
        frames = [f for f in frames[first:] if "sglang_vc/" in f]
        if frames:
            ours += n
            functions[frames[-1]] = functions.get(frames[-1], 0) + n
    top = sorted(functions.items(), key=lambda kv: -kv[1])[:5]
    return {"samples": total, "sglang_vc_samples": ours, "sglang_vc_share": ours / max(total, 1),
            "top_sglang_vc_frames": [{"frame": f, "samples": n} for f, n in top]}


def _ratios(runs: dict, levels: list[int]) -> list[dict]:
    out = []
    for i, level in enumerate(levels):
        pairs = list(zip(runs["sglang"], runs["sglang-vc"]))
        tput = [vc[i]["output_token_throughput"] / sg[i]["output_token_throughput"] for sg, vc in pairs]
        cpu = [vc[i]["cpu_s_per_output_token"] / sg[i]["cpu_s_per_output_token"] for sg, vc in pairs]
        ttft = [vc[i]["ttft_mean_s"] / sg[i]["ttft_mean_s"] for sg, vc in pairs]
        out.append({
            "concurrency": level,
            "throughput_ratio_median": statistics.median(tput),
            "throughput_ratio_per_repeat": tput,
            "throughput_ratio_min": min(tput),
            "throughput_ratio_max": max(tput),
            "cpu_per_token_ratio_median": statistics.median(cpu),
            "cpu_per_token_ratio_per_repeat": cpu,
            "ttft_ratio_median": statistics.median(ttft),
        })
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="output JSON path (a PNG is written beside it)")
    parser.add_argument("--model", default="smollm2-135m", help="built-in alias or model folder")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per level (default: 4 waves of the level, at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs per level")
    parser.add_argument("--server-args", default="--dtype float32 --max-total-tokens 16384",
                        help="flags given to both launchers")
    parser.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                        help="after the timed runs, sample each server with py-spy for this long")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        assert all(level > 0 for level in levels)
    except (ValueError, AssertionError):
        parser.error(f"--concurrency must be positive integers, got {args.concurrency!r}")
    per_level = {level: args.requests if args.requests is not None else max(16, 4 * level) for level in levels}
    if min(per_level.values()) <= 0 or args.prompt_tokens <= 0 or args.max_new_tokens <= 0 or args.repeats <= 0:
        parser.error("--requests, --prompt-tokens, --max-new-tokens and --repeats must be positive")
    if args.profile < 0:
        parser.error("--profile must be a number of seconds")

    from sglang_vc import models

    try:
        model_dir = models.resolve(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = build_prompts(model_dir, max(per_level.values()), args.prompt_tokens)
    common = ["--model-path", model_dir, "--device", "cpu", *args.server_args.split()]

    runs: dict[str, list[list[dict]]] = {name: [[] for _ in range(args.repeats)] for name in LAUNCHERS}
    servers: dict[str, ServerProcess] = {}
    try:
        for launcher in LAUNCHERS:
            print(f"[serving] starting {launcher}", file=sys.stderr)
            servers[launcher] = ServerProcess(common, launcher=launcher)
            asyncio.run(run_level(servers[launcher].url, prompts[:2], 2, 4))  # warm-up, not measured
        for rep in range(args.repeats):
            for level in levels:
                order = LAUNCHERS if rep % 2 == 0 else LAUNCHERS[::-1]
                for launcher in order:
                    row = measure(servers[launcher], prompts[: per_level[level]], level, args.max_new_tokens)
                    runs[launcher][rep].append(row)
                    print(f"[serving] repeat {rep + 1}/{args.repeats} {launcher} c={level}: "
                          f"{row['output_token_throughput']:.1f} tok/s, TTFT {row['ttft_mean_s']:.3f}s, "
                          f"{row['cpu_s_per_output_token'] * 1e3:.1f} CPU ms/token", file=sys.stderr)
        profile = (profile_servers(servers, prompts, max(levels), args.max_new_tokens, args.profile)
                   if args.profile else None)
    finally:
        for server in servers.values():
            server.stop()

    def mean_rows(reps: list[list[dict]]) -> list[dict]:
        return [
            {k: (statistics.mean(r[i][k] for r in reps) if isinstance(reps[0][i][k], float) else reps[0][i][k])
             for k in reps[0][i]}
            for i in range(len(levels))
        ]

    ratios = _ratios(runs, levels)
    report = {
        "benchmark": "serving",
        "model": args.model,
        "device": "cpu",
        "command": " ".join(["python -m sglang_vc.bench.serving", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "results": {name: mean_rows(reps) for name, reps in runs.items()},
        "runs": runs,
        "wrapper_over_sglang": ratios,
        "profile": profile,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for r in ratios:
        print(f"[serving] c={r['concurrency']}: throughput ratio {r['throughput_ratio_median']:.3f} "
              f"(pairs {r['throughput_ratio_min']:.3f}-{r['throughput_ratio_max']:.3f}), "
              f"CPU per token ratio {r['cpu_per_token_ratio_median']:.3f}, TTFT ratio {r['ttft_ratio_median']:.3f}",
              file=sys.stderr)
    print(f"[serving] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
