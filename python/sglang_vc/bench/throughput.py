"""``python -m sglang_vc.bench.throughput --json OUT``: long-context decoding throughput
of full KV, lossy compressed decoding and VERICACHE at the same device-KV budget.

Every configuration serves the same model with the same ``--max-total-tokens`` (the
device KV pool) and gets the same requests, all at once: long prompts and more of them
than the full-KV pool can batch. Servers run one after the other (a 2-core machine cannot
host two fairly). Per configuration the report has generated tokens/s and its ratio to
full KV, the achieved batch size (``sglang:num_running_reqs`` sampled from ``/metrics``),
mean acceptance length and bytes reloaded (VERICACHE), how many outputs equal the full-KV
outputs token for token, and the throughput appendix B.1 of the VeriCache paper predicts
for the measured parameters (acceptance length, memory bandwidth, weights and KV sizes).

``--schedule lockstep,staggered`` runs each VERICACHE configuration under each schedule;
the staggered runs also report verifies per iteration over time (from the server's
schedule trace) and the time of each iteration's draft and verify forwards, per drafting
request and per verified token: on a CPU a verify token costs compute that a GPU's
memory-bound iteration hides. ``--predict-gpu h100`` prints what appendix B.1 predicts on an H100 for
a 7-8B model at 32k context from the acceptance lengths measured here (a prediction,
not a measurement); with ``--from-json`` it reads them from an earlier report.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from pathlib import Path

import requests

from sglang_vc.bench import add_device_argument, decode_window, divergence, phases
from sglang_vc.bench.throughput_model import (GPUS, gpu_prediction, memory_bandwidth, model_sizes, predictions,
                                              print_gpu_prediction)
from sglang_vc.bench.long_prompts import build_prompts, shared_document_prompts
from sglang_vc.bench.throughput_configs import (FITS_CONFIGS, LONG, LONG_FITS, LONG_FITS_QUICK, LONG_QUICK,
                                                parse_config, with_schedules)
from sglang_vc.bench.throughput_plot import plot
from sglang_vc.testing.server import ServerProcess


def log(msg: str) -> None:
    print(f"[throughput] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- measuring


class RunningSampler:
    """Samples ``sglang:num_running_reqs`` from ``/metrics`` while a run is going."""

    PATTERN = re.compile(r"^sglang:num_running_reqs\{[^}]*\}\s+([0-9.eE+-]+)", re.M)

    def __init__(self, url: str, period: float = 0.25):
        self.url, self.period = url, period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            try:
                text = requests.get(self.url + "/metrics", timeout=5).text
                values = [float(v) for v in self.PATTERN.findall(text)]
                if values:
                    self.samples.append(sum(values))
            except requests.RequestException:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        busy = [s for s in self.samples if s > 0]
        return {
            "mean_running": statistics.mean(busy) if busy else 0.0,
            "max_running": max(busy) if busy else 0,
            "samples": len(self.samples),
        }


def generate(url: str, ids: list[int], max_new: int) -> dict:
    """One greedy request, streamed (EOS ignored): its output, SGLang's timestamps and the
    arrival of each chunk (:mod:`.decode_window`)."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start = time.perf_counter()
    stream = decode_window.stream_generate(url, ids, params)
    meta = stream.meta_info
    return {"output_ids": stream.output_ids, "latency_s": time.perf_counter() - start,
            "completion_tokens": meta["completion_tokens"], "finish_reason": meta["finish_reason"]["type"],
            "retractions": int(meta.get("num_retractions") or 0),
            "times": phases.RequestTimes.of(meta, stream.last), "stream": stream}


def prefill_into_cache(url: str, prompts: list[list[int]]) -> None:
    """Every prompt prefilled once (one new token each), so that the radix cache holds
    them and the measured run's requests all decode from their first iteration on."""
    params = {"temperature": 0, "max_new_tokens": 1}
    with ThreadPoolExecutor(len(prompts)) as pool:
        for r in pool.map(lambda ids: requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params},
                                                    timeout=7200), prompts):
            r.raise_for_status()


def counters(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]


def delta(after: dict, before: dict) -> dict:
    return {mech: {k: v - before.get(mech, {}).get(k, 0) for k, v in vals.items()}
            for mech, vals in after.items()}


def run_config(cfg: dict, common: list[str], prompts: list[list[int]], max_new: int, log_dir: Path,
               warm: bool = False) -> dict:
    """One configuration's server and run. ``warm``: the prompts are prefilled into the
    radix cache first, and the decode figure is the steady window's (every request
    decoding together, :mod:`.decode_window`); otherwise the decode phase's (:mod:`.phases`)."""
    log(f"{cfg['name']}: starting the server")
    trace = log_dir / f"{_slug(cfg['name'])}.trace.jsonl"
    server_log = log_dir / f"{_slug(cfg['name'])}.log"
    extra = ["--vc-schedule-trace", str(trace)] if cfg.get("schedule") == "staggered" else []
    with ServerProcess([*common, *cfg["flags"], *extra], log_path=server_log, timeout=600) as server:
        generate(server.url, prompts[0][:64], 4)  # warm-up
        if warm:
            log(f"{cfg['name']}: prefilling the {len(prompts)} prompts into the radix cache")
            prefill_into_cache(server.url, prompts)
        skip = len(trace.read_text().splitlines()) if extra else 0
        retractions_before = server_log.read_text().count("Retract requests")
        before = counters(server.url)
        log(f"{cfg['name']}: {len(prompts)} requests at once")
        with RunningSampler(server.url) as sampler, ThreadPoolExecutor(len(prompts)) as pool:
            start = time.perf_counter()
            outs = list(pool.map(lambda ids: generate(server.url, ids, max_new), prompts))
            elapsed = time.perf_counter() - start
        got = delta(counters(server.url), before)
        logged_retractions = server_log.read_text().count("Retract requests") - retractions_before
    generated = sum(o["completion_tokens"] for o in outs)
    split = phases.split([o["times"] for o in outs])
    window = decode_window.steady_window([o["stream"] for o in outs])
    row = {
        "config": cfg["name"], "kind": cfg["kind"], "schedule": cfg.get("schedule"), "elapsed_s": elapsed,
        "generated_tokens": generated, "tokens_per_s": generated / elapsed,
        "mean_latency_s": statistics.mean(o["latency_s"] for o in outs),
        **(split.as_dict() if split is not None else {"decode_tokens_per_s": None, "prefill_s": None}),
        "decode_measure": "decode phase",
        # requests SGLang retracted (and prefilled again): a row with any measures a prefill too
        "retracted": sum(o["retractions"] > 0 for o in outs), "retractions_logged": logged_retractions,
        "steady_window": window.as_dict() if window is not None else None,
        **sampler.summary(), "counters": got,
        "output_ids": [o["output_ids"] for o in outs],
        "finish_reasons": [o["finish_reason"] for o in outs],
    }
    if warm and window is not None:
        row["decode_phase_tokens_per_s"] = row["decode_tokens_per_s"]
        row["decode_tokens_per_s"], row["decode_measure"] = window.tokens_per_s, "steady window"
    vc = got.get("vericache", {})
    if cfg["kind"] == "vericache":
        row["mode_iterations"] = {m: vc.get(f"mode_iterations_{m.replace('-', '_')}", 0)
                                  for m in ("full", "in-pool", "offload")}
    if vc.get("verify_rounds"):
        row["mean_acceptance_length"] = vc["committed"] / vc["verify_rounds"]
        row["bytes_reloaded"] = vc.get("bytes_reloaded", 0)
        # the anchor X: fixed, or (auto) the mean of those the server chose
        row["draft_tokens"] = cfg["draft_tokens"] or round(vc["anchor_x_sum"] / max(1, vc.get("anchors", 0)))
        row["draft_len_mode"] = "fixed" if cfg["draft_tokens"] else "auto"
        row["drafted_per_verify"] = vc["drafted"] / vc["verify_rounds"]
    if extra:
        records = [json.loads(line) for line in trace.read_text().splitlines()[skip:]]
        row["trace"] = trace_summary(records)
        if window is not None:
            row["steady_window"].update(decode_window.iterations_in(records, window))
    elif window is not None:  # one token per request and iteration
        row["steady_window"].update(iterations=round(window.tokens / window.requests), mean_batch=window.requests)
    if split is None:
        log(f"{cfg['name']}: SGLang reported no prefill window; no decode-phase figure")
    log(f"{cfg['name']}: {row['tokens_per_s']:.1f} tok/s"
        + (f" ({row['decode_tokens_per_s']:.1f} decoding, prefill {row['prefill_s']:.0f} s)"
           if row["decode_tokens_per_s"] else "")
        + f", batch mean {row['mean_running']:.1f} "
        f"max {row['max_running']:.0f}" + (f", A={row['mean_acceptance_length']:.2f}"
                                           if "mean_acceptance_length" in row else ""))
    return row


def trace_summary(records: list[dict]) -> dict:
    """Per iteration of a staggered run: verifying, drafting, waiting and full-KV
    requests; and what the iteration's one forward costs (``phases.forward_s``, timed by
    the worker), split by a least-squares fit over the iterations into a fixed part, a
    cost per one-token request (drafting or full-KV) and a cost per verified token
    (drafts + 1 per verify)."""
    import numpy as np

    rows = []
    for rec in records:
        roles = [r["role"] for r in rec["requests"]]
        rows.append({"seconds": rec["seconds"], "verifies": roles.count("verify"),
                     "drafting": roles.count("draft"), "waiting": roles.count("wait"), "full": roles.count("full"),
                     "verify_tokens": sum((r["verified_drafts"] or 0) + 1 for r in rec["requests"]
                                          if r["role"] == "verify"),
                     "forward_s": rec.get("phases", {}).get("forward_s"),
                     "full_only": bool(roles) and all(r == "full" for r in roles),
                     "regressors": [rec.get("phases", {}).get(k) for k in ("tokens", "rows", "query_rows", "offload_drafts")]})
    busy = [r for r in rows if r["verifies"] + r["drafting"] + r["full"] > 0]

    def ratio(num, den):
        return num / den if den else None

    cost = {"fixed_s": None, "draft_s_per_request": None, "verify_s_per_token": None, "fit_iterations": 0}
    timed = [r for r in busy if r["forward_s"] is not None]
    a = np.array([[1.0, r["drafting"] + r["full"], r["verify_tokens"]] for r in timed]).reshape(-1, 3)
    if len(timed) >= 3 and np.linalg.matrix_rank(a) == 3:
        coef = np.linalg.lstsq(a, np.array([r["forward_s"] for r in timed]), rcond=None)[0]
        cost = {"fixed_s": float(coef[0]), "draft_s_per_request": float(coef[1]),
                "verify_s_per_token": float(coef[2]), "fit_iterations": len(timed)}
    return {
        "iterations": len(rows),
        "verifies_per_iteration": [r["verifies"] for r in rows],
        "drafting_per_iteration": [r["drafting"] for r in rows],
        "mean_verifies_per_iteration": ratio(sum(r["verifies"] for r in busy), len(busy)) or 0.0,
        "max_verifies_per_iteration": max((r["verifies"] for r in rows), default=0),
        "wait_steps": sum(r["waiting"] for r in rows),
        "full_kv_steps": sum(r["full"] for r in rows),
        "mean_iteration_s": ratio(sum(r["seconds"] for r in rows), len(rows)) or 0.0,
        "mean_forward_s": ratio(sum(r["forward_s"] for r in timed), len(timed)),
        "cost": cost,
        "row_costs": _row_costs(timed),
        # the policy's regressors per timed iteration: [forward_s, *regressors, full_only]
        "fit_rows": [[r["forward_s"], *r["regressors"], r["full_only"]] for r in timed if None not in r["regressors"]],
    }


def _row_costs(timed: list[dict]):
    """The mode policy's fit (:class:`sglang_vc.vericache.policy.ModePolicy`) over the
    run's iterations: seconds = fixed + token * query tokens + row * KV rows read + query_row
    * (queries x rows)
    + offload draft * offload drafters; None without the regressors."""
    from sglang_vc.vericache.draft_length import nonnegative_fit

    usable = [r for r in timed if None not in r["regressors"]]
    if len(usable) < 8:
        return None
    terms = nonnegative_fit([r["forward_s"] for r in usable], [tuple(r["regressors"]) for r in usable])
    if terms is None:
        return None
    return dict(zip(("fixed", "token", "row", "query_row", "offload_draft"), terms), fit_iterations=len(usable),
                full_kv_iterations=sum(bool(r.get("full_only")) for r in usable))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def context_prompt_tokens(model_dir: str, max_new: int) -> int:
    """The longest prompt the model's context holds with ``max_new`` tokens (and a few
    spare)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"]) - max_new - 16


def in_pool_predictions(rows: list[dict], cfgs: dict, ctx_tokens: int, prompt_tokens: int) -> dict:
    """:func:`sglang_vc.vericache.perf_model.in_pool_speedup` per VERICACHE run that drafted
    in place, from the policy's cost fit over that run's iterations and every full-KV
    iteration of the run's traced rows (the same machine and model: without them a run that
    drafts throughout cannot tell the fixed cost from the rows'), at its measured A and
    mean X: the model's ratio to full KV, to set beside the measured one. The request
    length is the mean over the decode (prompt + half the new tokens), the batch the
    steady window's (else every request)."""
    from sglang_vc.vericache.draft_view import DEFAULT_BUDGET
    from sglang_vc.vericache.perf_model import RowCosts, in_pool_speedup

    full_only = [f for row in rows for f in (row.get("trace") or {}).get("fit_rows", []) if f[-1]]
    out = {}
    for row in rows:
        trace = row.get("trace") or {}
        modes = row.get("mode_iterations") or {}
        if not trace.get("fit_rows") or not modes.get("in-pool") or not row.get("mean_acceptance_length"):
            continue
        own = trace["fit_rows"]
        pooled = own + [f for f in full_only if all(f is not g for g in own)]
        costs = _row_costs([{"forward_s": f[0], "regressors": f[1:5], "full_only": f[5]} for f in pooled])
        if costs is None:
            continue
        budget = cfgs[row["config"]].get("budget") or DEFAULT_BUDGET
        length = (prompt_tokens + ctx_tokens) // 2
        window = row.get("steady_window") or {}
        batch = round(window.get("mean_batch") or row.get("mean_running") or row.get("requests") or 1)
        # the A and X of the window the decode figure measures, where it had verifies
        a = window.get("acceptance") or row["mean_acceptance_length"]
        x = window.get("draft_len") if cfgs[row["config"]].get("draft_tokens") is None else None
        x = x or row["draft_tokens"]
        rc = RowCosts(costs["fixed"], costs["token"], costs["row"], costs["query_row"])
        out[row["config"]] = {
            "ratio_to_full": in_pool_speedup(rc, a, length, batch, x, budget),
            "costs": costs, "length": length, "batch": batch, "budget": budget, "draft_len": x,
            "acceptance": a, "acceptance_from": "steady window" if window.get("acceptance") else "run"}
    return out


def offload_predictions(rows: list[dict], ctx_tokens: int, prompt_tokens: int, full_batch: int) -> dict:
    """Per VERICACHE run that offloaded: the batch it held (per iteration, its mean full-KV
    and offloaded requests) priced by :func:`sglang_vc.vericache.perf_model.mix_tokens_per_s`
    at the run's fitted costs (full-KV iterations of every traced row pooled in, as above),
    over full-KV decoding of the ``full_batch`` requests the pool holds: the model's ratio
    to full KV, to set beside the measured one."""
    from sglang_vc.vericache.perf_model import RowCosts, mix_tokens_per_s

    full_only = [f for row in rows for f in (row.get("trace") or {}).get("fit_rows", []) if f[-1]]
    out = {}
    for row in rows:
        trace, modes = row.get("trace") or {}, row.get("mode_iterations") or {}
        if not trace.get("fit_rows") or not modes.get("offload") or not row.get("mean_acceptance_length"):
            continue
        own = trace["fit_rows"]
        pooled = own + [f for f in full_only if all(f is not g for g in own)]
        costs = _row_costs([{"forward_s": f[0], "regressors": f[1:5], "full_only": f[5]} for f in pooled])
        if costs is None:
            continue
        rc = RowCosts(costs["fixed"], costs["token"], costs["row"], costs["query_row"], costs["offload_draft"])
        iterations = max(1, trace["iterations"])
        n_full, n_off = (modes.get("full", 0) + modes.get("in-pool", 0)) / iterations, modes["offload"] / iterations
        length, a, x = (prompt_tokens + ctx_tokens) // 2, row["mean_acceptance_length"], row["draft_tokens"]
        mixed = mix_tokens_per_s(rc, a, x, length, n_full, n_off)
        out[row["config"]] = {"ratio_to_full": mixed / mix_tokens_per_s(rc, a, x, length, full_batch, 0),
                              "costs": costs, "full": n_full, "offloaded": n_off, "full_batch": full_batch,
                              "length": length, "draft_len": x, "acceptance": a}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.throughput",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="output JSON path (a PNG is written beside it)")
    add_device_argument(parser)
    parser.add_argument("--model", "--model-path", default="smollm2-135m", help="built-in alias or model folder")
    parser.add_argument("--configs", default="full,lossy:snapkv@0.25,vericache:snapkv@0.25:4,"
                        "vericache:streamingllm@0.25:4",
                        help="comma-separated: full | lossy:NAME@AMOUNT | vericache:NAME@AMOUNT[:X|:auto] | "
                        "specache[:Nbit[:kK]] (e.g. full,lossy:kivi@2bit,specache:2bit)")
    parser.add_argument("--schedule", default="lockstep,staggered",
                        help="VERICACHE schedules to run each vericache config under (comma-separated)")
    parser.add_argument("--quick", action="store_true",
                        help="8 requests of 2048 tokens, 32 new tokens: full, lossy and VERICACHE snapkv@0.25 "
                        "under both schedules (9 minutes measured on 2 CPU cores)")
    parser.add_argument("--long", action="store_true",
                        help=f"the regime VeriCache exists for: {LONG.describe()}; with --quick: "
                        f"{LONG_QUICK.describe()}")
    parser.add_argument("--fits", action="store_true",
                        help="a pool that holds every request's full KV; with --long (in-pool self-speculation's "
                        f"regime): {FITS_CONFIGS.replace(',', ', ')}; prompts as long as the model's context allows "
                        "with 128 new tokens (4,096 tokens with --quick)")
    parser.add_argument("--shared-document", type=int, default=0, metavar="TOKENS",
                        help="with --long --fits: one document of TOKENS tokens of real text with a different "
                        "question after it per request (the radix cache prefills it once), e.g. 16384 with "
                        "--model-path qwen2.5-coder-0.5b")
    parser.add_argument("--predict-gpu", choices=sorted(GPUS), default=None,
                        help="also print appendix B.1's prediction on this GPU from the measured A(x)")
    parser.add_argument("--from-json", default=None,
                        help="with --predict-gpu: read the measured A(x) from this report, run nothing")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="0: as long as the model's context allows with the new tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--full-kv-batch", type=int, default=4,
                        help="size the KV pool (--max-total-tokens) to hold this many full-KV requests")
    parser.add_argument("--server-args", default="--dtype float32", help="flags given to every server")
    parser.add_argument("--full-args", default=None,
                        help="flags given to the full-KV row's server only; with --shared-document by default "
                        "'--attention-backend vc_torch': SGLang's decode with an extend that attends only the new "
                        "queries (SGLang's torch_native extend attends the whole cached prefix again, hours at 16k "
                        "on a CPU), the full-KV path VERICACHE's own iterations run")
    args = parser.parse_args(argv)
    if args.from_json:
        if not args.predict_gpu:
            parser.error("--from-json needs --predict-gpu")
        try:
            rows = json.loads(Path(args.from_json).read_text())["results"]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--from-json {args.from_json}: not a throughput report ({exc})")
        pred = gpu_prediction(rows, args.predict_gpu)
        print_gpu_prediction(pred)
        report = json.loads(Path(args.from_json).read_text())
        report["gpu_prediction"] = pred
        Path(args.json).write_text(json.dumps(report, indent=2))
        return 0
    if args.long:
        mode = (LONG_FITS_QUICK if args.quick else LONG_FITS) if args.fits else (LONG_QUICK if args.quick else LONG)
        args.requests, args.prompt_tokens, args.max_new_tokens, args.full_kv_batch = (
            mode.requests, mode.prompt_tokens, mode.max_new_tokens, mode.full_kv_batch)
        if args.configs == parser.get_default("configs"):
            args.configs = mode.configs
        if args.schedule == parser.get_default("schedule"):
            args.schedule = mode.schedule
    elif args.quick:
        args.requests, args.prompt_tokens, args.max_new_tokens = 8, 2048, 32
        args.full_kv_batch = 3
        if args.configs == parser.get_default("configs"):
            args.configs = "full,lossy:snapkv@0.25,vericache:snapkv@0.25:4"
    if args.fits:  # the pool holds every request's full KV
        args.full_kv_batch = args.requests
    if args.shared_document and not (args.long and args.fits):
        parser.error("--shared-document needs --long --fits (the requests share one document in the pool)")
    if args.shared_document < 0:
        parser.error("--shared-document takes a token count")
    schedules = [x for x in args.schedule.split(",") if x]
    if not schedules or any(x not in ("lockstep", "staggered") for x in schedules):
        parser.error("--schedule takes lockstep and/or staggered")
    # --prompt-tokens 0 (the --long --fits preset): as long as the model's context allows
    if min(args.requests, args.max_new_tokens, args.full_kv_batch) <= 0 or args.prompt_tokens < 0:
        parser.error("--requests, --max-new-tokens and --full-kv-batch must be positive, --prompt-tokens >= 0")
    if args.full_kv_batch >= args.requests and not args.fits:
        parser.error("--full-kv-batch must be below --requests (full KV must not batch them all)")
    try:
        cfgs = [parse_config(c) for c in args.configs.split(",") if c]
    except ValueError as exc:
        parser.error(str(exc))
    if cfgs[0]["kind"] != "full":
        parser.error("--configs must start with full (the baseline)")
    try:
        cfgs = with_schedules(cfgs, schedules)
    except ValueError as exc:
        parser.error(str(exc))

    from sglang_vc import models

    try:
        model_dir = models.resolve(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if args.shared_document:
        prompts = shared_document_prompts(model_dir, args.requests, args.shared_document)
        if prompts is None:
            parser.error(f"not enough text on this machine for a {args.shared_document}-token document "
                         f"(or more than 12 requests)")
        args.prompt_tokens = max(len(p) for p in prompts)
        if args.prompt_tokens + args.max_new_tokens > context_prompt_tokens(model_dir, 0) + 16:
            parser.error(f"--shared-document {args.shared_document}: prompts of {args.prompt_tokens} tokens and "
                         f"{args.max_new_tokens} new ones exceed the model's context")
    else:
        if args.prompt_tokens == 0:
            args.prompt_tokens = context_prompt_tokens(model_dir, args.max_new_tokens)
        prompts = build_prompts(model_dir, args.requests, args.prompt_tokens)
        if prompts is None:
            parser.error(f"not enough text on this machine for {args.requests} prompts of {args.prompt_tokens} tokens")
    ctx = args.prompt_tokens + args.max_new_tokens
    if args.shared_document:  # the document's rows once, each request's question and new tokens
        budget = args.shared_document + sum(len(p) - args.shared_document + args.max_new_tokens for p in prompts) + 64
    else:
        budget = args.full_kv_batch * ctx + 64
    if args.fits:
        log(f"--fits: a KV pool of {budget} tokens holds every request's prompt and new tokens with 64 to spare; "
            "VERICACHE asks no drafting headroom beyond them (its drafts take the slots decoding takes, one an "
            "iteration, and never run past a request's last token: vericache/decode_slots.py)")
    common = ["--model-path", model_dir, "--device", args.device, "--enable-metrics",
              "--max-total-tokens", str(budget), "--max-running-requests", str(args.requests),
              *args.server_args.split()]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / (out.stem + "-logs")
    log_dir.mkdir(exist_ok=True)

    cfgs_by_name = {c["name"]: c for c in cfgs}
    rows = []
    full_args = args.full_args if args.full_args is not None else (
        "--attention-backend vc_torch" if args.shared_document else "")
    if full_args:
        log(f"the full-KV row's server also gets: {full_args}")
    for cfg in cfgs:  # --fits: prefilled first, so every row decodes the same requests from the same start
        if cfg["kind"] == "full" and full_args:
            cfg = {**cfg, "flags": [*cfg["flags"], *full_args.split()]}
        rows.append(run_config(cfg, common, prompts, args.max_new_tokens, log_dir, warm=args.fits))
    base = rows[0]
    for row in rows:
        row["ratio_to_full"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["decode_ratio_to_full"] = (row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                                       if row["decode_tokens_per_s"] and base["decode_tokens_per_s"] else None)
        row["prefill_ratio_to_full"] = (row["prefill_s"] / base["prefill_s"]
                                        if row["prefill_s"] and base["prefill_s"] else None)
        row["draft_len"] = row.get("draft_tokens")
        row["acceptance"] = row.get("mean_acceptance_length")
        # the same tokens (so the same length) and the same finish reason
        row["identical_to_full"] = sum(a == b for a, b in zip(zip(row["output_ids"], row["finish_reasons"]),
                                                              zip(base["output_ids"], base["finish_reasons"])))
        row["identical"] = row["identical_to_full"]
        found = [] if row is base else divergence.classify(model_dir, prompts, base["output_ids"], row["output_ids"])
        row["divergences"] = [dataclasses.asdict(d) for d in found]
        row["near_ties"] = sum(d.kind == "near-tie" for d in found)
        row["invalid_because"] = ((["retraction"] if row["retracted"] or row["retractions_logged"] else [])
                                  + (["wrong token"] if any(d.fails for d in found) else []))
        row["valid"] = not row["invalid_because"]
        row["requests"] = len(row["output_ids"])
        row["batch_mean"], row["batch_max"] = row["mean_running"], row["max_running"]
        row["kept"] = cfgs_by_name[row["config"]].get("kept")
    weights, kv_per_token = model_sizes(model_dir)
    bw = memory_bandwidth()
    pred = predictions(rows, cfgs_by_name, weights=weights, kv_per_token=kv_per_token,
                       budget_tokens=budget, ctx_tokens=ctx, bw=bw)
    in_pool_pred = in_pool_predictions(rows, cfgs_by_name, ctx, args.prompt_tokens)
    offload_pred = offload_predictions(rows, ctx, args.prompt_tokens, args.full_kv_batch)
    report = {
        "benchmark": "throughput",
        "model": args.model,
        "device": args.device,
        "command": " ".join(["python -m sglang_vc.bench.throughput", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {**vars(args), "max_total_tokens": budget, "server_flags": common[3:]},
        "measured_parameters": {"weights_bytes": weights, "kv_bytes_per_token": kv_per_token,
                                "kv_full_bytes_per_request": ctx * kv_per_token,
                                "memory_bandwidth_bytes_per_s": bw},
        "results": [{k: v for k, v in r.items() if k not in ("output_ids", "finish_reasons")} for r in rows],
        "appendix_b1_prediction": pred,
        "in_pool_prediction": in_pool_pred,
        "offload_prediction": offload_pred,
        "gpu_prediction": gpu_prediction(rows, args.predict_gpu) if args.predict_gpu else None,
        "definitions": {
            "tokens_per_s": "generated tokens of all requests / wall time from submitting them all to the last reply (prefill included)",
            "decode_tokens_per_s": "decode_measure 'steady window' (--fits: the prompts prefilled into the radix "
            "cache first): tokens the requests decoded from the moment the last had its first token to the moment "
            "the first finished, over that time (every request decoding, no prefill; steady_window); 'decode "
            "phase': tokens decoded while no prefill ran (all but each request's first) / that time: "
            "the span from the first forward to the last reply less the union of the requests' prefill windows "
            "(SGLang's forward_entry_time .. prefill_finished_time)",
            "retracted": "requests whose reply reports num_retractions > 0 (SGLang retracted and prefilled them "
            "again); retractions_logged: the server log's 'Retract requests' lines during the run",
            "divergences": "per request that differs from the full-KV row: the first differing position and its "
            "kind against a float32 HF reference (near-tie: top-2 gap below 1e-4 of the top logit; wrong-token: "
            "the row's token is not the reference's; baseline-off: the full-KV row's is not)",
            "valid": "no retraction and no wrong token: only a valid row compares like with like",
            "prefill_s": "the union of the requests' prefill windows: the same work in every configuration",
            "draft_len": "VERICACHE's anchored draft length X: fixed by the configuration, or (auto) the mean of "
            "the anchors the server chose from data",
            "acceptance": "VERICACHE's mean acceptance length A: committed tokens per verify",
            "mean_running": "mean of sglang:num_running_reqs over /metrics samples (every 0.25 s) while non-zero",
            "identical_to_full": "requests whose output_ids (so length) and finish reason equal the full-KV server's exactly",
            "appendix_b1_prediction": "perf_model.predict_from_hardware with the measured acceptance length, "
            "memory bandwidth as both BW_hbm and BW_inter, GPU_mem = weights + KV pool; memory-bound model",
        },
    }
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for r in report["results"]:
        p = pred.get(r["config"], {})
        dec = (f"  decode {r['decode_tokens_per_s']:6.2f} tok/s x{r['decode_ratio_to_full']:.2f}"
               if r.get("decode_ratio_to_full") else "")
        log(f"{r['config']:32s} {r['tokens_per_s']:7.1f} tok/s  x{r['ratio_to_full']:.2f}{dec}  "
            f"batch {r['mean_running']:.1f}/{r['max_running']:.0f}  identical {r['identical_to_full']}/{args.requests}"
            + (f" ({r['near_ties']} near-ties)" if r.get("near_ties") else "")
            + ("" if r["valid"] else f"  INVALID ({', '.join(r['invalid_because'])})")
            + (f"  A={r['mean_acceptance_length']:.2f}  B.1 predicts x{p['ratio_to_full']:.2f}"
               f" (x{p['at_measured_batch']['ratio_to_full']:.2f} at the measured batch)" if p.get("ratio_to_full") else ""))
    for r in report["results"]:
        w = r.get("steady_window")
        if w:
            log(f"{r['config']}: steady window {w['seconds']:.1f} s, {w['tokens']} tokens of {w['requests']} requests, "
                f"{w.get('iterations')} iterations of {w.get('mean_batch') or 0:.1f} requests; retracted "
                f"{r['retracted']}")
    for r in report["results"]:
        if r.get("trace"):
            t = r["trace"]
            log(f"{r['config']}: {t['mean_verifies_per_iteration']:.2f} verifies per iteration "
                f"(max {t['max_verifies_per_iteration']}), {t['wait_steps']} waits, "
                f"{t['full_kv_steps']} full-KV steps; forward cost fit over {t['cost']['fit_iterations']} "
                "iterations: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t["cost"].items()
                                            if k != "fit_iterations" and v is not None))
    for name, p in in_pool_pred.items():
        measured = next(r["decode_ratio_to_full"] for r in report["results"] if r["config"] == name)
        log(f"{name}: in-pool model predicts x{p['ratio_to_full']:.2f} full KV (A={p['acceptance']:.2f} "
            f"over the {p['acceptance_from']}, X={p['draft_len']}, budget {p['budget']}, {p['length']} tokens, "
            f"batch {p['batch']}; fitted over "
            f"{p['costs']['fit_iterations']} iterations, {p['costs']['full_kv_iterations']} of them full-KV), "
            "measured decode " + (f"x{measured:.2f}" if measured else "n/a"))
    for name, p in offload_pred.items():
        measured = next(r["decode_ratio_to_full"] for r in report["results"] if r["config"] == name)
        log(f"{name}: the offload model predicts x{p['ratio_to_full']:.2f} full KV ({p['full']:.1f} full-KV and "
            f"{p['offloaded']:.1f} offloaded requests an iteration against {p['full_batch']} at full KV; A="
            f"{p['acceptance']:.2f}, X={p['draft_len']}, offload draft {1e3 * p['costs']['offload_draft']:.1f} ms), "
            "measured decode " + (f"x{measured:.2f}" if measured else "n/a"))
    if report["gpu_prediction"]:
        print_gpu_prediction(report["gpu_prediction"])
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
