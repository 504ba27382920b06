"""EvicPress's profiling questions built from the context (evicpress/probes.py), the
profiler using them, and the benchmark's profile error against served quality."""

from __future__ import annotations

import re

import pytest

from sglang_vc.evicpress.probes import ENTITY_TEMPLATE, RECALL_TEMPLATE, ProbeSource, context_probes

CODE = '''import os

def load_settings(path):
    """Read the settings file at path and return them as a dictionary of strings."""
    return dict(line.split("=", 1) for line in open(path))

class RetryPolicy:
    max_attempts = 5
    backoff_seconds = 0.25

def schedule_backup(target, when):
    # the backup of the target directory runs at the given hour of every day of the week
    return (target, when)
'''

PROSE = """The Northern Railway opened its first line in 1854 between two market towns.
Trains ran twice a day and carried grain, coal and passengers along the river valley.
In 1872 the company was bought by Great Western Holdings, which doubled the track.
Version 2.4.1 of the timetable added a night service that stopped at every station.
"""


def _cue(q: str) -> str:
    prefix = RECALL_TEMPLATE.split("{cue}")[0]
    return q[len(prefix):-len(' ..."')]


def test_recall_and_entity_questions_alternate_and_come_from_the_text():
    qs = context_probes(PROSE, 6)
    assert len(qs) == 6
    kinds = ["recall" if q.startswith(RECALL_TEMPLATE.split("{cue}")[0]) else "entity" for q in qs]
    assert kinds == ["recall", "entity"] * 3
    for q in qs[::2]:
        cue = _cue(q)
        assert len(cue.split()) == 6 and PROSE.count(cue) == 1  # the start of one line, unambiguous
        assert any(line.startswith(cue) for line in PROSE.splitlines())
    names = {re.match(ENTITY_TEMPLATE.replace("{name}", "(.+)").replace("?", r"\?"), q).group(1) for q in qs[1::2]}
    assert names == {"The Northern Railway", "Great Western Holdings", "2.4.1"}  # names and numbers it holds


def test_code_identifiers_are_asked_about():
    qs = context_probes(CODE, 20)
    asked = {q for q in qs if not q.startswith(RECALL_TEMPLATE.split("{cue}")[0])}
    for name in ("load_settings", "RetryPolicy", "schedule_backup", "max_attempts", "backoff_seconds"):
        assert ENTITY_TEMPLATE.format(name=name) in asked
    # short lines (under 10 words) are never recall cues
    for q in qs:
        if q.startswith(RECALL_TEMPLATE.split("{cue}")[0]):
            line = next(l for l in CODE.splitlines() if l.split()[:6] == _cue(q).split())
            assert len(line.split()) >= 10


def test_probes_are_deterministic_per_context_and_bounded_by_what_the_text_holds():
    assert context_probes(PROSE, 4) == context_probes(PROSE, 4)
    assert context_probes(PROSE, 4, seed_tokens=[1, 2, 3]) == context_probes(PROSE, 4, seed_tokens=[1, 2, 3])
    assert context_probes(PROSE, 0) == []
    assert context_probes("too short", 5) == []
    assert len(context_probes(PROSE, 100)) < 100  # no question repeated to fill n
    assert len(set(context_probes(PROSE, 100))) == len(context_probes(PROSE, 100))


def test_profiler_builds_questions_from_the_context_without_generating():
    from sglang_vc.evicpress.service import ProfilerService

    posted, generated = [], []

    class Client:
        def call(self, method, path, body=None, params=None):
            posted.append((method, path, body))
            return {}

    class Tok:
        def encode(self, text, special=True):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    ctx = [ord(c) for c in PROSE]

    class Prof(ProfilerService):
        def _gen(self, ids, ns, max_new_tokens, **kw):
            generated.append(kw)
            return {"text": "same", "meta_info": {"cached_tokens": len(ctx)}}

    prof = Prof(Client(), "http://unused", tok=Tok(), idle_seconds=0, scorer=lambda a, b: 1.0)
    job = {"ctx_id": "c", "reason": "new", "token_ids": ctx, "prompts": [], "candidates": ["kivi@4b"],
           "generate_queries": 4, "profile_source": ProbeSource.CONTEXT.value, "max_new_tokens": 4}
    assert prof.profile(job) == {"kivi@4b": 1.0}
    queries = [b for m, p, b in posted if p == "/contexts/c/queries"][0]
    assert queries["texts"] == context_probes(PROSE, 4, seed_tokens=ctx)
    assert len(queries["suffixes"]) == 4
    assert not any(kw.get("stop") for kw in generated)  # no question was written by the model
    assert len(generated) == 4 * 2  # reference + kivi@4b answer per question


def test_profile_error_against_served_quality():
    from sglang_vc.bench.evicpress_quality import profile_mae

    served = {"kivi@4b": {"a": 0.9, "b": 0.5}, "kivi@2b": {}}
    maes = profile_mae({"good": {"a": {"kivi@4b": 0.9}, "b": {"kivi@4b": 0.6}},
                        "bad": {"a": {"kivi@4b": 0.5}, "b": {"kivi@4b": 1.0}}}, served)
    assert abs(maes["good"]["kivi@4b"]["mae"] - 0.05) < 1e-9 and maes["good"]["kivi@4b"]["contexts"] == 2
    assert abs(maes["bad"]["kivi@4b"]["mae"] - 0.45) < 1e-9 and abs(maes["bad"]["kivi@4b"]["bias"] - 0.05) < 1e-9
    assert "kivi@2b" not in maes["good"] and abs(maes["good"]["mean"] - 0.05) < 1e-9


def test_served_floor_is_what_the_two_generic_questions_leave_and_the_spread(tmp_path):
    """The served reference's own floor: the two generic questions' served qualities
    against the mean of all three; misses, device hits and answers from another copy of
    the context do not count. And the profiled-vs-served plot is written."""
    from sglang_vc.bench.evicpress_report import plot_profiles
    from sglang_vc.bench.evicpress_quality import served_floor

    recs = [{"config": "kivi@2b", "ctx": "a", "query": q, "tier": "host", "quality": v}
            for q, v in ((0, 0.0), (1, 0.6), (2, 0.6))]
    recs += [{"config": "kivi@2b", "ctx": "b", "query": 0, "tier": "miss", "quality": 1.0}]
    recs += [{"config": "kivi@2b", "ctx": "c", "query": q, "tier": "disk", "served_config": "kivi@4b", "quality": 1.0}
             for q in range(3)]
    floor = served_floor(recs)["kivi@2b"]
    assert floor["contexts"] == 1
    assert abs(floor["generic_exact_mae"] - (0.6 - 0.4)) < 1e-9
    assert abs(floor["within_context_sd"] - (0.08 ** 0.5)) < 1e-9
    png = tmp_path / "p.png"
    plot_profiles({"generic": {"a": {"kivi@2b": 0.5}}}, {"kivi@2b": {"a": 0.4}}, png)
    assert png.stat().st_size > 0


def test_likelihood_proxy_scores_the_full_answer_read_over_each_config():
    import math

    from sglang_vc.evicpress.context import ref_namespace, variant_label
    from sglang_vc.evicpress.profiler import likelihood_quality
    from sglang_vc.evicpress.service import ProfilerService

    class Client:
        def call(self, method, path, body=None, params=None):
            return {}

    ctx = list(range(100, 300))
    ref_lp = [-0.1, -0.2, -0.3]
    drop = {"kivi@4b": 0.05, "kivi@2b": 1.0}  # nats per token the config's KV costs the answer
    calls = []

    class Prof(ProfilerService):
        def _gen(self, ids, ns, max_new_tokens, **kw):
            calls.append((ns, max_new_tokens, kw))
            meta = {"cached_tokens": len(ctx)}
            if ns == ref_namespace("c"):
                meta["output_token_logprobs"] = [[lp, 7 + i, None] for i, lp in enumerate(ref_lp)]
                return {"text": "abc", "output_ids": [7, 8, 9], "meta_info": meta}
            assert ids[-3:] == [7, 8, 9] and kw["logprob_start_len"] == len(ids) - 4  # the full answer, teacher-forced
            d = drop[variant_label(ns)]
            # as SGLang answers: the first position from logprob_start_len has no logprob
            meta["input_token_logprobs"] = [[None, ids[-4], None]] + [
                [lp - d, t, None] for lp, t in zip(ref_lp, [7, 8, 9])]
            return {"text": "x", "output_ids": [1], "meta_info": meta}

    prof = Prof(Client(), "http://unused", tok=None, idle_seconds=0, scorer=lambda a, b: 0.0)
    job = {"ctx_id": "c", "reason": "new", "token_ids": ctx, "prompts": [ctx + [1, 2]],
           "candidates": ["kivi@2b", "kivi@4b"], "generate_queries": 0, "max_new_tokens": 3,
           "profile_metric": "likelihood", "likelihood_scale": 0.5}
    q = prof.profile(job)
    assert abs(q["kivi@4b"] - math.exp(-0.05 / 0.5)) < 1e-9 and abs(q["kivi@2b"] - math.exp(-1.0 / 0.5)) < 1e-9
    assert all(n == 1 for ns, n, kw in calls if ns != ref_namespace("c"))  # no decoding per config
    # a config that reads the answer as likely as the full KV scores 1; a gain is not above 1
    assert likelihood_quality([-1.0, -2.0], [-1.0, -2.0], 1.0) == 1.0
    assert likelihood_quality([-1.0], [-0.5], 1.0) == 1.0 and likelihood_quality([], [], 1.0) == 1.0


def test_likelihood_scale_is_fitted_to_served_quality():
    import math

    from sglang_vc.bench.evicpress_quality import calibrate_likelihood

    gaps = {f"c{i}": {"kivi@4b": 0.02 * (i + 1), "kivi@2b": 0.3 + 0.1 * i} for i in range(8)}
    profile = {cid: {cfg: math.exp(-g) for cfg, g in per.items()} for cid, per in gaps.items()}  # scale 1
    served = {cfg: {cid: math.exp(-gaps[cid][cfg] / 0.5) for cid in gaps} for cfg in ("kivi@4b", "kivi@2b")}
    out = calibrate_likelihood(profile, served, grid=[0.25, 0.5, 1.0, 2.0])
    assert out["scale"] == 0.5 and out["cross_fitted_mae"] < 1e-9
    assert out["profile_mae"]["mean"] < 1e-9


def test_evicpress_is_compared_with_the_fixed_frontier_at_its_own_quality():
    """The frontier is the fixed configs + LRU that no other is as good and as fast as,
    joined by lines: EvicPress at quality 0.95 against the line between kivi@4b (0.9,
    0.5 s) and LRU (1.0, 0.7 s), 0.6 s; the dominated kivi@2b point is off it; above the
    frontier there is no fixed config to compare, below it the fastest point is the bound."""
    from sglang_vc.bench.evicpress_report import frontier_at_rate, frontier_ttft, pareto

    rows = [{"system": "evicpress:alpha=1", "quality": 0.95, "ttft_mean_s": 0.3},
            {"system": "fixed:kivi@4b", "quality": 0.9, "ttft_mean_s": 0.5},
            {"system": "fixed:kivi@2b", "quality": 0.5, "ttft_mean_s": 0.55},
            {"system": "lru", "quality": 1.0, "ttft_mean_s": 0.7},
            {"system": "full-prefill", "quality": 1.0, "ttft_mean_s": 2.0}]
    f = frontier_at_rate(rows)
    assert [p["system"] for p in f["frontier"]] == ["fixed:kivi@4b", "lru"]
    e = f["evicpress"]["evicpress:alpha=1"]
    assert e["frontier_position"] == "interpolated"
    assert abs(e["frontier_ttft_at_quality_s"] - 0.6) < 1e-9 and abs(e["ratio_vs_frontier"] - 2.0) < 1e-9
    assert abs(e["ratio_vs_lru"] - 0.7 / 0.3) < 1e-9 and abs(e["quality_vs_lru"] + 0.05) < 1e-9
    front = pareto([(0.9, 0.5, "a"), (0.5, 0.55, "b"), (1.0, 0.7, "c")])
    assert frontier_ttft(front, 0.8) == (0.5, "below")
    assert frontier_ttft(front, 1.01) == (None, "above")


def test_the_frontier_plot_is_written(tmp_path):
    from sglang_vc.bench.evicpress_report import plot, rates_summary

    rows = [{"system": s, "quality": q, "ttft_mean_s": t * rate, "rate_per_s": rate}
            for rate in (1.0, 2.0) for s, q, t in (("evicpress:alpha=1", 0.95, 0.3), ("fixed:kivi@4b", 0.9, 0.5),
                                                   ("lru", 1.0, 0.7))]
    png = tmp_path / "f.png"
    plot(rows, rates_summary(rows, 1.0), png, "a regime")
    assert png.stat().st_size > 0


def test_the_sustainable_rate_is_where_mean_ttft_crosses_the_target():
    """Linear between the last rate within the target and the first beyond it; a system
    within it at every rate is censored at the highest, one beyond it at every rate at
    the lowest."""
    from sglang_vc.bench.evicpress_stream import sustainable_rate

    assert sustainable_rate([(1.0, 0.5), (2.0, 1.0), (4.0, 3.0)], 2.0) == {"rate_per_s": 3.0, "censored": None}
    assert sustainable_rate([(1.0, 0.5), (2.0, 1.0)], 2.0) == {"rate_per_s": 2.0, "censored": "at_least"}
    assert sustainable_rate([(1.0, 2.5), (2.0, 5.0)], 2.0) == {"rate_per_s": 1.0, "censored": "at_most"}


def test_poisson_arrivals_have_the_rate_and_are_the_same_for_every_system():
    from sglang_vc.bench.evicpress_stream import poisson_arrivals

    times = poisson_arrivals(4000, 5.0, seed=3)
    assert times == poisson_arrivals(4000, 5.0, seed=3) and times != poisson_arrivals(4000, 5.0, seed=4)
    assert all(b > a for a, b in zip(times, times[1:]))
    assert abs(len(times) / times[-1] - 5.0) < 0.4
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)

