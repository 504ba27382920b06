"""Profiling questions built from the context itself (no hosted model, no generation).

The profiler needs questions whose full-KV answers a damaged KV can get wrong. Asking
the served model to write them (``--evicpress-profile-source model``) gives one short,
generic question per call, answered in a few words that a 2-bit copy still gets right
most of the time: profiles then overrate aggressive configs. Questions made from what
the context holds read the KV where it matters:

* **recall** -- "Continue this passage of the text above, word for word: <cue>", the
  cue being the first words of one of its lines: the answer is a verbatim span, as
  long as ``--evicpress-profile-max-new-tokens``, and every token of it depends on
  attending to the right rows;
* **entity** -- "What does the text above say about <name>?" for an identifier, a
  number or a capitalised name that occurs in it (code identifiers first for code).

The choice is deterministic (seeded by the context's tokens), so a context is profiled
on the same questions on every server that builds them.
"""

from __future__ import annotations

import enum
import hashlib
import random
import re
from typing import Sequence

__all__ = ["ProbeSource", "context_probes", "RECALL_TEMPLATE", "ENTITY_TEMPLATE"]


class ProbeSource(str, enum.Enum):
    """Where the profiler's questions come from for a context registered without any."""

    CONTEXT = "context"  # built from the context's text (this module)
    MODEL = "model"  # written by the served model (sampled generations)

RECALL_TEMPLATE = 'Continue this passage of the text above, word for word: "{cue} ..."'
ENTITY_TEMPLATE = "What does the text above say about {name}?"

_IDENT = re.compile(r"\b(?:def|class|fn|func|function|struct|enum|interface|type)\s+([A-Za-z_][A-Za-z0-9_]{2,})")
_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]{3,})\s*=(?!=)", re.M)
_NAME = re.compile(r"\b([A-Z][a-z]+(?:[ -][A-Z][a-z]+)+|[A-Z]{2,}[A-Za-z0-9]*|\d+(?:\.\d+)+)\b")
_CUE_WORDS = 6
_MIN_LINE_WORDS = 10


def _seed(tokens: Sequence[int] | str) -> int:
    data = tokens.encode() if isinstance(tokens, str) else b",".join(str(int(t)).encode() for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _recall_cues(text: str) -> list[str]:
    """The first words of each line long enough to continue, once each."""
    cues, seen = [], set()
    for line in text.splitlines():
        words = line.split()
        if len(words) < _MIN_LINE_WORDS:
            continue
        cue = " ".join(words[:_CUE_WORDS])
        if cue not in seen and text.count(cue) == 1:  # an ambiguous cue has two right answers
            seen.add(cue)
            cues.append(cue)
    return cues


def _entities(text: str) -> list[str]:
    """Code identifiers (definitions, then assignments), then names and version-like
    numbers, in order of first appearance, once each."""
    out: list[str] = []
    for pattern in (_IDENT, _ASSIGN, _NAME):
        for m in pattern.finditer(text):
            name = m.group(1)
            if name not in out:
                out.append(name)
    return out


def context_probes(text: str, n: int, *, seed_tokens: Sequence[int] | str | None = None) -> list[str]:
    """``n`` questions about ``text`` (fewer when it holds fewer lines and names):
    recall and entity questions alternating, recall first, each drawn at random (seeded
    by ``seed_tokens``, default the text) from the candidates spread over the text."""
    if n <= 0:
        return []
    rng = random.Random(_seed(seed_tokens if seed_tokens is not None else text))
    cues = _recall_cues(text)
    names = _entities(text)
    rng.shuffle(cues)
    rng.shuffle(names)
    recall = [RECALL_TEMPLATE.format(cue=c) for c in cues]
    entity = [ENTITY_TEMPLATE.format(name=x) for x in names]
    out: list[str] = []
    while len(out) < n and (recall or entity):
        for pool in (recall, entity):
            if pool and len(out) < n:
                out.append(pool.pop())
    return out
