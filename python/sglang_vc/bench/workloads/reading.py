"""Workload ``reading``: documents from the pool and a quote-completion or which-document
question whose answer is in the text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .common import (
    LENGTH_TOLERANCE, TokenCounter, _clamp_lengths, _finish_item, _fit_search, _max_true, _norm_space,
    _prefix_fit, _rng, _source_record,
)
from .docs import _DOC_KINDS, _Doc, _doc_pool


# ============================================================================ reading


_READ_INTRO = "Below are several documents. Read them, then answer the question that follows them.\n\n"
_READ_TASKS = ("quote_completion", "which_document")
_READ_MIN_TARGET = 256
_SENT_END = re.compile(r"[.!?][\"')\]]*$")
_LIST_MARKER = re.compile(r"^\(?(\d{1,2}|[a-zA-Z]|[ivxIVX]{1,4})[.)]$")
_ALPHA_WORD = re.compile(r"^[\"'(]?[A-Za-z][a-z]*(?:[-'][A-Za-z]+)*[\"')]?[.,;:!?]?[\"')]?$")


@dataclass
class _DocSeg:
    d: _Doc
    a: int  # lines shown: d.lines[a:b]
    b: int
    k: int = 0  # document number in the prompt

    def header(self) -> str:
        part = "" if self.a == 0 and self.b == len(self.d.lines) else " (excerpt)"
        return f"### Document {self.k}: {self.d.title}{part}\n"

    def text(self) -> str:
        return "".join(self.d.lines[self.a : self.b])

    def render(self) -> str:
        return self.header() + self.text() + "\n"

    def cost(self, counter: TokenCounter) -> int:
        return sum(self.d.line_counts(counter)[self.a : self.b]) + counter.count(self.header()) + 2


def _words_with_lines(lines: Sequence[str]) -> list[tuple[str, int]]:
    return [(w, li) for li, ln in enumerate(lines) for w in ln.split()]


def _sentences(lines: Sequence[str]) -> list[tuple[list[str], int, int]]:
    """(words, index of its first line, of its last line) of the sentences in some lines."""
    ws = _words_with_lines(lines)
    out, cur, first = [], [], 0
    for j, (w, li) in enumerate(ws):
        if _LIST_MARKER.match(w) or w == ".":  # "1." "a)" "(iv)", Debian's " ." blank line
            if cur:
                out.append((cur, first, ws[j - 1][1]))
            cur = []
            continue
        if cur and w.endswith(":") and w[0].isupper() and (j == 0 or ws[j - 1][1] != li):
            out.append((cur, first, ws[j - 1][1]))  # a "Field:" at the start of a line starts a new block
            cur = []
        if not cur:
            first = li
        cur.append(w)
        nxt = ws[j + 1][0] if j + 1 < len(ws) else ""
        blank_after = j + 1 < len(ws) and ws[j + 1][1] > li + 1
        if (_SENT_END.search(w) and (not nxt or nxt[0].isupper() or nxt[0] in "\"'(")) or blank_after:
            out.append((cur, first, li))
            cur = []
    return out


def _good_sentence(words: list[str], min_words: int) -> bool:
    """A prose sentence: starts with a capital, >= 90% plain words, no markup or addresses."""
    if len(words) < min_words or len(words) > 80 or not words[0][0].isupper() or words[0].endswith(":"):
        return False
    if sum(bool(_ALPHA_WORD.match(w)) for w in words) < 0.9 * len(words):
        return False
    text = " ".join(words)
    return not re.search(r"https?:|@|`|©|\(c\)|copyright \d", text, re.IGNORECASE)


def _build_reading(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                   lengths: Sequence[int] = (1024, 2048, 4096, 8192), tasks: Sequence[str] = _READ_TASKS,
                   kinds: Sequence[str] = _DOC_KINDS, min_prose: float = 0.3) -> tuple[list[dict], dict]:
    tasks = list(tasks)
    for t in tasks:
        if t not in _READ_TASKS:
            raise ValueError(f"unknown reading task {t!r}; known: {list(_READ_TASKS)}")
    for k in kinds:
        if k not in _DOC_KINDS:
            raise ValueError(f"unknown document kind {k!r}; known: {list(_DOC_KINDS)}")
    lengths = _clamp_lengths(lengths, max_tokens)
    if min(lengths) < _READ_MIN_TARGET:
        raise ValueError(f"reading: target lengths must be >= {_READ_MIN_TARGET} tokens (room for two documents "
                         f"and a question), got {min(lengths)}")
    docs = [d for d in _doc_pool(tuple(kinds)) if d.prose >= min_prose]
    if len(docs) < 2:
        raise RuntimeError(f"reading workload: found only {len(docs)} documents of kinds {list(kinds)}")
    n = 2 * len(tasks) * len(lengths) if n is None else n
    items = [_reading_item(i, seed, tasks[i % len(tasks)], lengths[(i // len(tasks)) % len(lengths)], docs, counter)
             for i in range(n)]
    by_kind: dict[str, int] = {}
    for d in docs:
        by_kind[d.kind] = by_kind.get(d.kind, 0) + 1
    return items, {"lengths": lengths, "tasks": tasks, "kinds": list(kinds), "min_prose": min_prose,
                   "candidate_documents": by_kind}


def _reading_item(i: int, seed: int, task: str, target: int, docs, counter: TokenCounter) -> dict:
    rng = _rng("reading", seed, i)
    for _attempt in range(40):
        item = _reading_try(i, rng, task, target, docs, counter)
        if item is not None:
            return item
    raise RuntimeError(f"reading workload: could not build item {i} (task {task}, {target} tokens)")


def _reading_question(rng, task: str, segs: list[_DocSeg], max_words: int = 80):
    """(question, answer, aliases, seg index, (first, last) line of the sentence, extra) or None."""
    context = _norm_space(" ".join(s.text() for s in segs))
    order = list(range(len(segs)))
    rng.shuffle(order)
    for si in order:
        s = segs[si]
        sents = [x for x in _sentences(s.d.lines[s.a : s.b])
                 if _good_sentence(x[0], 18 if task == "quote_completion" else 10) and len(x[0]) <= max_words]
        rng.shuffle(sents)
        for words, first, last in sents[:20]:
            span = (s.a + first, s.a + last)  # line indices in the document
            if task == "quote_completion":
                for k in range(8, min(14, len(words) - 8) + 1):
                    prefix = " ".join(words[:k])
                    if context.count(" " + prefix + " ") == 1:
                        cont_words = words[k : k + 12]
                        cont = " ".join(cont_words)
                        q = (
                            "Continue the following sentence from the documents above, word for word, "
                            f"with its next {len(cont_words)} words: \"{prefix} ...\""
                        )
                        return q, cont, [], si, span, {"prefix": prefix}
            else:
                if len(segs) < 2:
                    return None
                sent = " ".join(words)
                if context.count(" " + sent + " ") == 1:
                    q = f"Which document (give its number) contains the sentence: \"{sent}\"? Answer with the number only."
                    return q, str(s.k), [f"Document {s.k}"], si, span, {"sentence": sent}
    return None


def _reading_try(i, rng, task, target, docs, counter) -> dict | None:
    q_reserve = min(120, max(48, target // 6))  # tokens kept for the question
    avail = target - counter.count(_READ_INTRO) - q_reserve
    segs: list[_DocSeg] = []
    used: set[int] = set()
    rem = avail
    slack = max(24, int(0.03 * target))
    # which_document needs several documents: none may take more than half of the budget
    cap = avail // 2 + 1 if task == "which_document" else avail
    tries = 0
    while rem > slack and tries < 16:
        j = rng.randrange(len(docs))
        if j in used:
            tries += 1
            continue
        d = docs[j]
        seg = _DocSeg(d, 0, len(d.lines), len(segs) + 1)
        if seg.cost(counter) > min(rem, cap):
            # an excerpt from the beginning or from a paragraph start
            paras = [x for x in range(1, len(d.lines) - 8) if not d.lines[x - 1].strip() and d.lines[x].strip()]
            seg.a = rng.choice([0, *paras]) if rng.random() < 0.75 else 0
            seg.b = seg.a + 1
            over = seg.cost(counter) - d.line_counts(counter)[seg.a]
            k = _prefix_fit(d.line_counts(counter), seg.a, min(rem, cap) - over)
            if k < 6:
                tries += 1
                continue
            seg.b = seg.a + k
        segs.append(seg)
        used.add(j)
        rem -= seg.cost(counter)
    if not segs:
        return None
    qa = _reading_question(rng, task, segs, max_words=max(20, q_reserve // 2))
    if qa is None:
        return None
    question, answer, aliases, si, span, extra = qa
    qtext = "Question: " + question
    adjustable = segs[-1]

    def render() -> str:
        return _READ_INTRO + "".join(s.render() for s in segs) + qtext

    def fits(b: int) -> bool:
        old = adjustable.b
        adjustable.b = b
        try:
            return counter.count(render()) <= target
        finally:
            adjustable.b = old

    def valid() -> bool:
        ctx = _norm_space(" ".join(s.text() for s in segs))
        key = extra.get("prefix") or extra.get("sentence")
        return ctx.count(" " + key + " ") == 1

    lo = span[1] + 1 if si == len(segs) - 1 else adjustable.a + 1
    if not fits(lo):
        return None
    planned = adjustable.b
    adjustable.b = _fit_search(lo, planned, len(adjustable.d.lines), fits)
    if not valid():
        adjustable.b = _max_true(lo, max(lo, planned), fits)
        if not valid():
            return None
    prompt = render()
    nt = counter.count(prompt)
    if nt > target or nt < math.ceil(target * (1 - LENGTH_TOLERANCE)):
        return None
    source = {
        "documents": [
            _source_record(s.d.path, title=s.d.title, kind=s.d.kind, number=s.k, lines=[s.a + 1, s.b],
                           total_lines=len(s.d.lines))
            for s in segs
        ],
        "question_document": segs[si].k,
        "question_lines": [span[0] + 1, span[1] + 1],
        "text_cleaning": "CRLF/form feeds -> newlines, tabs expanded, trailing spaces stripped, blank-line runs collapsed",
        **extra,
    }
    mnt = 32 if task == "quote_completion" else 8
    return _finish_item("reading", i, task, prompt, qtext, answer, nt, target, mnt, source, answer_aliases=aliases)
