"""``python -m sglang_vc.bench.serving --json OUT``: serving throughput and TTFT of the
embedded model under a few concurrency levels, for plain ``python -m sglang.launch_server``
and for ``python -m sglang_vc.launch_server`` in the same run.

The baseline is SGLang with none of sglang-vc's general plugin: ``SGLANG_PLUGINS`` admits
only the CPU platform (``sglang_vc_cpu``, without which SGLang does not run on a CPU; on a
CUDA machine it stands aside and SGLang's own platform serves). So the ratio covers all
that sglang-vc adds to a server that uses no mechanism: its launcher, routes and hooks.
``--baseline-plugins all`` loads the plugin in the baseline too (the launcher alone).

Both launchers get the same model and flags and the same prompts, and both servers are up
for the whole run (idle, a CPU server sleeps). Each measured run starts from an empty
radix cache (``/flush_cache``), so every run of a level does the same work. A repeat of a
level is an ABBA block -- one launcher, the other twice, the first again, the first
alternating between repeats -- whose ratio is the sum of one launcher's two runs over the
other's: the order, and a drift of the shared machine that is linear over the block
(measured here: the same launcher's throughput at concurrency 16 moved from 62 to 37 tok/s
between runs minutes apart), cancel. The report gives, per level, the median of the
repeats' throughput ratios with their spread, and the same for the servers' CPU seconds
per generated token (all their processes).

``--load-generator sglang`` sends the load with SGLang's own ``python -m
sglang.bench_serving --dataset-name random-ids`` (``make bench-deps`` installs the
``datasets`` package it imports) instead of this module's client, and ``--vc-args`` gives
flags to the sglang-vc server only: ``--vc-args "--speculative-algorithm VERICACHE"``
measures VERICACHE against the plain server where memory does not bind.

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
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from sglang_vc.bench import add_device_argument
from sglang_vc.testing.server import ServerProcess

LAUNCHERS = ("sglang", "sglang-vc")
# SGLANG_PLUGINS for the baseline: the CPU platform plugin only (SGLang's plugin whitelist)
PLATFORM_ONLY = "sglang_vc_cpu"


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


def run_level_sglang(url: str, model_dir: str, n: int, concurrency: int, prompt_tokens: int,
                     max_new_tokens: int) -> dict:
    """One level through ``python -m sglang.bench_serving`` (random token ids, fixed
    lengths, EOS ignored, greedy), in this module's row format."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.jsonl"
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
               "--tokenizer", model_dir, "--model", model_dir, "--dataset-name", "random-ids",
               "--num-prompts", str(n), "--random-input-len", str(prompt_tokens), "--random-output-len",
               str(max_new_tokens), "--random-range-ratio", "1", "--max-concurrency", str(concurrency),
               "--request-rate", "inf", "--seed", "1", "--disable-tqdm", "--output-file", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"sglang.bench_serving failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        r = json.loads(out.read_text().splitlines()[-1])
    if r["completed"] != n:
        raise RuntimeError(f"sglang.bench_serving completed {r['completed']} of {n} requests")
    return {
        "concurrency": concurrency,
        "requests": r["completed"],
        "elapsed_s": r["duration"],
        "request_throughput": r["request_throughput"],
        "output_token_throughput": r["output_throughput"],
        "total_token_throughput": (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"],
        "ttft_mean_s": r["mean_ttft_ms"] / 1e3,
        "ttft_p50_s": r["median_ttft_ms"] / 1e3,
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
                         marker="o", capsize=4, label=f"{label} (median, range of ABBA blocks)")
    for bound in (0.98, 1.02):
        axes[2].axhline(bound, color="grey", linestyle="--", linewidth=0.8)
    axes[0].set(xlabel="concurrent requests", ylabel="generated tokens/s", title="Throughput (mean of repeats)")
    axes[1].set(xlabel="concurrent requests", ylabel="CPU ms per generated token", title="Server CPU time")
    axes[2].set(xlabel="concurrent requests", ylabel="sglang-vc / sglang", title="Ratios per ABBA block")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    baseline = ("SGLang with the CPU platform plugin only" if report["settings"]["baseline_plugins"] == "platform"
                else "SGLang's launcher with sglang-vc's plugin")
    fig.suptitle(f"{report['model']} on {report['device']}: sglang = {baseline}, vs sglang-vc's launcher")
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


def flush_cache(server: ServerProcess) -> None:
    """Empty the server's radix cache (SGLang answers 200 once nothing is running)."""
    import requests

    for _ in range(60):
        if requests.post(server.url + "/flush_cache", timeout=30).status_code == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{server.url}/flush_cache kept failing: the server is not idle")


@dataclass(frozen=True)
class SglangLoad:
    """What SGLang's load generator needs beyond the run: the tokenizer and prompt length."""

    model_dir: str
    prompt_tokens: int


def measure(server: ServerProcess, prompts, level: int, max_new_tokens: int,
            sglang_load: SglangLoad | None = None) -> dict:
    """One timed run; with ``sglang_load`` sent by SGLang's own load generator."""
    flush_cache(server)
    cpu_before = cpu_seconds(server.proc.pid)
    if sglang_load is not None:
        row = run_level_sglang(server.url, sglang_load.model_dir, len(prompts), level,
                               sglang_load.prompt_tokens, max_new_tokens)
    else:
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


def find_py_spy() -> str | None:
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return spy if Path(spy).exists() else None


def profile_servers(servers: dict, prompts, level: int, max_new_tokens: int, seconds: int, spy: str) -> dict:
    """py-spy samples of every process of each server while it serves ``level``
    concurrent requests: total samples and the share with a ``sglang_vc`` frame."""
    import subprocess
    import tempfile

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
                if proc.wait() != 0 or not path.exists():  # reported, and the timed results kept
                    roles[role] = {"error": "py-spy could not sample it (it needs ptrace permission)"}
                    print(f"[serving] profile {name}: py-spy could not sample the {role}", file=sys.stderr)
                    continue
                roles[role] = _sample_shares(path)
        report[name] = roles
        print(f"[serving] profile {name}: " + ", ".join(
            f"{role} {r['sglang_vc_share']:.2%} of {r['samples']} samples in sglang_vc"
            for role, r in roles.items() if "error" not in r), file=sys.stderr)
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


def _block_ratio(vc_rows: list[dict], sg_rows: list[dict], key: str) -> float:
    """One ABBA block's ratio: the sum of sglang-vc's runs over the sum of sglang's."""
    return sum(r[key] for r in vc_rows) / sum(r[key] for r in sg_rows)


def _ratios(runs: dict, levels: list[int]) -> list[dict]:
    """``runs[launcher][repeat][level index]``: the list of that block's runs."""
    out = []
    for i, level in enumerate(levels):
        blocks = [(sg[i], vc[i]) for sg, vc in zip(runs["sglang"], runs["sglang-vc"])]
        tput = [_block_ratio(vc, sg, "output_token_throughput") for sg, vc in blocks]
        cpu = [_block_ratio(vc, sg, "cpu_s_per_output_token") for sg, vc in blocks]
        ttft = [_block_ratio(vc, sg, "ttft_mean_s") for sg, vc in blocks]
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
    add_device_argument(parser)
    parser.add_argument("--model", default="smollm2-135m", help="built-in alias or model folder")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per level (default: 4 waves of the level, at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="ABBA blocks per level (4 runs each)")
    parser.add_argument("--baseline-plugins", choices=("platform", "all"), default="platform",
                        help="the baseline's sglang-vc plugins: the CPU platform only (default), or all")
    parser.add_argument("--server-args", default="--dtype float32 --max-total-tokens 16384",
                        help="flags given to both launchers")
    parser.add_argument("--vc-args", default="",
                        help="flags given to the sglang-vc launcher only (e.g. \"--speculative-algorithm VERICACHE\")")
    parser.add_argument("--load-generator", choices=("own", "sglang"), default="own",
                        help="this module's client (default) or SGLang's python -m sglang.bench_serving "
                             "--dataset-name random-ids (needs `make bench-deps`)")
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
    spy = find_py_spy() if args.profile else None
    if args.profile and spy is None:
        parser.error("--profile needs py-spy (pip install py-spy)")

    if args.load_generator == "sglang":
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            parser.error("--load-generator sglang: sglang.bench_serving imports `datasets`; run `make bench-deps`")
    from sglang_vc import models

    try:
        model_dir = models.resolve(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = build_prompts(model_dir, max(per_level.values()), args.prompt_tokens)
    common = ["--model-path", model_dir, "--device", args.device, *args.server_args.split()]

    sglang_load = (SglangLoad(model_dir, args.prompt_tokens)
                   if args.load_generator == "sglang" else None)
    # runs[launcher][repeat][level index] = that ABBA block's two runs of the launcher
    runs: dict[str, list[list[list[dict]]]] = {
        name: [[[] for _ in levels] for _ in range(args.repeats)] for name in LAUNCHERS}
    baseline_env = {"SGLANG_PLUGINS": PLATFORM_ONLY} if args.baseline_plugins == "platform" else {}
    servers: dict[str, ServerProcess] = {}
    try:
        for launcher in LAUNCHERS:
            print(f"[serving] starting {launcher}", file=sys.stderr)
            extra = args.vc_args.split() if launcher == "sglang-vc" else []
            servers[launcher] = ServerProcess([*common, *extra], launcher=launcher,
                                              env=baseline_env if launcher == "sglang" else None)
            asyncio.run(run_level(servers[launcher].url, prompts[:2], 2, 4))  # warm-up, not measured
        if baseline_env and "sglang_vc" in servers["sglang"].server_info():
            sys.exit("python -m sglang_vc.bench.serving: error: the baseline loaded sglang-vc's plugin")
        for rep in range(args.repeats):
            first, second = LAUNCHERS if rep % 2 == 0 else LAUNCHERS[::-1]
            for i, level in enumerate(levels):
                for launcher in (first, second, second, first):
                    row = measure(servers[launcher], prompts[: per_level[level]], level, args.max_new_tokens,
                                  sglang_load)
                    runs[launcher][rep][i].append(row)
                    print(f"[serving] repeat {rep + 1}/{args.repeats} {launcher} c={level}: "
                          f"{row['output_token_throughput']:.1f} tok/s, TTFT {row['ttft_mean_s']:.3f}s, "
                          f"{row['cpu_s_per_output_token'] * 1e3:.1f} CPU ms/token", file=sys.stderr)
        profile = (profile_servers(servers, prompts, max(levels), args.max_new_tokens, args.profile, spy)
                   if args.profile else None)
        # what the sglang-vc server did (its mechanisms' counters: e.g. how many requests drafted)
        vc_info = servers["sglang-vc"].server_info().get("sglang_vc")
    finally:
        for server in servers.values():
            server.stop()

    def mean_rows(reps: list[list[list[dict]]]) -> list[dict]:
        out = []
        for i in range(len(levels)):
            rows = [row for rep in reps for row in rep[i]]
            out.append({k: statistics.mean(r[k] for r in rows) if isinstance(v, float) else v
                        for k, v in rows[0].items()})
        return out

    ratios = _ratios(runs, levels)
    report = {
        "benchmark": "serving",
        "model": args.model,
        "device": args.device,
        "command": " ".join(["python -m sglang_vc.bench.serving", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "results": {name: mean_rows(reps) for name, reps in runs.items()},
        "runs": runs,
        "wrapper_over_sglang": ratios,
        "profile": profile,
        "sglang_vc_server_info": vc_info,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for r in ratios:
        print(f"[serving] c={r['concurrency']}: throughput ratio {r['throughput_ratio_median']:.3f} "
              f"(blocks {r['throughput_ratio_min']:.3f}-{r['throughput_ratio_max']:.3f}), "
              f"CPU per token ratio {r['cpu_per_token_ratio_median']:.3f}, TTFT ratio {r['ttft_ratio_median']:.3f}",
              file=sys.stderr)
    print(f"[serving] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
