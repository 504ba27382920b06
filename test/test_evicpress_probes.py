"""EvicPress's profiling questions built from the context (evicpress/probes.py), the
profiler using them, and the benchmark's profile error against served quality."""

from __future__ import annotations

import re

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
    from sglang_vc.bench.evicpress import profile_mae, served_quality

    records = {"fixed:kivi@4b": [
        {"ctx": "a", "tier": "host", "quality": 0.8}, {"ctx": "a", "tier": "disk", "quality": 1.0},
        {"ctx": "b", "tier": "miss", "quality": 1.0},  # recomputed: not a served compressed answer
        {"ctx": "b", "tier": "device", "quality": 0.5}]}
    served = served_quality(records, ["kivi@4b", "kivi@2b"])
    assert served == {"kivi@4b": {"a": 0.9, "b": 0.5}, "kivi@2b": {}}
    maes = profile_mae({"good": {"a": {"kivi@4b": 0.9}, "b": {"kivi@4b": 0.6}},
                        "bad": {"a": {"kivi@4b": 0.5}, "b": {"kivi@4b": 1.0}}}, served)
    assert abs(maes["good"]["kivi@4b"]["mae"] - 0.05) < 1e-9 and maes["good"]["kivi@4b"]["contexts"] == 2
    assert abs(maes["bad"]["kivi@4b"]["mae"] - 0.45) < 1e-9 and abs(maes["bad"]["kivi@4b"]["bias"] - 0.05) < 1e-9
    assert "kivi@2b" not in maes["good"] and abs(maes["good"]["mean"] - 0.05) < 1e-9
