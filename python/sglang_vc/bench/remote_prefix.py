"""VeriCache's remote prefix caching on one machine: long prefixes stored in a shared
store, a *local* server on a fast emulated link to it and a *remote* server on a slow one
(``--vc-storage-read-gbps``), and the same requests answered five ways::

    python -m sglang_vc.bench.remote_prefix --quick --json OUT.json

* ``B1``    -- every request on the local server (full KV over the fast link);
* ``B2``    -- on the remote server, which loads the full KV over the slow link;
* ``lossy`` -- on the remote server, decoding from the KIVI 4-bit copy (c times the bytes);
* ``P1``    -- on the remote server (``VERICACHE_REMOTE``): it loads the compressed copy,
  drafts from it, and the local server verifies every round (paper section 5.3, path P1);
* ``P2``    -- as P1, while the context's full copy streams over the slow link to the
  remote server, which then decodes alone on the full KV (its requests retracted and
  re-prefilled after the context; path P2);
* ``tiering`` -- lossless tiering inside the remote server alone (``--vc-remote-path
  tiering``): each context's KIVI 4-bit copy is placed on its host tier before the phase
  (EvicPress's placement API), its full KV only in the store; a request drafts from the
  4-bit copy while the full copy loads over the slow link, then verifies the drafts
  against it and commits the accepted ones without decoding them again;
  ``tiering-wait`` is the same with no drafts (``--vc-tiering-drafts 0``): what drafting
  buys, measured against it.

A storer server computes the contexts first (its storage copies, full and KIVI 4-bit, go
to the store, SGLang's ``file`` backend in a temporary directory); every phase then
starts its servers fresh, registers the contexts (token ids only) and sends all requests
at once, streamed: TTFT is the client's time to the first chunk, throughput the output
tokens over the phase's wall time. ``identical`` compares each path's tokens, length and
finish reason with B1's (full KV). Bytes over each link are the servers' ``storage_link``
counters. The JSON has one entry per path in ``results``; a plot is written beside it.

On this machine both servers share the same CPU cores in P1 and P2 (the local server's
verify prefills run between the remote's draft forwards), so they pay for the verifier's
compute where two machines would not; the links are emulated (pacing after the bytes arrived).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import requests

PROG = "python -m sglang_vc.bench.remote_prefix"
KIVI4 = "kivi@4b"
OPTIONAL_PATHS = ("lossy", "P1", "P2", "tiering", "tiering-wait")


def log(msg: str) -> None:
    print(f"[remote_prefix] {msg}", file=sys.stderr, flush=True)


@dataclass
class Answer:
    output_ids: list
    finish_reason: Optional[str]
    ttft_s: float
    latency_s: float
    error: Optional[str] = None


@dataclass
class PathResult:
    path: str
    built: bool = True
    requests: int = 0
    ttft_mean_s: Optional[float] = None
    ttft_max_s: Optional[float] = None
    latency_mean_s: Optional[float] = None  # first byte sent to the last token
    tokens_per_s: Optional[float] = None
    wall_s: Optional[float] = None
    identical: Optional[bool] = None
    identical_requests: int = 0
    errors: int = 0
    slow_link_bytes: float = 0.0  # read by the remote server from the store
    fast_link_bytes: float = 0.0  # read by the local server from the store
    verify: dict = field(default_factory=dict)
    note: str = ""


def stream_generate(url: str, ids: list[int], max_new: int) -> Answer:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, last = None, None
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as r:
            if r.status_code != 200:
                return Answer([], None, float("nan"), time.perf_counter() - t0, f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    return Answer([], None, float("nan"), time.perf_counter() - t0, str(chunk["error"])[:200])
                if ttft is None and chunk.get("output_ids"):
                    ttft = time.perf_counter() - t0
                last = chunk
    except requests.RequestException as exc:
        return Answer([], None, float("nan"), time.perf_counter() - t0, str(exc)[:200])
    meta = (last or {}).get("meta_info", {})
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason == "abort":
        return Answer([], reason, float("nan"), time.perf_counter() - t0, str(meta.get("finish_reason"))[:200])
    return Answer(list((last or {}).get("output_ids") or []), reason, ttft if ttft is not None else float("nan"),
                  time.perf_counter() - t0)


def counters(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]


def link_bytes(c: dict) -> float:
    return float(c.get("storage_link", {}).get("read_bytes", 0.0))


def register(url: str, contexts: list[list[int]]) -> None:
    for i, ids in enumerate(contexts):
        r = requests.post(url + "/evicpress/contexts", json={"id": f"ctx{i}", "token_ids": ids}, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"registering ctx{i}: HTTP {r.status_code}: {r.text[:300]}")


def place(url: str, n: int, tier: str, config: str) -> None:
    for i in range(n):
        r = requests.post(url + f"/evicpress/contexts/ctx{i}/placement", json={"tier": tier, "config": config},
                          timeout=600)
        if r.status_code != 200 or not r.json().get("ok"):
            raise RuntimeError(f"placing ctx{i} on {tier} as {config}: HTTP {r.status_code}: {r.text[:300]}")


def build_requests(model_dir: str, n_contexts: int, ctx_tokens: int, per_context: int):
    """``n_contexts`` prefixes of ``ctx_tokens`` tokens cut from real text on the machine
    (the reading workload's token stream), each followed by ``per_context`` questions."""
    from transformers import AutoTokenizer

    from sglang_vc.bench.long_prompts import build_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    contexts = build_prompts(model_dir, n_contexts, ctx_tokens)
    if contexts is None:
        raise RuntimeError("not enough real text on this machine for the contexts")
    questions = ["\n\nQuestion: What is this text about?\nAnswer:", "\n\nSummarize the text above in one line:",
                 "\n\nThe key term defined above is", "\n\nList three facts stated above:\n1."]
    prompts = []
    for ctx in contexts:
        for q in questions[:per_context]:
            prompts.append(ctx + tok(q, add_special_tokens=False)["input_ids"])
    return contexts, prompts


def run_phase(name: str, url: str, prompts: list[list[int]], max_new: int) -> tuple[list[Answer], float]:
    log(f"{name}: {len(prompts)} requests at once")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: stream_generate(url, p, max_new), prompts))
    return answers, time.perf_counter() - t0


def summarize(name: str, answers: list[Answer], wall: float, ref: Optional[list[Answer]]) -> PathResult:
    ok = [a for a in answers if a.error is None]
    res = PathResult(path=name, requests=len(answers), errors=len(answers) - len(ok), wall_s=wall)
    if ok:
        res.ttft_mean_s = statistics.mean(a.ttft_s for a in ok)
        res.ttft_max_s = max(a.ttft_s for a in ok)
        res.latency_mean_s = statistics.mean(a.latency_s for a in ok)
    res.tokens_per_s = sum(len(a.output_ids) for a in ok) / wall
    if ref is not None:
        same = [a.error is None and b.error is None and a.output_ids == b.output_ids
                and a.finish_reason == b.finish_reason for a, b in zip(answers, ref)]
        res.identical_requests = sum(same)
        res.identical = all(same)
    for a in answers:
        if a.error:
            log(f"{name}: a request failed: {a.error}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="4 contexts of 1024 tokens, 2 questions each, 32 new tokens")
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=2, help="requests per context (1-4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fast-gbps", type=float, default=2.0, help="the local server's emulated link to the store")
    ap.add_argument("--slow-gbps", type=float, default=0.1, help="the remote server's emulated link to the store")
    ap.add_argument("--draft-tokens", type=int, default=4, help="X of the remote server's drafts")
    ap.add_argument("--tiering-drafts", type=int, default=32, help="--vc-tiering-drafts of the tiering path")
    ap.add_argument("--paths", default=",".join(OPTIONAL_PATHS),
                    help=f"the paths to run besides B1 (the reference) and B2 (the baseline): a comma list "
                    f"of {', '.join(OPTIONAL_PATHS)}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="vc_torch",
                    help="every server's attention backend (default vc_torch: on the CPU, SGLang's "
                    "torch_native pads each extend to the whole sequence, so a verify of X tokens over a "
                    "long cached prefix would cost a prefill; the project's subclass attends only the new "
                    "queries)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.context_tokens, args.questions, args.max_new_tokens = 4, 1024, 2, 32
    if not 1 <= args.questions <= 4 or args.contexts < 1 or args.context_tokens < 64 or args.max_new_tokens < 1:
        ap.error("--questions in 1..4, --contexts >= 1, --context-tokens >= 64, --max-new-tokens >= 1")
    if not (args.fast_gbps > 0 and args.slow_gbps > 0):
        ap.error("--fast-gbps and --slow-gbps must be > 0")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if any(p not in OPTIONAL_PATHS for p in paths):
        ap.error(f"--paths: choose from {', '.join(OPTIONAL_PATHS)}; got {args.paths!r}")
    if args.tiering_drafts < 0:
        ap.error("--tiering-drafts must be >= 0")

    from sglang_vc import models
    from sglang_vc.testing.server import ServerProcess

    model_dir = models.resolve(args.model)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / (out.stem + "-logs")
    logs.mkdir(exist_ok=True)
    contexts, prompts = build_requests(model_dir, args.contexts, args.context_tokens, args.questions)
    store = Path(tempfile.mkdtemp(prefix="vc-remote-prefix-"))
    pool_tokens = 2 * sum(len(p) + args.max_new_tokens for p in prompts) + 4096
    common = ["--model-path", model_dir, "--dtype", args.dtype, "--max-total-tokens", str(pool_tokens),
              "--attention-backend", args.attention_backend,
              "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
              "--hicache-mem-layout", "layer_first", "--radix-cache-backend", "evicpress",
              "--hicache-storage-backend", "file",
              "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(store)}),
              "--evicpress-no-profiler", "--evicpress-auto-context-tokens", "0"]
    local_flags = [*common, "--vc-storage-read-gbps", str(args.fast_gbps)]
    remote_flags = [*common, "--vc-storage-read-gbps", str(args.slow_gbps), "--evicpress-storage-copies", "none"]

    def server(name: str, flags: list[str]) -> ServerProcess:
        log(f"{name}: starting")
        return ServerProcess(flags, log_path=logs / f"{name}.log", timeout=900)

    results: list[PathResult] = []
    t_start = time.perf_counter()
    # the store: a storer computes every context once (its copies go to the store)
    with server("storer", common) as s:
        register(s.url, contexts)
        for ids in prompts[:: args.questions]:  # one request per context computes it
            requests.post(s.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                          timeout=3600).raise_for_status()
        stored = requests.get(s.url + "/evicpress/contexts", timeout=60).json()["contexts"]
        copies = [c["storage_copies"] for c in stored]
        if any(cp != ["full", KIVI4] for cp in copies):
            raise RuntimeError(f"the storer did not leave both copies: {copies}")

    # B1: all on the local server
    with server("local-B1", local_flags) as local:
        register(local.url, contexts)
        before = counters(local.url)
        ref, wall = run_phase("B1", local.url, prompts, args.max_new_tokens)
        b1 = summarize("B1", ref, wall, ref)
        b1.fast_link_bytes = link_bytes(counters(local.url)) - link_bytes(before)
        results.append(b1)
    if b1.errors:
        raise RuntimeError("B1 (the full-KV reference) had failed requests")

    # B2 and lossy: the remote server alone, full copy or the compressed one
    tiering = ["--evicpress-load-copy", KIVI4, "--speculative-algorithm", "VERICACHE_REMOTE",
               "--speculative-num-draft-tokens", str(args.draft_tokens), "--vc-remote-path", "tiering"]
    alone = [("B2", []), ("lossy", ["--evicpress-load-copy", KIVI4]),
             ("tiering", [*tiering, "--vc-tiering-drafts", str(args.tiering_drafts)]),
             ("tiering-wait", [*tiering, "--vc-tiering-drafts", "0"])]
    for name, extra in alone:
        if name != "B2" and name not in paths:
            continue
        with server(f"remote-{name}", [*remote_flags, *extra]) as remote:
            register(remote.url, contexts)
            if name.startswith("tiering"):
                place(remote.url, len(contexts), "host", KIVI4)  # before the phase: not timed
            before = counters(remote.url)
            answers, wall = run_phase(name, remote.url, prompts, args.max_new_tokens)
            res = summarize(name, answers, wall, ref)
            after = counters(remote.url)
            res.slow_link_bytes = link_bytes(after) - link_bytes(before)
            if name.startswith("tiering"):
                res.verify = {k: v - before.get("vericache_remote", {}).get(k, 0)
                              for k, v in after.get("vericache_remote", {}).items()}
            results.append(res)

    # P1 and P2: the remote drafts from the compressed copy, a fresh local server
    # verifies; on P2 the full copy streams to the remote meanwhile
    for name in [p for p in ("P1", "P2") if p in paths]:
        with server(f"local-{name}", local_flags) as local, server(f"remote-{name}", [
                *remote_flags, "--evicpress-load-copy", KIVI4, "--speculative-algorithm", "VERICACHE_REMOTE",
                "--speculative-num-draft-tokens", str(args.draft_tokens), "--vc-remote-verifier", local.url,
                "--vc-remote-path", name.lower()]) as remote:
            register(local.url, contexts)
            register(remote.url, contexts)
            before_l, before_r = counters(local.url), counters(remote.url)
            answers, wall = run_phase(name, remote.url, prompts, args.max_new_tokens)
            res = summarize(name, answers, wall, ref)
            after_r = counters(remote.url)
            res.slow_link_bytes = link_bytes(after_r) - link_bytes(before_r)
            res.fast_link_bytes = link_bytes(counters(local.url)) - link_bytes(before_l)
            rv = {k: v - before_r.get("vericache_remote", {}).get(k, 0)
                  for k, v in after_r.get("vericache_remote", {}).items()}
            if rv.get("verify_rounds"):
                rv["mean_committed_per_round"] = rv["committed"] / rv["verify_rounds"]
            res.verify = rv
            results.append(res)

    b2 = next(r for r in results if r.path == "B2")
    ratios = {}
    for r in results:
        if r.built and r.tokens_per_s and b2.tokens_per_s:
            ratios[r.path] = {"throughput_vs_B2": r.tokens_per_s / b2.tokens_per_s,
                              "ttft_B2_over_path": (b2.ttft_mean_s / r.ttft_mean_s) if r.ttft_mean_s else None}
    report = {
        "benchmark": "remote_prefix", "model": args.model, "device": "cpu",
        "command": " ".join([PROG, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {"contexts": args.contexts, "context_tokens": args.context_tokens, "questions": args.questions,
                     "requests": len(prompts), "max_new_tokens": args.max_new_tokens, "fast_gbps": args.fast_gbps,
                     "slow_gbps": args.slow_gbps, "link_ratio": args.fast_gbps / args.slow_gbps,
                     "draft_tokens": args.draft_tokens, "tiering_drafts": args.tiering_drafts,
                     "paths": ["B1", "B2", *paths], "dtype": args.dtype, "links": "emulated (paced reads)",
                     "attention_backend": args.attention_backend,
                     "cores": "local and remote servers share this machine's cores in P1 and P2"},
        "results": [asdict(r) for r in results], "ratios": ratios,
        "seconds": time.perf_counter() - t_start,
    }
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for r in results:
        if r.built:
            log(f"{r.path}: TTFT {r.ttft_mean_s:.3f} s, latency {r.latency_mean_s:.3f} s, "
                f"{r.tokens_per_s:.1f} tok/s, identical={r.identical} "
                f"({r.identical_requests}/{r.requests}), slow link {r.slow_link_bytes / 1e6:.1f} MB, "
                f"fast link {r.fast_link_bytes / 1e6:.1f} MB, errors {r.errors}")
        else:
            log(f"{r.path}: {r.note}")
    log(f"wrote {out} and {out.with_suffix('.png')}")
    failed = [r.path for r in results if r.built and (r.errors or (r.path != "lossy" and not r.identical))]
    if failed:
        log(f"FAILED: {failed} lost requests or differ from full KV")
        return 1
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["built"]]
    names = [r["path"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = ["tab:green" if r["identical"] else "tab:red" for r in rows]
    axes[0].bar(names, [r["ttft_mean_s"] or 0 for r in rows], color=colors)
    axes[0].set(ylabel="s", title="Mean TTFT (red: output differs from full KV)")
    axes[1].bar(names, [r["tokens_per_s"] or 0 for r in rows], color=colors)
    for x, r in enumerate(rows):
        ratio = report["ratios"].get(r["path"], {}).get("throughput_vs_B2")
        if ratio:
            axes[1].annotate(f"{ratio:.2f}x B2", (x, r["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    axes[1].set(ylabel="output tokens/s", title="End-to-end throughput")
    xs = range(len(rows))
    axes[2].bar([x - 0.2 for x in xs], [r["slow_link_bytes"] / 1e6 for r in rows], width=0.4, label="slow link (remote)")
    axes[2].bar([x + 0.2 for x in xs], [r["fast_link_bytes"] / 1e6 for r in rows], width=0.4, label="fast link (local)")
    axes[2].set_xticks(list(xs), names)
    axes[2].set(ylabel="MB read from the store", title="Bytes over each link")
    axes[2].legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"{report['model']}: {s['requests']} requests on {s['contexts']} x {s['context_tokens']}-token "
                 f"stored prefixes, {s['max_new_tokens']} new tokens; links {s['fast_gbps']} / {s['slow_gbps']} GB/s "
                 f"(emulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
