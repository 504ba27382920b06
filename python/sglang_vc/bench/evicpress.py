"""EvicPress benchmark: TTFT vs quality of EvicPress and the fixed-compression frontier,
under a stream of requests at several arrival rates (paper fig. 7 and its request rates).

    python -m sglang_vc.bench.evicpress --regime h100-8b --json OUT.json [--quick]

One real server (``--radix-cache-backend evicpress`` with SGLang's hierarchical cache)
serves every system in turn, in the same runtime with the same tiers
(``POST /evicpress/reconfigure`` empties the tiers and switches the policy):

* ``evicpress:alpha=A`` -- the utility knapsack, for each alpha;
* ``fixed:CONFIG`` -- one compression config for every context + LRU, for every config the
  knapsack may choose (``--methods``: KIVI 2/4-bit and each token-dropping method at each
  ``--ratios``; token-dropped copies are served by the ``vc_torch`` attention backend);
* ``lru`` -- full KV, LRU demotion host -> disk -> dropped (the frontier's quality-1 end);
* ``full-prefill`` -- no reuse: every request in its own cache namespace. Its answers are
  the references.

Workload (:mod:`.evicpress_stream`): ``--contexts`` (>= 60) contexts of real text on the
machine -- documents, licences and package metadata with a quote to complete or a document
to name, source files with a function's return or callers -- each with its detail question
and two generic ones; a Zipf-popular stream of ``--requests`` questions over them, sent at
Poisson arrival times at each ``--rates`` (multiples of full prefill's capacity: one mean
context's prefill time, measured, per request), overlapping. TTFT counts from a request's
arrival; the tier that served it is read back by its rid. ``--regime h100-8b`` throttles
the tiers so that a token's load / prefill time is an H100 + 8B model's
(:mod:`.evicpress_regime`); the device tier then holds a fifth of the contexts' KV, the
host half, storage all of it.

Phases: (1) profiling, the server's own requests on the same server (each
``--profile-methods`` in turn; the last one's profiles serve; its time is reported per
served request); (2) each system: reconfigure, one unmeasured pass over the contexts
(initial placement), then the stream at each rate; quality = MiniLM-L6-v2 cosine of each
answer with full prefill's answer to the same prompt (section 6.1); (3) with
``--served-quality``, each fixed config's quality served from its stored copy, against
which each profiling method's error is measured (``profile_mae``); (4) with
``--drift-threshold``, re-profiling on drift measured.

Writes ``OUT.json`` (``results``: a row per system and rate; ``frontier``: per rate,
EvicPress's TTFT against the fixed frontier's at its quality; ``rates``: each system's
sustainable rate at the TTFT target; ``contexts``: the per-context table), ``OUT.png`` and
``OUT.profiles.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from .evicpress_quality import calibrate_likelihood, drift_phase, profile_mae, served_floor, served_quality
from .evicpress_regime import REGIMES, capacities
from .evicpress_report import (context_table, frontier_at_rate, loss_terms, plot, plot_profiles, rates_summary,
                               served_by_config)
from .evicpress_setup import KV_BYTES_PER_TOKEN, Profiles, Tiers, server_args, start
from .evicpress_stream import build_contexts, prompt_of, run_system, zipf_stream

# How the profiler gets its questions and scores them (--profile-methods): the two generic
# questions given at registration, or none given and the server builds --profile-queries
# questions from each context's own text (``--evicpress-profile-source context``); each
# config scored by its answer against the full-KV answer, or (``-likelihood``) by the
# cheaper proxy, the full-KV answer's likelihood over the config's KV; ``asked``: the three
# questions the stream asks of the context, what re-profiling on the queries a context
# was asked (paper section 4.3) converges to.
PROFILE_METHODS = ("generic", "context", "context-likelihood", "asked")


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.evicpress", description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--json", required=True, help="output JSON path (a PNG is written next to it)")
    a("--quick", action="store_true", help="small run (under 20 minutes on an idle 2-core CPU)")
    a("--model", default="smollm2-135m")
    a("--contexts", type=int, default=None, help="number of contexts (default and least 60; --quick 40, least 30)")
    a("--context-tokens", type=str, default=None,
      help="context length in tokens, or a comma-separated grid (default 1024,2048,3072,4096; --quick 256)")
    a("--methods", type=str, default="kivi,knorm,streamingllm",
      help="the knapsack's methods (--evicpress-methods); each config of them is a fixed baseline too")
    a("--ratios", type=str, default=None, help="kept fractions of the token-dropping methods (default 0.3,0.6; "
      "--quick 0.5)")
    a("--fixed", type=str, default=None, help="fixed baselines, comma-separated (default: every config of --methods)")
    a("--profile-queries", type=int, default=None, help="queries per context the profiler answers (default 4; "
      "--quick 1)")
    a("--profile-tokens", type=int, default=None,
      help="answer length when profiling (default --max-new-tokens: the answers a profile predicts)")
    a("--requests", type=int, default=None, help="measured requests per rate (default 100; --quick 16)")
    a("--rates", type=str, default="0.5,1,2",
      help="arrival rates, as multiples of full prefill's capacity (1 / one mean context's prefill time)")
    a("--ttft-target", type=float, default=None,
      help="TTFT target for the sustainable rate, seconds (default: twice one mean context's prefill time)")
    a("--zipf", type=float, default=1.1)
    a("--alphas", type=str, default=None, help="comma-separated EvicPress alphas (default 0.2,1,5; --quick 1)")
    a("--device-contexts", type=float, default=None, help="EvicPress device tier, in full contexts")
    a("--host-contexts", type=float, default=None, help="host tier size, in full contexts")
    a("--disk-contexts", type=float, default=None, help="disk tier size, in full contexts")
    a("--device-tokens", type=int, default=None, help="device KV pool (--max-total-tokens)")
    a("--max-new-tokens", type=int, default=None)
    a("--no-warm", action="store_true", help="skip the unmeasured placement pass")
    a("--seed", type=int, default=0)
    a("--served-quality", action="store_true",
      help="measure each fixed config's quality served from its stored copy: the profiles' error (slow)")
    a("--drift-threshold", type=float, default=None,
      help="after the systems, serve the stream once more under EvicPress (the smallest alpha) checking every "
      "compressed answer; contexts whose quality falls this far below their profile are re-profiled")
    a("--regime", choices=sorted(REGIMES), default=None,
      help="emulate a reference machine's tier / prefill cost ratios (bench/evicpress_regime.py)")
    a("--url", default=None, help="use a running server (started with matching flags)")
    a("--profile-methods", type=str, default="context",
      help="how contexts are profiled, comma-separated, each in turn: generic, context, context-likelihood or "
      "asked (see the module); the last one's profiles serve")
    a("--profiles-only", action="store_true", help="profile (and --served-quality) only: no systems")
    a("--reuse-profiles", action="store_true", help="start from the profiles saved in OUT.profiles.json")
    args = ap.parse_args(argv)
    _check(ap, args)
    return args


def _floats(ap, flag: str, text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated numbers, got {text!r}")
    if not out or any(not x > 0 for x in out):
        ap.error(f"{flag}: expected positive numbers, got {text!r}")
    return out


def _check(ap, args) -> None:
    """Validate the flags and fill the defaults --quick changes."""
    from sglang_vc.compress.registry import get_compressor, standalone_compressors
    from sglang_vc.evicpress.flags import validate_fixed

    q = args.quick
    args.contexts = args.contexts or (40 if q else 60)
    if args.contexts < (30 if q else 60):
        ap.error(f"--contexts must be >= {30 if q else 60}")
    args.lengths = tuple(int(x) for x in _floats(ap, "--context-tokens",
                                                  args.context_tokens or ("256" if q else "1024,2048,3072,4096")))
    args.ratio_list = _floats(ap, "--ratios", args.ratios or ("0.5" if q else "0.3,0.6"))
    args.rate_list = sorted(_floats(ap, "--rates", args.rates))
    args.alpha_list = _floats(ap, "--alphas", args.alphas or ("1" if q else "0.2,1,5"))
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.drops_tokens = False
    for m in args.method_list:
        if m not in standalone_compressors():
            ap.error(f"--methods: unknown method {m!r}")
        args.drops_tokens |= get_compressor(m).scenario == "token_dropping"
    default_fixed = [f"{m}@{b}b" for m in args.method_list if m == "kivi" for b in (4, 2)]
    default_fixed += [f"{m}@{r:g}" for m in args.method_list if m != "kivi" for r in args.ratio_list]
    args.fixed_list = [f.strip() for f in args.fixed.split(",") if f.strip()] if args.fixed else default_fixed
    for f in args.fixed_list:
        try:
            args.drops_tokens |= validate_fixed(f).drops_tokens
        except ValueError as exc:
            ap.error(f"--fixed {f}: {exc}")
    args.n_req = args.requests or (16 if q else 100)
    args.max_new = args.max_new_tokens or 12
    args.profile_new = args.profile_tokens or args.max_new
    args.n_queries = args.profile_queries or (1 if q else 4)
    args.method_order = [m.strip() for m in args.profile_methods.split(",") if m.strip()]
    for m in args.method_order:
        if m not in PROFILE_METHODS:
            ap.error(f"--profile-methods: unknown method {m!r} (choose from {', '.join(PROFILE_METHODS)})")
    if not args.method_order or len(set(args.method_order)) != len(args.method_order):
        ap.error("--profile-methods: give each method once")
    if args.regime and args.url:
        ap.error("--regime starts its own server (it measures the prefill rate, then throttles the tiers)")


def _tiers(args, contexts: list[dict]) -> Tiers:
    regime = REGIMES.get(args.regime)
    n = len(contexts)
    device = args.device_tokens or (4 * max(args.lengths) if regime is None else
                                    capacities(regime, sum(len(c["token_ids"]) for c in contexts))["device"])
    return Tiers(device_tokens=device,
                 host_contexts=args.host_contexts or (regime.host_share * n if regime else 5.0),
                 disk_contexts=args.disk_contexts or (2.0 * n if regime else 10.0),  # the regime's storage: unbounded
                 device_contexts=args.device_contexts)


def _systems(args) -> list[tuple[str, object]]:
    out = [("full-prefill", None)]
    out += [(f"evicpress:alpha={a:g}", {"policy": "evicpress", "alpha": a}) for a in args.alpha_list]
    out += [("lru", {"policy": "lru"})]
    return out + [(f"fixed:{f}", {"policy": "fixed", "fixed_config": f}) for f in args.fixed_list]


def _profile(cl, profiles: Profiles, methods: list[str], log) -> dict:
    """Each profiling method in turn; the last one's profiles stay registered and serve."""
    seconds = {}
    for method in methods:
        t0 = time.time()
        profiles.register(cl, method)
        profiles.wait(cl, method, log)
        seconds[method] = time.time() - t0
        log(f"profiled {len(profiles.by_method[method])} contexts ({method}) in {seconds[method]:.0f}s")
    return seconds


def _serve_all(cl, args, contexts, stream, rates: list[float], scorer, log) -> tuple[list, dict, dict]:
    """Every system under the stream at every rate: rows (a system and rate each, with the
    quality of the system's answers against full prefill's), records and server-side
    summaries."""
    rows, records, summaries, refs = [], {}, {}, {}
    for name, reconfig in _systems(args):
        log(f"system {name}")
        t1 = time.time()
        sys_rows, recs, summary = run_system(cl, name, reconfig, contexts, stream, rates, args.max_new,
                                             not args.no_warm, args.seed, log)
        answers = [r for r in recs if r["rate_per_s"] is None and "text" in r]
        if reconfig is None:
            for r in answers:
                refs.setdefault((r["ctx"], r["query"]), r["text"])
        ok = [r for r in answers if (r["ctx"], r["query"]) in refs]
        for r, sc in zip(ok, scorer.score_many([r["text"] for r in ok], [refs[(r["ctx"], r["query"])] for r in ok])):
            r["quality"] = sc
        qs = [r["quality"] for r in ok]
        summary.update(quality=sum(qs) / len(qs) if qs else None, seconds=time.time() - t1)
        for row in sys_rows:
            row["quality"] = summary["quality"]
        rows += sys_rows
        records[name], summaries[name] = recs, summary
        log(f"  -> quality {summary['quality']:.3f}, {summary['seconds']:.0f}s")
    return rows, records, summaries


def _quality_phase(cl, args, contexts, stream, profiles: Profiles, scorer, log) -> dict:
    """Each fixed config's served quality from its stored copy, and each profiling
    method's error against it (``--served-quality``); re-profiling on drift."""
    out: dict = {"served_quality": {}, "served_quality_records": [], "profile_mae": {}, "served_floor": {},
                 "likelihood_calibration": None, "drift": None}
    if args.served_quality:
        labels = {k for per in profiles.by_method.values() for q in per.values() for k in q}
        served, recs = served_quality(cl, contexts, [f for f in args.fixed_list if f in labels], args.max_new,
                                      scorer, log)
        out.update(served_quality=served, served_quality_records=recs, served_floor=served_floor(recs),
                   profile_mae=profile_mae(profiles.by_method, served))
        lik = profiles.by_method.get("context-likelihood")
        if lik:
            out["likelihood_calibration"] = cal = calibrate_likelihood(lik, served)
            out["profile_mae"]["context-likelihood (calibrated)"] = cal["profile_mae"]
        for m, row in out["profile_mae"].items():
            log(f"profile MAE ({m}): " + ", ".join(f"{k} {v['mae']:.3f} (bias {v['bias']:+.3f})"
                                                    for k, v in row.items() if isinstance(v, dict)))
    if args.drift_threshold is not None:
        method = args.method_order[-1]
        out["drift"] = drift_phase(cl, contexts, stream, args.max_new, min(args.alpha_list), args.drift_threshold,
                                   method, profiles.by_method[method], out["served_quality"], log)
    return out


def _report(args, contexts, rows, records, summaries, profiles: Profiles, profile_seconds: dict,
            target_s: float) -> dict:
    """The frontier per rate, the sustainable rates and the per-context table."""
    frontier = {f"{rate:g}": frontier_at_rate([r for r in rows if r["rate_per_s"] == rate and r["quality"] is not None
                                               and r["ttft_mean_s"] is not None])
                for rate in sorted({r["rate_per_s"] for r in rows})}
    alpha = 1.0 if 1.0 in args.alpha_list else args.alpha_list[0]
    system = f"evicpress:alpha={alpha:g}"
    table = context_table(contexts, records, profiles.by_method[args.method_order[-1]], system,
                          served_by_config(records))
    served = len(records.get(system, []))
    return {"frontier": frontier, "rates": rates_summary(rows, target_s),
            "contexts_table": {"system": system, "rows": table,
                               "loss_terms": loss_terms(table, sum(profile_seconds.values()), served)}}


def main(argv=None) -> int:
    args = parse_args(argv)
    out_json = Path(args.json)
    out_json.parent.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from sglang_vc import models
    from sglang_vc.evicpress.quality import EmbeddingScorer

    model_dir = models.resolve(args.model)
    t_start = time.time()
    log(f"building {args.contexts} contexts of ~{'/'.join(map(str, args.lengths))} tokens")
    contexts = build_contexts(model_dir, args.contexts, args.lengths, args.seed)
    stream = zipf_stream(len(contexts), args.n_req, args.zipf, args.seed)
    mean_tokens = sum(len(c["token_ids"]) for c in contexts) / len(contexts)
    tiers = _tiers(args, contexts)
    tmp = tempfile.TemporaryDirectory(prefix="evicpress-bench-")
    sargs = server_args(model_dir, tiers, KV_BYTES_PER_TOKEN * mean_tokens, str(Path(tmp.name) / "disk"),
                        args.method_list, ",".join(f"{r:g}" for r in args.ratio_list), args.n_queries,
                        args.profile_new, max(args.lengths), args.drops_tokens)
    profiles = Profiles(contexts, args.method_order, args.n_queries, args.profile_new,
                        out_json.with_suffix(".profiles.json"))
    if args.reuse_profiles:
        profiles.reuse(log)
    scorer = EmbeddingScorer()
    started = None
    rows, records, summaries = [], {}, {}
    try:
        started = start(sargs, out_json.with_suffix(".server.log"), [prompt_of(c, 1) for c in contexts[:3]],
                        REGIMES.get(args.regime), args.url, log)
        cl = started.client
        # rates in requests/s: multiples of full prefill's capacity, one mean context's prefill a request
        prefill_s = mean_tokens / started.prefill_tokens_per_s
        rates = [m / prefill_s for m in args.rate_list]
        target_s = args.ttft_target or 2 * prefill_s
        profile_seconds = _profile(cl, profiles, args.method_order, log)
        if not args.profiles_only:
            rows, records, summaries = _serve_all(cl, args, contexts, stream, rates, scorer, log)
        quality = _quality_phase(cl, args, contexts, stream, profiles, scorer, log)
        status = cl.api("GET", "/evicpress/status")
    except BaseException:
        # a benchmark never hides a failure: no restart, the server's log tail instead
        for s in (started.servers if started else []):
            log(f"benchmark failed; server log tail:\n{s.log_tail(40)}")
        raise
    finally:
        for s in (started.servers if started else []):
            s.stop()
        tmp.cleanup()
    report = _report(args, contexts, rows, records, summaries, profiles, profile_seconds, target_s) if rows else {}
    regime = REGIMES.get(args.regime)
    result = {
        "benchmark": "evicpress",
        "command": "python -m sglang_vc.bench.evicpress " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick, "model": args.model, "contexts": len(contexts),
        "context_tokens_mean": mean_tokens, "context_tokens_grid": list(args.lengths),
        "context_sources": sorted({c["source"] for c in contexts}),
        "methods": args.method_list, "fixed": args.fixed_list,
        "context_kv_bytes_mean": KV_BYTES_PER_TOKEN * mean_tokens,
        "requests_per_rate": args.n_req, "rates_per_s": rates if rows else [],
        "rates_x_full_prefill_capacity": args.rate_list, "one_context_prefill_s": prefill_s,
        "zipf_s": args.zipf, "max_new_tokens": args.max_new,
        "tiers": {**dataclasses.asdict(tiers), "measured": status["tiers"],
                  "prefill_tokens_per_s": status["prefill_tokens_per_s"],
                  "decompress_bytes_per_s": status["decompress_bytes_per_s"]},
        "prefill_tokens_per_s_measured": started.prefill_tokens_per_s,
        "profiles_reused": bool(args.reuse_profiles), "profile_methods": args.method_order,
        "profile_queries": args.n_queries, "profile_seconds": profile_seconds,
        "profiling_seconds": sum(profile_seconds.values()), "profiles": profiles.by_method,
        **quality, **report,
        "results": rows, "systems": summaries, "server_args": sargs,
        "regime": None if started.regime is None else {**dataclasses.asdict(started.regime),
                                                       "reference": dataclasses.asdict(regime)},
        "seconds": time.time() - t_start, "records": records,
    }
    out_json.write_text(json.dumps(result, indent=1))
    _plots(result, out_json, regime, log)
    _print_summary(result, log)
    return 0


def _plots(result: dict, out_json: Path, regime, log) -> None:
    pngs = []
    try:
        if result["results"]:
            pngs.append(out_json.with_suffix(".png"))
            plot(result["results"], result["rates"], pngs[-1],
                 None if regime is None else f"regime {regime.name}, emulated (nominal figures)")
        if result["served_quality"]:
            pngs.append(out_json.with_suffix(".profiles.png"))
            plot_profiles(result["profiles"], result["served_quality"], pngs[-1])
    except Exception as exc:  # pragma: no cover - plotting is optional
        log(f"no plot: {exc}")
    log(f"wrote {', '.join(str(p) for p in [out_json, *pngs] if p.exists())}")


def _print_summary(result: dict, log) -> None:
    for r in result["results"]:
        log(f"{r['system']:>24} {r['rate_per_s']:6.3f}/s  ttft {r['ttft_mean_s'] or float('nan'):.3f}s  "
            f"quality {r['quality'] if r['quality'] is not None else float('nan'):.3f}  "
            f"hits {json.dumps({k: round(v, 2) for k, v in r['hit_rate_by_tier'].items()})}"
            + (f"  ERRORS {r['errors']}" if r["errors"] else "") + (f"  RETRACTED {r['retracted']}" if r["retracted"] else ""))
    for rate, f in result.get("frontier", {}).items():
        for name, e in f["evicpress"].items():
            vs = "n/a" if e["ratio_vs_frontier"] is None else f"{e['ratio_vs_frontier']:.2f}x"
            log(f"at {float(rate):.3f}/s: {name} quality {e['quality']:.3f}: {vs} lower TTFT than the fixed frontier "
                f"({e['frontier_position']}), {e['ratio_vs_lru']:.2f}x than LRU at {e['quality_vs_lru']:+.3f} quality")
    if result.get("rates"):
        log(f"sustainable rate at mean TTFT <= {result['rates']['ttft_target_s']:.3f}s: " + ", ".join(
            f"{s} {v['rate_per_s']:.3f}/s{'' if not v['censored'] else ' (' + v['censored'] + ')'}"
            for s, v in result["rates"]["sustainable"].items()))
    for s, v in result.get("systems", {}).items():
        if v.get("server_failures"):
            log(f"SERVER FAILURES under {s}: {v['server_failures']:g}")


if __name__ == "__main__":
    sys.exit(main())
