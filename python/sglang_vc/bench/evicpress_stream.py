"""The requests of :mod:`.evicpress`: contexts from text on the machine, a Zipf-popular
stream of questions over them, sent at Poisson arrival times, and one system served
under that stream at each arrival rate.

Requests overlap (each is sent at its arrival time, whatever is still running), so a
request's TTFT includes its wait behind the others, and which tier served it is read back
by its rid (``GET /evicpress/requests``), not from counters between requests.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Optional

from .evicpress_client import TIERS, Client

GENERIC_QUESTIONS = (
    "Question: Summarize the text above in one sentence.",
    "Question: What is the main topic of the text above?",
)
# a stream of requests that cannot keep up is measured to its end, not waited on forever
REQUEST_TIMEOUT_S = 1800


def build_contexts(tokenizer_dir: str, n: int, lengths: tuple[int, ...], seed: int) -> list[dict]:
    """``n`` contexts (half reading items -- documents, licences, package metadata --, half
    code files), their lengths drawn from the ``lengths`` grid, each with its detail
    question (a quote to complete, a document to name, a function's return or callers)
    and the generic profiling questions, as token ids."""
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

        def suffix(q: str) -> list[int]:
            return tok(q + "\nAnswer:", add_special_tokens=False)["input_ids"]

        out.append({
            "id": it["id"],
            "source": it["task"],
            "token_ids": tok(context)["input_ids"],
            "test": suffix(it["question"].rstrip()),
            "profile": [suffix(q) for q in GENERIC_QUESTIONS],
            "answer": it.get("answer"),
        })
    return out


def zipf_stream(n_ctx: int, n_req: int, s: float, seed: int) -> list[tuple[int, int]]:
    """(context index, query index) pairs; context popularity ~ 1 / rank**s, ranks
    shuffled so popularity is unrelated to context order. Query 0 is the context's detail
    question, 1-2 the generic ones (repeats of a context with other questions)."""
    rng = random.Random(seed)
    ranks = list(range(n_ctx))
    rng.shuffle(ranks)
    weights = [1.0 / (ranks[i] + 1) ** s for i in range(n_ctx)]
    ctxs = rng.choices(range(n_ctx), weights=weights, k=n_req)
    return [(c, rng.choice((0, 0, 1, 2))) for c in ctxs]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds from the start) of a Poisson process of ``rate``
    requests per second; the same seed and rate give the same times for every system."""
    if not rate > 0:
        raise ValueError(f"an arrival rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompt_of(context: dict, query: int) -> list[int]:
    return context["token_ids"] + (context["test"] if query == 0 else context["profile"][query - 1])


def send_stream(cl: Client, contexts: list[dict], stream, arrivals: list[float], max_new: int, tag: str,
                no_cache: bool) -> list[dict]:
    """Send request ``i`` of ``stream`` at ``arrivals[i]`` (one thread each, so requests
    overlap as they arrive); its TTFT counts from its arrival. ``no_cache``: each request
    in a cache namespace of its own (full prefill)."""
    recs: list[Optional[dict]] = [None] * len(stream)

    def one(i: int, ci: int, qi: int) -> None:
        rid = f"{tag}-{i}"
        try:
            ttft, text, meta = cl.stream(prompt_of(contexts[ci], qi), max_new, rid=rid,
                                         extra_key=rid if no_cache else None, timeout=REQUEST_TIMEOUT_S)
            recs[i] = {"rid": rid, "ctx": contexts[ci]["id"], "query": qi, "arrival_s": arrivals[i],
                       "ttft_s": ttft, "text": text, "cached_tokens": meta.get("cached_tokens", 0),
                       "retractions": int(meta.get("num_retractions") or 0)}
        except Exception as exc:  # counted as a failure of the run, never a hang
            recs[i] = {"rid": rid, "ctx": contexts[ci]["id"], "query": qi, "arrival_s": arrivals[i],
                       "error": repr(exc)}

    threads = []
    t0 = time.perf_counter()
    for i, (ci, qi) in enumerate(stream):
        wait = t0 + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=one, args=(i, ci, qi), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return [r for r in recs if r is not None]


def tiers_of(cl: Client, recs: list[dict]) -> None:
    """Fill each record's ``tier`` and ``config`` from the server's log of requests."""
    served = {}
    for k in range(0, len(recs), 100):
        rids = [r["rid"] for r in recs[k:k + 100]]
        served.update({s["rid"]: s for s in cl.api("GET", "/evicpress/requests", params={"rid": rids})["requests"]})
    for r in recs:
        s = served.get(r["rid"], {})
        r["tier"], r["config"] = s.get("tier", "none"), s.get("config")


def rate_row(name: str, rate: float, recs: list[dict]) -> dict:
    """One system's figures at one arrival rate."""
    ok = [r for r in recs if "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    n = max(1, len(ok))
    return {
        "system": name, "rate_per_s": rate, "requests": len(recs), "errors": len(recs) - len(ok),
        "ttft_mean_s": sum(ttfts) / n if ttfts else None,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "hit_rate_by_tier": {t: sum(r.get("tier") == t for r in ok) / n for t in TIERS},
        # requests SGLang retracted (its pool full) and prefilled again: a row with any measures that too
        "retracted": sum(r["retractions"] > 0 for r in ok),
    }


def sustainable_rate(points: list[tuple[float, float]], target_s: float) -> dict:
    """The highest arrival rate whose mean TTFT stays within ``target_s``, from the
    measured (rate, mean TTFT) points: linear between the last rate within the target
    and the first beyond it. ``censored``: within the target at every rate measured (the
    rate is at least the highest one), or at none (at most the lowest)."""
    pts = sorted(points)
    if not pts:
        return {"rate_per_s": None, "censored": None}
    if pts[0][1] > target_s:
        return {"rate_per_s": pts[0][0], "censored": "at_most"}
    for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
        if t1 > target_s:
            return {"rate_per_s": r0 + (r1 - r0) * (target_s - t0) / (t1 - t0), "censored": None}
    return {"rate_per_s": pts[-1][0], "censored": "at_least"}


# a failed lookup serves the request without EvicPress (a plain miss): counted as a failure
FAILURE_COUNTERS = ("deferred_failures", "put_errors", "lookup_failures")


def run_system(cl: Client, name: str, reconfig: Optional[dict], contexts: list[dict], stream, rates: list[float],
               max_new: int, warm: bool, seed: int, log) -> tuple[list[dict], list[dict], dict]:
    """Serve ``stream`` under one system at each arrival rate in turn (the same requests,
    Poisson arrival times of the same seed for every system), each request stopped at its
    first token, then once more one request at a time with ``max_new`` tokens: the answers
    whose quality is measured. Each of these passes starts from empty tiers and a placement
    pass. ``reconfig`` None: full prefill (every request in its own
    cache namespace). Returns one row per rate, the per-request records (``rate_per_s``
    None: the answer pass) and the system's server-side summary.

    Why the streams stop at the first token: on this CPU a decode step costs each running
    request its full share (no batching gain, SGLang's torch-native attention loops over
    requests), so answers decoding beside the arrivals bound the rate long before a tier
    or a prefill does; on an H100 a batch decodes at nearly the cost of one request. The
    rates then measure what EvicPress trades: prefill and loads."""
    start = cl.counters()
    rows, records = [], []
    for k, rate in enumerate(rates):
        # every rate from the same start: empty tiers, then the placement pass (a rate run
        # after another would meet the promotions of the one before)
        _start_over(cl, reconfig, contexts, warm)
        t0 = time.time()
        recs = send_stream(cl, contexts, stream, poisson_arrivals(len(stream), rate, seed + k), 1,
                           f"bench-{name}-{rate:g}", no_cache=reconfig is None)
        _label(cl, recs, rate, reconfig is None)
        rows.append(rate_row(name, rate, recs))
        records += recs
        log(f"  {name} at {rate:.3g}/s: {len(recs)} requests in {time.time() - t0:.0f}s, ttft mean "
            f"{rows[-1]['ttft_mean_s'] or float('nan'):.3f}s p90 {rows[-1]['ttft_p90_s'] or float('nan'):.3f}s, "
            f"{rows[-1]['errors']} errors, tiers {json.dumps({t: round(v, 2) for t, v in rows[-1]['hit_rate_by_tier'].items()})}")
    _start_over(cl, reconfig, contexts, warm)
    answers = []
    for i, (ci, qi) in enumerate(stream):  # the answers, one request at a time
        answers += send_stream(cl, contexts, [(ci, qi)], [0.0], max_new, f"bench-{name}-answer-{i}",
                               no_cache=reconfig is None)
    _label(cl, answers, None, reconfig is None)
    records += answers
    c1 = cl.counters()
    summary = {"counters_delta": {k: c1.get(k, 0) - start.get(k, 0) for k in sorted(set(c1) | set(start))
                                  if not k.endswith("_used_bytes") and c1.get(k, 0) != start.get(k, 0)},
               "server_failures": sum(c1.get(k, 0) - start.get(k, 0) for k in FAILURE_COUNTERS),
               "answer_errors": sum("error" in r for r in answers)}
    if summary["server_failures"]:
        log(f"  WARNING: {name}: the server failed {summary['server_failures']:g} stores, moves or lookups "
            "(its log has the tracebacks)")
    if reconfig is not None:
        summary["placements"] = placements(cl)
    return rows, records, summary


def _start_over(cl: Client, reconfig: Optional[dict], contexts: list[dict], warm: bool) -> None:
    """Empty the tiers, storage included, under the system's policy and place the contexts
    (one unmeasured request each); full prefill has nothing to reset."""
    if reconfig is None:
        return
    cl.api("POST", "/evicpress/reconfigure", reconfig)
    # and the storage: a full context there is HiCache's pages of it, which outlive a
    # placement (they are HiCache's cache), and the next system would find them there
    cl.clear_storage()
    if warm:
        for c in contexts:
            cl.stream(prompt_of(c, 1), 1)
        cl.api("GET", "/evicpress/status")  # (answers once the stores it left are done)


def _label(cl: Client, recs: list[dict], rate: Optional[float], full_prefill: bool) -> None:
    if full_prefill:
        for r in recs:
            r["tier"], r["config"] = "miss", None
    else:
        tiers_of(cl, recs)
    for r in recs:
        r["rate_per_s"] = rate


def placements(cl: Client) -> dict:
    """How many contexts sit in each config/tier now."""
    out: dict = {}
    for c in cl.api("GET", "/evicpress/contexts")["contexts"]:
        p = c["placement"]
        key = "dropped" if p["tier"] is None else f"{p['config']}/{p['tier']}"
        out[key] = out.get(key, 0) + 1
    return out
