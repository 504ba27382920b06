"""EvicPress benchmark: TTFT vs quality of EvicPress and its baselines (paper fig. 7).

    python -m sglang_vc.bench.evicpress --json OUT.json [--quick]

One real server (``--radix-cache-backend evicpress`` with SGLang's hierarchical cache)
serves every system in turn, so all of them run in the same runtime with the same
tiers (``POST /evicpress/reconfigure`` empties the tiers and switches the policy):

* ``evicpress:alpha=A`` -- the utility knapsack, for each alpha;
* ``lru`` -- eviction only: full KV, LRU demotion host -> disk -> dropped;
* ``fixed:kivi@4b``, ``fixed:kivi@2b`` -- one compression config for every context + LRU;
  ``--fixed knorm@0.5`` (any query-free token-dropping config) adds ``fixed:knorm@0.5``,
  served from the kept rows (the server then runs the ``vc_torch`` attention backend);
* ``full-prefill`` -- no reuse: every request in its own cache namespace, so its
  context is prefilled from scratch. Its answers are the full-KV references.

Workload: >= 30 contexts from real text on the machine (:mod:`.workloads` ``reading``
and ``code`` items: documents / source files; the item's question and two generic
questions make the stream), a Zipf-skewed stream of queries over them, and tiers sized
so the contexts do not all fit in the fast ones (device pool a few contexts, host tier
``--host-contexts`` full contexts, disk ``--disk-contexts``).

Phases: (1) for each ``--profile-methods`` in turn, register the contexts and let the
server's profiler measure each config's quality (the paper's offline phase, section
4.1): ``generic`` gives the two generic questions, ``asked`` the stream's three (what
re-profiling on the asked queries reaches), ``context`` lets the server build
``--profile-queries`` questions from each context's text, ``context-likelihood`` scores
those by the likelihood proxy; the last method's profiles serve; (2) for each system:
reconfigure, one unmeasured pass over all contexts (initial placement), then the
measured stream, one request at a time (TTFT = time to the first streamed token, client
side). Quality = MiniLM-L6-v2 cosine of each answer with the full-prefill answer to the
same prompt (section 6.1); the hit tier of each request is read from the server's
EvicPress counters; (3) the served quality of each profiled fixed config on every
context and its three questions, answered from the stored copy
(:func:`served_quality`), against which each method's profile error is measured
(``profile_mae``; the likelihood proxy's scale is fitted to it,
``likelihood_calibration``); (4) with ``--drift-threshold``, re-profiling on drift
measured (:func:`drift_phase`).

``--profiles-only`` runs phases (1) and (3) alone (the profiles' error, no systems).

Writes ``OUT.json`` (``{"results": [{"system", "ttft_mean_s", "quality", ...}],
"profile_mae": {...}, "served_floor": {...}, ...}``), ``OUT.png`` (TTFT vs quality) and
``OUT.profiles.png`` (profiled vs served quality per method).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .evicpress_client import TIERS, Client, tier_of
from .evicpress_regime import REGIMES, capacities, emulate, measure_prefill
from .evicpress_quality import (calibrate_likelihood, drift_phase, frontier, profile_mae, served_floor,
                                served_quality)

# How the profiler gets its questions and scores them (--profile-methods): the two generic
# questions given at registration, or none given and the server builds --profile-queries
# questions from each context's own text (``--evicpress-profile-source context``); each
# config scored by its answer against the full-KV answer, or (``-likelihood``) by the
# cheaper proxy, the full-KV answer's likelihood over the config's KV; ``asked``: the three
# questions the stream asks of the context, what re-profiling on the queries a context
# was asked (paper section 4.3) converges to.
PROFILE_METHODS = ("generic", "context", "context-likelihood", "asked")
GENERIC_QUESTIONS = (
    "Question: Summarize the text above in one sentence.",
    "Question: What is the main topic of the text above?",
)
KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M, float32: 2 * 30 layers * 3 heads * 64 * 4


def _fingerprint(context: dict, method: str, queries: int, answer_tokens: int) -> str:
    """What a saved profile was measured on: the context's tokens, its profile queries and
    the answer length (longer answers diverge more)."""
    asked = {"generic": context["profile"], "asked": [context["test"], *context["profile"]]}.get(
        method, [method, queries])
    return hashlib.sha256(json.dumps([context["token_ids"], asked, answer_tokens]).encode()).hexdigest()[:16]


def build_contexts(tokenizer_dir: str, n: int, lengths: tuple[int, ...], seed: int) -> list[dict]:
    """``n`` contexts (half reading, half code items, their lengths drawn from the
    ``lengths`` grid), each with its test question and the generic profiling questions,
    as token ids."""
    from transformers import AutoTokenizer

    from sglang_vc.bench.workloads import load_workload

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    n_read = n // 2
    budget = max(lengths) + 256
    items = list(load_workload("reading", tokenizer=tokenizer_dir, max_tokens=budget, n=n_read, seed=seed,
                               lengths=tuple(lengths)))
    items += list(load_workload("code", tokenizer=tokenizer_dir, max_tokens=budget, n=n - n_read, seed=seed,
                                lengths=tuple(lengths)))
    out = []
    for it in items:
        context = it["prompt"][: len(it["prompt"]) - len(it["question"])]
        ids = tok(context)["input_ids"]

        def suffix(q: str) -> list[int]:
            return tok(q + "\nAnswer:", add_special_tokens=False)["input_ids"]

        out.append({
            "id": it["id"],
            "source": it["task"],
            "token_ids": ids,
            "test": suffix(it["question"].rstrip()),
            "profile": [suffix(q) for q in GENERIC_QUESTIONS],
            "answer": it.get("answer"),
        })
    return out


def zipf_stream(n_ctx: int, n_req: int, s: float, seed: int) -> list[tuple[int, int]]:
    """(context index, query index) pairs; context popularity ~ 1 / rank**s, ranks
    shuffled so popularity is unrelated to context order. Query 0 is the workload's own
    question, 1-2 the generic ones (used by the stream too, as repeats of a context
    with other questions)."""
    rng = random.Random(seed)
    ranks = list(range(n_ctx))
    rng.shuffle(ranks)
    weights = [1.0 / (ranks[i] + 1) ** s for i in range(n_ctx)]
    ctxs = rng.choices(range(n_ctx), weights=weights, k=n_req)
    return [(c, rng.choice((0, 0, 1, 2))) for c in ctxs]


def run_system(cl: Client, name: str, contexts, stream, max_new: int, refs: dict, warm: bool,
               reconfig: Optional[dict], log) -> tuple[dict, list]:
    """Run the stream under one system; returns its row and per-request records."""
    start = cl.counters()
    if reconfig is not None:
        cl.api("POST", "/evicpress/reconfigure", reconfig)
    full_prefill = reconfig is None
    if warm and not full_prefill:
        for c in contexts:  # initial placement, not measured
            cl.stream(c["token_ids"] + c["profile"][0], 1)
    c0 = cl.counters()
    recs = []
    for i, (ci, qi) in enumerate(stream):
        c = contexts[ci]
        q = c["test"] if qi == 0 else c["profile"][qi - 1]
        before = cl.counters()
        ns = f"bench-nocache-{name}-{i}" if full_prefill else None
        ttft, text, meta = cl.stream(c["token_ids"] + q, max_new, extra_key=ns)
        after = cl.counters()
        key = (ci, qi)
        if full_prefill:
            refs.setdefault(key, text)
        recs.append({"ctx": c["id"], "query": qi, "ttft_s": ttft, "text": text,
                     "tier": "miss" if full_prefill else tier_of(before, after),
                     "cached_tokens": meta.get("cached_tokens", 0)})
        log(f"  {name} {i + 1}/{len(stream)} ttft={ttft:.3f}s tier={recs[-1]['tier']} cached={recs[-1]['cached_tokens']}")
    c1 = cl.counters()
    status = cl.api("GET", "/evicpress/status")
    row = {
        "system": name,
        "requests": len(recs),
        "ttft_mean_s": sum(r["ttft_s"] for r in recs) / len(recs),
        "ttft_p50_s": sorted(r["ttft_s"] for r in recs)[len(recs) // 2],
        "hit_rate_by_tier": {t: sum(r["tier"] == t for r in recs) / len(recs) for t in TIERS},
        "compressed_contexts": 0 if full_prefill else int(status["counters"].get("compressed_contexts", 0)),
        "stored_contexts": 0 if full_prefill else int(status["counters"].get("stored_contexts", 0)),
        "counters_delta": {k: c1.get(k, 0) - c0.get(k, 0) for k in sorted(set(c1) | set(c0))
                           if not k.endswith("_used_bytes") and c1.get(k, 0) != c0.get(k, 0)},
    }
    # stores or moves the server failed (warm pass included): never silent
    row["server_failures"] = sum(c1.get(k, 0) - start.get(k, 0) for k in FAILURE_COUNTERS)
    if row["server_failures"]:
        log(f"  WARNING: {name}: the server failed {row['server_failures']:g} stores, moves or lookups "
            "(its log has the tracebacks)")
    row["lookup_failures"] = c1.get("lookup_failures", 0) - start.get("lookup_failures", 0)
    if not full_prefill:
        row["placements"] = _placements(cl)
    return row, recs


# a failed lookup serves the request without EvicPress (a plain miss): counted as a failure
FAILURE_COUNTERS = ("deferred_failures", "put_errors", "lookup_failures")


def _placements(cl: Client) -> dict:
    out: dict = {}
    for c in cl.api("GET", "/evicpress/contexts")["contexts"]:
        p = c["placement"]
        key = "dropped" if p["tier"] is None else f"{p['config']}/{p['tier']}"
        out[key] = out.get(key, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.evicpress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output JSON path (a PNG is written next to it)")
    ap.add_argument("--quick", action="store_true", help="small run (a few minutes on an idle 2-core CPU)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, default=None, help="number of contexts (>= 30)")
    ap.add_argument("--context-tokens", type=str, default=None,
                    help="context length in tokens, or a comma-separated grid (mixed lengths, "
                    "e.g. 256,512,1024,2048: prefill cost then differs between contexts)")
    ap.add_argument("--methods", type=str, default="kivi",
                    help="EvicPress candidate methods (--evicpress-methods), e.g. kivi,knorm,streamingllm")
    ap.add_argument("--profile-queries", type=int, default=None,
                    help="queries per context the profiler answers (default 4; generic has 2)")
    ap.add_argument("--profile-tokens", type=int, default=None,
                    help="answer length when profiling (default --max-new-tokens: the answers a profile "
                    "predicts; shorter ones diverge less and over-rate a lossy config)")
    ap.add_argument("--device-contexts", type=float, default=None,
                    help="EvicPress device tier, in full contexts (default: the server's, a quarter of the pool)")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per system")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--alphas", type=str, default=None, help="comma-separated EvicPress alphas")
    ap.add_argument("--fixed", type=str, default="kivi@4b,kivi@2b",
                    help="fixed-compression baselines, comma-separated (kivi@4b, kivi@2b, knorm@0.5, ...)")
    ap.add_argument("--host-contexts", type=float, default=None, help="host tier size, in full contexts")
    ap.add_argument("--disk-contexts", type=float, default=None, help="disk tier size, in full contexts")
    ap.add_argument("--device-tokens", type=int, default=None, help="device KV pool (--max-total-tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--no-warm", action="store_true", help="skip the unmeasured placement pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift-threshold", type=float, default=None,
                    help="after the systems, serve the stream once more under EvicPress (the smallest "
                    "alpha) checking every compressed answer against the full-KV one; contexts whose "
                    "served quality falls this far below their profile are re-profiled on the queries "
                    "they were asked; the JSON's drift has the profile error before and after")
    ap.add_argument("--regime", choices=sorted(REGIMES), default=None,
                    help="emulate a reference machine's tier / prefill cost ratios (bench/evicpress_regime.py): "
                    "tiers throttled from this machine's measured prefill rate; device 1/5, host 1/2 of the KV")
    ap.add_argument("--url", default=None, help="use a running server (started with matching flags)")
    ap.add_argument("--profile-methods", type=str, default="context",
                    help="how contexts are profiled, comma-separated, each in turn: generic (two generic "
                    "questions given at registration, the earlier default), context (questions the server "
                    "builds from each context's text), context-likelihood (those, by the likelihood proxy) "
                    "or asked (the three questions the stream asks: what re-profiling on asked queries "
                    "reaches); the last one's profiles serve, every one's error against the served "
                    "quality is the JSON's profile_mae")
    ap.add_argument("--profiles-only", action="store_true",
                    help="measure the profiles' error only: profile, then the served quality of each "
                    "profiled fixed config (no systems, no frontier)")
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="start from the profiles an earlier run saved in OUT.profiles.json")
    args = ap.parse_args(argv)
    q = args.quick
    n_ctx = args.contexts or 30 if q else args.contexts or 48
    if n_ctx < 30:
        ap.error("--contexts must be >= 30")
    try:
        lengths = tuple(int(x) for x in (args.context_tokens or ("256" if q else "512")).split(","))
    except ValueError:
        ap.error(f"--context-tokens: expected integers, got {args.context_tokens!r}")
    length = max(lengths)
    n_req = args.requests or (30 if q else 150)
    alphas = [float(a) for a in (args.alphas or ("1" if q else "0.2,1,5")).split(",")]
    fixed = [f.strip() for f in args.fixed.split(",") if f.strip()]
    drops_tokens = False
    for f in fixed:
        from sglang_vc.evicpress.flags import validate_fixed

        try:
            drops_tokens |= validate_fixed(f).drops_tokens
        except ValueError as exc:
            ap.error(f"--fixed {f}: {exc}")
    regime = REGIMES[args.regime] if args.regime else None
    if regime is not None and args.url:
        ap.error("--regime starts its own server (it measures the prefill rate, then throttles the tiers)")
    host_ctx = args.host_contexts or (regime.host_share * n_ctx if regime else 5.0)
    disk_ctx = args.disk_contexts or (2.0 * n_ctx if regime else 10.0)  # (the regime's storage: unbounded)
    device_tokens = args.device_tokens or (8 * length if len(lengths) == 1 else 4 * length)
    from sglang_vc.compress.registry import get_compressor, standalone_compressors

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in standalone_compressors():
            ap.error(f"--methods: unknown method {m!r}")
        drops_tokens |= get_compressor(m).scenario == "token_dropping"
    max_new = args.max_new_tokens or (12 if q else 24)
    profile_new = args.profile_tokens or max_new
    profile_queries = args.profile_queries or 4
    profile_methods = [m.strip() for m in args.profile_methods.split(",") if m.strip()]
    for m in profile_methods:
        if m not in PROFILE_METHODS:
            ap.error(f"--profile-methods: unknown method {m!r} (choose from {', '.join(PROFILE_METHODS)})")
    if not profile_methods or len(set(profile_methods)) != len(profile_methods):
        ap.error("--profile-methods: give each method once")
    out_json = Path(args.json)
    out_json.parent.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from sglang_vc import models

    model_dir = models.resolve(args.model)
    t_start = time.time()
    log(f"building {n_ctx} contexts of ~{'/'.join(map(str, lengths))} tokens")
    contexts = build_contexts(model_dir, n_ctx, lengths, args.seed)
    stream = zipf_stream(n_ctx, n_req, args.zipf, args.seed)
    ctx_bytes = KV_BYTES_PER_TOKEN * sum(len(c["token_ids"]) for c in contexts) / len(contexts)
    if regime is not None and args.device_tokens is None:
        device_tokens = capacities(regime, sum(len(c["token_ids"]) for c in contexts))["device"]
    gb = 1 << 30
    tmp = tempfile.TemporaryDirectory(prefix="evicpress-bench-")
    server_args = [
        "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", str(device_tokens),
        "--enable-hierarchical-cache", "--hicache-ratio", str(max(2.0, 1.2 * host_ctx * ctx_bytes / KV_BYTES_PER_TOKEN / device_tokens)),
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--radix-cache-backend", "evicpress", "--sleep-on-idle",
        "--evicpress-disk-dir", os.path.join(tmp.name, "disk"),
        "--evicpress-host-size-gb", f"{host_ctx * ctx_bytes / gb:.6f}",
        "--evicpress-disk-size-gb", f"{disk_ctx * ctx_bytes / gb:.6f}",
        "--evicpress-methods", ",".join(methods), "--evicpress-bits", "2,4",
        "--evicpress-profile-queries", str(profile_queries),
        "--evicpress-profile-max-new-tokens", str(profile_new),
        "--evicpress-generate-queries", str(profile_queries), "--evicpress-profile-source", "context",
        "--evicpress-observe-rate", "0",
        "--evicpress-auto-context-tokens", "0", "--evicpress-idle-seconds", "0.2",
        # each system serves its own policy's copies only: with storage copies (a
        # multi-server feature, on by default) a fixed config would load the full or
        # 4-bit copy an earlier system left on the store
        "--evicpress-storage-copies", "none",
        "--chunked-prefill-size", str(max(1024, 2 * length)),
    ]
    if args.device_contexts is not None:
        server_args += ["--evicpress-device-size-gb", f"{args.device_contexts * ctx_bytes / gb:.6f}"]
    if drops_tokens:  # token-dropped contexts are served by the lossy attention backend
        server_args += ["--attention-backend", "vc_torch"]
    from sglang_vc.evicpress.quality import EmbeddingScorer
    from sglang_vc.testing.server import ServerProcess

    scorer = EmbeddingScorer()
    systems = [("full-prefill", None)]
    systems += [(f"evicpress:alpha={a:g}", {"policy": "evicpress", "alpha": a}) for a in alphas]
    systems += [("lru", {"policy": "lru"})]
    systems += [(f"fixed:{f}", {"policy": "fixed", "fixed_config": f}) for f in fixed]
    state: dict = {"server": None, "regime": None}
    profiles: dict = {m: {} for m in profile_methods}  # method -> context -> config -> quality
    prof_path = out_json.with_suffix(".profiles.json")
    fingerprints = {m: {c["id"]: _fingerprint(c, m, profile_queries, profile_new) for c in contexts} for m in profile_methods}
    if args.reuse_profiles and prof_path.exists():
        # The contexts are rebuilt from text on this machine, which can change (packages
        # installed...): a profile is reused only for the very same tokens and queries.
        saved = json.loads(prof_path.read_text())
        for m in profile_methods:
            for cid, entry in (saved.get(m) or {}).items():
                if isinstance(entry, dict) and entry.get("fingerprint") == fingerprints[m].get(cid):
                    profiles[m][cid] = entry["quality"]
            log(f"{m}: reusing {len(profiles[m])} saved profiles ({len(contexts) - len(profiles[m])} contexts "
                "differ from the saved ones or have none: profiled again)")
    refs: dict = {}
    rows, records = [], {}
    t_profile = 0.0

    def register(cl: Client, method: str) -> None:
        """(Re-)register the contexts for ``method``: its saved profiles are given with the
        registration, so only the rest is profiled."""
        metric = "likelihood" if method.endswith("-likelihood") else "answer"
        cl.api("POST", "/evicpress/reconfigure", {"profile_metric": metric})
        for c in contexts:
            cl.api("DELETE", f"/evicpress/contexts/{c['id']}", allow=(404,))
            body = {"id": c["id"], "token_ids": c["token_ids"]}
            if method == "generic":
                body["query_suffix_ids"] = c["profile"]
            elif method == "asked":
                body["query_suffix_ids"] = [c["test"], *c["profile"]]
            if c["id"] in profiles[method]:
                body["quality"] = profiles[method][c["id"]]
            cl.api("POST", "/evicpress/contexts", body)

    def start() -> Client:
        """Start the server (unless --url); with --regime, once to measure this machine's
        prefill rate, then again with the tiers throttled to the regime's ratios."""
        if args.url:
            return Client(args.url)
        log("starting the server: " + " ".join(server_args))
        state["server"] = ServerProcess(server_args, log_path=out_json.with_suffix(".server.log"), timeout=900)
        if regime is None:
            return Client(state["server"].url)
        rate = measure_prefill(Client(state["server"].url), [c["token_ids"] for c in contexts[:3]])
        state["regime"] = emulate(regime, rate, KV_BYTES_PER_TOKEN)
        log(f"regime {regime.name}: prefill {rate:.0f} tokens/s here; host {state['regime'].host_bytes_per_s / 1e6:.1f} "
            f"MB/s, disk {state['regime'].disk_bytes_per_s / 1e6:.1f} MB/s ({regime.source})")
        state["server"].stop()
        server_args.extend(state["regime"].server_flags())
        state["server"] = ServerProcess(server_args, log_path=out_json.with_suffix(".server.log"), timeout=900)
        return Client(state["server"].url)

    def save_profiles() -> None:
        prof_path.write_text(json.dumps({m: {cid: {"fingerprint": fingerprints[m][cid], "quality": q}
                                             for cid, q in per.items()} for m, per in profiles.items()}, indent=1))

    def profile_phase(cl: Client, method: str) -> None:
        while True:
            for c in cl.api("GET", "/evicpress/contexts")["contexts"]:
                if c["profiled"]:
                    profiles[method][c["id"]] = {k: v for k, v in c["quality"].items() if k != "full"}
            save_profiles()
            st = cl.api("GET", "/evicpress/status")
            if st["pending_profiles"] == 0:
                return
            log(f"profiling ({method}): {st['pending_profiles']} contexts left")
            time.sleep(5)

    ids = {c["id"]: i for i, c in enumerate(contexts)}
    try:
        cl = start()
        profile_seconds = {}
        for method in profile_methods:  # the last one's profiles stay registered and serve
            t0 = time.time()
            register(cl, method)
            profile_phase(cl, method)
            profile_seconds[method] = time.time() - t0
            log(f"profiled {len(profiles[method])} contexts ({method}) in {profile_seconds[method]:.0f}s")
        t_profile = sum(profile_seconds.values())
        for name, reconfig in ([] if args.profiles_only else systems):
            log(f"system {name}")
            t1 = time.time()
            row, recs = run_system(cl, name, contexts, stream, max_new, refs, not args.no_warm, reconfig, log)
            ref_texts = [refs[(ids[r["ctx"]], r["query"])] for r in recs]
            scores = scorer.score_many([r["text"] for r in recs], ref_texts)
            for r, sc in zip(recs, scores):
                r["quality"] = sc
            row["quality"] = sum(scores) / len(scores)
            row["seconds"] = time.time() - t1
            rows.append(row)
            records[name] = recs
            log(f"  -> ttft_mean={row['ttft_mean_s']:.3f}s quality={row['quality']:.3f} "
                f"tiers={row['hit_rate_by_tier']} compressed={row['compressed_contexts']}")
        # the fixed configs that were profiled too: their served quality is what a profile predicts
        candidate_labels = {k for per in profiles.values() for q in per.values() for k in q}
        served, served_records = served_quality(cl, contexts, [f for f in fixed if f in candidate_labels],
                                                max_new, scorer, log)
        maes = profile_mae(profiles, served)
        floor = served_floor(served_records)
        for cfg, f in floor.items():
            log(f"served quality of {cfg}: answers within a context spread {f['within_context_sd']:.3f} (sd); "
                f"a profile of the two generic questions measured exactly as served is off by "
                f"{f['generic_exact_mae']:.3f} (the floor without the test question)")
        calibration = None
        if "context-likelihood" in profiles and profiles["context-likelihood"]:
            calibration = calibrate_likelihood(profiles["context-likelihood"], served)
            maes["context-likelihood (calibrated)"] = calibration["profile_mae"]
            log(f"likelihood proxy: scale {calibration['scale']:g} fitted to served quality, "
                f"cross-fitted MAE {calibration['cross_fitted_mae']}")
        drift = None
        if args.drift_threshold is not None:
            drift = drift_phase(cl, contexts, stream, max_new, min(alphas), args.drift_threshold,
                                profile_methods[-1], profiles[profile_methods[-1]], served, log)
        status = cl.api("GET", "/evicpress/status")
        for m, row in maes.items():
            log(f"profile MAE ({m}): " + ", ".join(f"{k} {v['mae']:.3f} (bias {v['bias']:+.3f}, {v['contexts']} contexts)"
                                                    for k, v in row.items() if isinstance(v, dict)))
    except BaseException:
        # a benchmark never hides a failure: no restart, the server's log tail instead
        if state["server"] is not None:
            log(f"benchmark failed; server log tail:\n{state['server'].log_tail(40)}")
        raise
    finally:
        if state["server"] is not None:
            state["server"].stop()
        tmp.cleanup()
    result = {
        "benchmark": "evicpress",
        "command": "python -m sglang_vc.bench.evicpress " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": q,
        "model": args.model,
        "contexts": n_ctx,
        "context_tokens_mean": sum(len(c["token_ids"]) for c in contexts) / n_ctx,
        "context_tokens_grid": list(lengths),
        "methods": methods,
        "context_kv_bytes_mean": ctx_bytes,
        "requests_per_system": n_req,
        "zipf_s": args.zipf,
        "max_new_tokens": max_new,
        "tiers": {"device_tokens": device_tokens, "host_contexts": host_ctx, "disk_contexts": disk_ctx,
                  "measured": {k: v for k, v in status["tiers"].items()},
                  "prefill_tokens_per_s": status["prefill_tokens_per_s"],
                  "decompress_bytes_per_s": status["decompress_bytes_per_s"]},
        "profiling_seconds": t_profile,
        "profiles_reused": bool(args.reuse_profiles),
        "profile_methods": profile_methods,
        "profile_queries": profile_queries,
        "profile_seconds": profile_seconds,
        "profiles": profiles,
        "served_quality": served,
        "served_quality_records": served_records,
        "frontier": frontier(rows),
        "profile_mae": maes,
        "served_floor": floor,
        "likelihood_calibration": calibration,
        "drift": drift,
        "results": rows,
        "server_args": server_args,
        "regime": None if state["regime"] is None else {**dataclasses.asdict(state["regime"]),
                                                        "reference": dataclasses.asdict(regime)},
        "seconds": time.time() - t_start,
        "records": records,
    }
    out_json.write_text(json.dumps(result, indent=1))
    pngs = ([out_json.with_suffix(".png")] if rows else []) + [out_json.with_suffix(".profiles.png")]
    try:
        if rows:
            plot(rows, pngs[0], None if regime is None else f"regime {regime.name}, emulated (nominal figures)")
        plot_profiles(profiles, served, pngs[-1])
    except Exception as exc:  # pragma: no cover - plotting is optional
        log(f"no plot: {exc}")
    log(f"wrote {', '.join(str(p) for p in [out_json, *pngs] if p.exists())}")
    for name, f in result["frontier"]["baselines"].items():
        if f["ratio"] is not None:
            log(f"frontier: EvicPress at {name}'s quality {f['quality']:.3f}: {f['evicpress_ttft_at_quality_s']:.3f}s "
                f"vs {f['ttft_mean_s']:.3f}s ({f['ratio']:.2f}x)")
    for d in result["frontier"]["dominated"]:
        log(f"frontier: {d['evicpress']} is dominated by {d['by']}")
    for r in rows:
        log(f"{r['system']:>24}  ttft {r['ttft_mean_s']:.3f}s  quality {r['quality']:.3f}  "
            f"hits {json.dumps({k: round(v, 2) for k, v in r['hit_rate_by_tier'].items()})}"
            + (f"  SERVER FAILURES {r['server_failures']:g}" if r.get("server_failures") else ""))
    return 0


def plot(rows: list[dict], path: Path, regime: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for r in rows:
        name = r["system"]
        marker = "*" if name.startswith("evicpress") else ("s" if name == "lru" else ("^" if name.startswith("fixed") else "o"))
        ax.scatter(r["ttft_mean_s"], r["quality"], marker=marker, s=120 if marker == "*" else 60, label=name)
    ax.set_xlabel("mean TTFT (s)")
    ax.set_ylabel("quality (MiniLM cosine vs full-KV answer)")
    ax.set_title("EvicPress vs baselines (paper fig. 7)" + (f"\n{regime}" if regime else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_profiles(profiles: dict, served: dict, path: Path) -> None:
    """Profiled against served quality, one point per (context, config), per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 4.2), squeeze=False)
    for ax, (method, per_ctx) in zip(axes[0], profiles.items()):
        for cfg, by_ctx in served.items():
            pts = [(q, per_ctx[cid][cfg]) for cid, q in by_ctx.items() if cfg in per_ctx.get(cid, {})]
            if pts:
                ax.scatter(*zip(*pts), s=25, label=cfg)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(method)
        ax.set_xlabel("served quality")
        ax.set_ylabel("profiled quality")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
