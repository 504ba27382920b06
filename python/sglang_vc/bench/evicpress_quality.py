"""How :mod:`.evicpress` judges profiles and the frontier: the quality each config serves
from its stored copy (what a profile should predict), each profiling method's error
against it, the likelihood proxy's calibration, the frontier claim checked on the
measured points, and re-profiling on drift."""

from __future__ import annotations

import time
from typing import Optional

from .evicpress_client import Client, tier_of


def served_quality(cl: Client, contexts, configs: list[str], max_new: int, scorer, log) -> tuple[dict, list]:
    """config -> context -> mean quality of the answers served from that config's stored
    copy, over every context and its three stream questions (the test question and the
    two generic ones): what a profile should predict. Under ``fixed:config`` each context
    is computed once (its copy stored), then each question is asked with the device tree
    emptied first, so the answer comes from the stored copy (checked: a host or disk
    hit, and the copy loaded is the config's, :func:`from_copy`); references are full
    prefills in their own cache namespace."""
    questions = [(ci, qi) for ci in range(len(contexts)) for qi in range(3)]

    def prompt(ci: int, qi: int) -> list[int]:
        c = contexts[ci]
        return c["token_ids"] + (c["test"] if qi == 0 else c["profile"][qi - 1])

    refs = {(ci, qi): cl.stream(prompt(ci, qi), max_new, extra_key=f"bench-ref-{ci}-{qi}")[1] for ci, qi in questions}
    out: dict[str, dict[str, float]] = {}
    recs = []
    for cfg in configs:
        cl.api("POST", "/evicpress/reconfigure", {"policy": "fixed", "fixed_config": cfg})
        per: dict[str, list[float]] = {}
        for ci, c in enumerate(contexts):
            cl.stream(prompt(ci, 0), 1)  # computed once: its copy is stored
            for qi in range(3):
                cl.api("POST", "/evicpress/evict_device")
                before = cl.counters()
                _, text, _ = cl.stream(prompt(ci, qi), max_new)
                tier = tier_of(before, cl.counters())
                loaded = cl.api("GET", f"/evicpress/contexts/{c['id']}")["device_config"]
                recs.append({"config": cfg, "ctx": c["id"], "query": qi, "tier": tier, "text": text,
                             "served_config": loaded, "ref": refs[(ci, qi)]})
        scores = scorer.score_many([r["text"] for r in recs[-3 * len(contexts):]],
                                   [r["ref"] for r in recs[-3 * len(contexts):]])
        for r, sc in zip(recs[-3 * len(contexts):], scores):
            r["quality"] = sc
            if from_copy(r):
                per.setdefault(r["ctx"], []).append(sc)
        out[cfg] = {cid: sum(v) / len(v) for cid, v in per.items()}
        n = sum(len(v) for v in per.values())
        other = sum(r["tier"] in ("host", "disk") and not from_copy(r) for r in recs[-3 * len(contexts):])
        log(f"served quality of {cfg}: {n} of {3 * len(contexts)} answers from its stored copy "
            f"({other} loaded another copy), mean {sum(sum(v) for v in per.values()) / max(1, n):.3f}")
    return out, recs


def from_copy(rec: dict) -> bool:
    """Whether a served-quality answer came from the config's own stored copy: a host or
    disk hit (a miss recomputed the full KV; a device-tier copy is full) that loaded that
    config (not another copy of the context found on the store)."""
    return rec["tier"] in ("host", "disk") and rec.get("served_config", rec["config"]) == rec["config"]


def served_floor(records: list[dict]) -> dict:
    """Per config, what the served reference itself allows: the error of a "profile" that
    is the served answers to the two generic stream questions (exactly what serving gave
    them) against the context's served mean over all three -- the floor of any profile
    that does not see the test question -- and the spread of the three answers'
    qualities within a context (mean standard deviation)."""
    by: dict = {}
    for r in records:
        if from_copy(r) and "quality" in r:
            by.setdefault(r["config"], {}).setdefault(r["ctx"], {})[r["query"]] = r["quality"]
    out = {}
    for cfg, per in by.items():
        full = [q for q in per.values() if len(q) == 3]
        if not full:
            continue
        errs = [abs((q[1] + q[2]) / 2 - sum(q.values()) / 3) for q in full]
        spread = [(sum((v - sum(q.values()) / 3) ** 2 for v in q.values()) / 3) ** 0.5 for q in full]
        out[cfg] = {"generic_exact_mae": sum(errs) / len(errs), "within_context_sd": sum(spread) / len(spread),
                    "contexts": len(full)}
    return out


def calibrate_likelihood(profile: dict, served: dict, grid: Optional[list[float]] = None) -> dict:
    """The likelihood proxy's scale fitted to served quality. The server profiled with
    scale 1 (``q = exp(-gap)``); at scale ``s`` the profile is ``q ** (1 / s)``. The
    scale minimising the profile error is fitted on half the contexts and scored on the
    other half, both ways (``cross_fitted_mae``), and fitted on all (``scale``)."""
    grid = grid or [round(0.05 * 1.15 ** i, 4) for i in range(40)]

    def scaled(s: float, ids) -> dict:
        return {cid: {cfg: (q ** (1 / s) if q > 0 else 0.0) for cfg, q in profile[cid].items()} for cid in ids}

    def fit(ids) -> float:
        return min(grid, key=lambda s: profile_mae({"m": scaled(s, ids)}, served)["m"]["mean"] or 0.0)

    ids = sorted(profile)
    halves = (ids[0::2], ids[1::2])
    errs = []
    for train, test in (halves, halves[::-1]):
        if train and test:
            row = profile_mae({"m": scaled(fit(train), test)}, served)["m"]
            if row["mean"] is not None:
                errs.append(row["mean"])
    scale = fit(ids)
    return {"scale": scale, "cross_fitted_mae": sum(errs) / len(errs) if errs else None,
            "profile_mae": profile_mae({"m": scaled(scale, ids)}, served)["m"], "profiles": scaled(scale, ids)}


def profile_mae(profiles: dict[str, dict], served: dict[str, dict[str, float]]) -> dict:
    """Per profiling method and config: mean |profiled - served| quality over the
    contexts served from that config (and the signed mean, ``bias``); ``mean`` pools
    every (context, config) pair."""
    out: dict = {}
    for method, per_ctx in profiles.items():
        row: dict = {}
        errs_all = []
        for cfg, by_ctx in served.items():
            errs = [per_ctx[cid][cfg] - q for cid, q in by_ctx.items() if cfg in per_ctx.get(cid, {})]
            if errs:
                row[cfg] = {"mae": sum(abs(e) for e in errs) / len(errs), "bias": sum(errs) / len(errs),
                            "contexts": len(errs)}
                errs_all += errs
        row["mean"] = sum(abs(e) for e in errs_all) / len(errs_all) if errs_all else None
        out[method] = row
    return out


def drift_phase(cl: Client, contexts, stream, max_new: int, alpha: float, threshold: float, method: str,
                before: dict, served: dict, log) -> dict:
    """Re-profiling on drift (paper section 4.3), measured: the stream is served again by
    EvicPress with every compressed answer checked against the full-KV answer in idle
    time; a context whose checked quality falls ``threshold`` below its profile is
    re-profiled on the queries it was asked. Returns the counters and the profile error
    against the served quality before and after (TTFTs here are not a system's: the
    checks run between the requests)."""
    c0 = cl.counters()
    # (a reconfigure empties the tiers: one, before the placement pass)
    cl.api("POST", "/evicpress/reconfigure", {"policy": "evicpress", "alpha": alpha, "observe_rate": 1.0,
                                              "reprofile_threshold": threshold})
    for c in contexts:  # placement first: a context met for the first time is a miss, served full
        cl.stream(c["token_ids"] + c["profile"][0], 1)
    for i, (ci, qi) in enumerate(stream):
        c = contexts[ci]
        cl.stream(c["token_ids"] + (c["test"] if qi == 0 else c["profile"][qi - 1]), max_new)
    last, since = None, time.time()
    while True:  # the checks and the re-profiles they trigger, in idle time
        st = cl.api("GET", "/evicpress/status")
        c1 = cl.counters()
        checks = (c1.get("observations_queued", 0) - c0.get("observations_queued", 0)
                  - c1.get("observations", 0) + c0.get("observations", 0))
        if not st["pending_profiles"] and checks <= 0:
            break
        if (checks, st["pending_profiles"]) != last:
            last, since = (checks, st["pending_profiles"]), time.time()
        elif time.time() - since > 300:  # a check that failed is never counted: not waited for forever
            log(f"WARNING: drift: {checks} checks and {st['pending_profiles']} re-profiles made no progress "
                "in 300 s (the server log has the errors); measured as they are")
            break
        log(f"drift: {checks} checks and {st['pending_profiles']} re-profiles left")
        time.sleep(5)
    after = {c["id"]: {k: v for k, v in c["quality"].items() if k != "full"}
             for c in cl.api("GET", "/evicpress/contexts")["contexts"] if c["profiled"]}
    c1 = cl.counters()
    delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("observations_queued", "observations", "drift_flags", "reprofilings")}
    if not delta["observations_queued"]:
        log("WARNING: drift: no compressed answer was served, so none was checked: nothing measured")
    changed = sorted(cid for cid in after if after[cid] != before.get(cid))
    maes = profile_mae({"before": before, "after": {**before, **after}}, served)
    log(f"drift: {delta}, {len(changed)} contexts re-profiled; profile MAE {maes['before']['mean']:.3f} -> "
        f"{maes['after']['mean']:.3f}")
    return {"alpha": alpha, "threshold": threshold, "method": method, "counters": delta,
            "unfinished": {"checks": checks, "profiles": st["pending_profiles"]},
            "reprofiled": changed, "profile_mae": maes, "profiles_after": after}
