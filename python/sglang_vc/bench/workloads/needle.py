"""Workload ``needle``: a passkey sentence at several depths of a real-text haystack of
several lengths; scored by :func:`needle_found`.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from .common import (
    LENGTH_TOLERANCE, TokenCounter, _clamp_lengths, _finish_item, _fit_search, _prefix_fit, _rng,
    _source_record,
)
from .docs import _DOC_KINDS, _doc_pool


# ============================================================================ needle


_NEEDLE_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. You will be asked about it.\n\n"
)
_NEEDLE_Q = "\nWhat is the secret passkey mentioned in the text above? Answer with the number only."
_WORD_START = re.compile(r"(?<=\S )(?=\S)")
_SENT_BOUNDARY = re.compile(r"[.!?][\"')\]]* +(?=[A-Z\"'(])")


def _build_needle(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                  lengths: Sequence[int] = (512, 1024, 2048, 4096, 8192),
                  depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                  digits: int = 5, kinds: Sequence[str] = _DOC_KINDS, min_prose: float = 0.6) -> tuple[list[dict], dict]:
    lengths = _clamp_lengths(lengths, max_tokens)
    depths = [float(d) for d in depths]
    if any(not (0.0 <= d <= 1.0) for d in depths):
        raise ValueError(f"needle depths must be in [0, 1], got {depths}")
    if not (3 <= digits <= 12):
        raise ValueError("digits must be in [3, 12]")
    docs = [d for d in _doc_pool(tuple(kinds)) if d.prose >= min_prose and "passkey" not in "".join(d.lines).lower()]
    if not docs:
        raise RuntimeError("needle workload: no haystack documents found")
    grid = [(L, d) for d in depths for L in lengths]
    n = len(grid) if n is None else n
    items = [_needle_item(i, seed, *grid[i % len(grid)], digits, docs, counter) for i in range(n)]
    return items, {"lengths": lengths, "depths": depths, "digits": digits, "kinds": list(kinds), "min_prose": min_prose,
                   "needle_template": "The secret passkey is {value}.", "haystack_documents": len(docs)}


def _needle_item(i: int, seed: int, target: int, depth: float, digits: int, docs, counter: TokenCounter) -> dict:
    rng = _rng("needle", seed, i)
    value = str(rng.randrange(10 ** (digits - 1), 10**digits))
    for _attempt in range(20):  # another document order when a long line keeps the fill short
        order = list(range(len(docs)))
        rng.shuffle(order)
        item = _needle_try(i, order, value, target, depth, docs, counter)
        if item is not None:
            return item
    raise RuntimeError(f"needle workload: could not fill a {target}-token haystack (item {i})")


def _needle_try(i: int, order: list[int], value: str, target: int, depth: float, docs, counter) -> dict | None:
    needle = f"The secret passkey is {value}."
    # haystack units (lines, long lines cut after a space): documents in random order,
    # separated by blank lines, until long enough
    hay_lines: list[str] = []
    line_start: list[bool] = []  # the unit starts a line
    origin: list[tuple[int, int]] = []  # (doc index, line index) per unit
    counts: list = []
    blank = counter.count_many(["\n"])[0]
    for j in order:
        d = docs[j]
        if value in "".join(d.lines):
            continue
        if hay_lines:
            hay_lines.append("\n")
            line_start.append(True)
            origin.append((j, -1))
            counts.append(blank)
        texts, starts, idx, cnts = d.units(counter)
        hay_lines.extend(texts)
        line_start.extend(starts)
        origin.extend((j, li) for li in idx)
        counts.extend(cnts)
        if sum(counts) > target * 1.2 + 64:
            break

    def hay_text(k: int) -> str:
        hay = "".join(hay_lines[:k])
        return hay if not hay or hay.endswith("\n") else hay + "\n"

    def place(k: int, exact: bool = False) -> tuple[str, int, str]:
        """Haystack of the first k units, needle position, separator."""
        hay = hay_text(k)
        if depth <= 0.0 or k == 0:
            return hay, 0, "\n"
        if depth >= 1.0:
            return hay, len(hay), "\n"
        total = max(1, sum(counts[:k]))
        cands: list[tuple[float, float, int, str]] = []  # (key, penalty, position, separator)
        cum, off = 0, 0
        for li in range(k):
            ln = hay_lines[li]
            if line_start[li]:
                para = li == 0 or not hay_lines[li - 1].strip()
                # sentence and paragraph starts are preferred to other line starts
                pen = 0.0 if para else 0.01
                cands.append((abs(cum / total - depth) + pen, pen, off, "\n"))
            for m in _SENT_BOUNDARY.finditer(ln.rstrip("\n")):
                frac = (cum + counts[li] * m.end() / max(1, len(ln))) / total
                cands.append((abs(frac - depth), 0.0, off + m.end(), " "))
            cum += counts[li]
            off += len(ln)
        cands.sort()
        if cands[0][0] > 0.02:  # any word start: the last resort for short haystacks of long lines
            cum, off = 0, 0
            for li in range(k):
                ln = hay_lines[li]
                for m in _WORD_START.finditer(ln.rstrip("\n")):
                    frac = (cum + counts[li] * m.end() / max(1, len(ln))) / total
                    cands.append((abs(frac - depth) + 0.02, 0.02, off + m.end(), " "))
                cum += counts[li]
                off += len(ln)
            cands.sort()
        if exact:  # re-rank the best few by their real token fraction
            n_hay = max(1, counter.count(hay))
            cands = sorted((abs(counter.count(hay[:c[2]]) / n_hay - depth) + c[1], 0.0, c[2], c[3]) for c in cands[:8])
        return hay, cands[0][2], cands[0][3]

    def render(k: int, exact: bool = False) -> tuple[str, int, str, int]:
        hay, pos, sep = place(k, exact)
        text = _NEEDLE_INTRO + hay[:pos] + needle + sep + hay[pos:] + _NEEDLE_Q
        return text, pos, sep, len(hay)

    fixed = counter.count(_NEEDLE_INTRO) + counter.count(needle) + counter.count(_NEEDLE_Q) + 2
    k0 = _prefix_fit(counts, 0, target - fixed)
    k = _fit_search(0, k0, len(hay_lines), lambda k: counter.count(render(k)[0]) <= target) if k0 else 0
    while k > 0 and counter.count(render(k, True)[0]) > target:
        k -= 1
    prompt, pos, sep, hay_len = render(k, True)
    nt = counter.count(prompt)
    if nt < math.ceil(target * (1 - LENGTH_TOLERANCE)):
        return None
    hs = len(_NEEDLE_INTRO)
    off = hs + pos
    hay = hay_text(k)
    total = counter.count(hay)
    actual = counter.count(hay[:pos]) / total if total else 0.0
    if abs(actual - depth) > 0.05:
        return None  # unbreakable long lines around the depth: another document order
    used_docs: list[int] = []
    for j, _li in origin[:k]:
        if j not in used_docs:
            used_docs.append(j)
    docs_src = []
    for j in used_docs:
        n_lines = len({li for jj, li in origin[:k] if jj == j and li >= 0})  # the last may be partial
        d = docs[j]
        docs_src.append(_source_record(d.path, title=d.title, kind=d.kind, lines=[1, n_lines], total_lines=len(d.lines)))
    needle_info = {
        "text": needle,
        "value": value,
        "depth": depth,
        "depth_actual": round(actual, 4),
        "char_offset": off,
        "separator": sep,
        "haystack_span": [hs, hs + hay_len + len(needle) + len(sep)],
    }
    source = {"haystack": docs_src, "text_cleaning": "see reading workload"}
    return _finish_item("needle", i, "passkey", prompt, _NEEDLE_Q, value, nt, target, 16, source, needle=needle_info)


def needle_found(answer_text: str, item: dict) -> bool:
    """True if the model's answer contains the needle's value (digits not glued to others)."""
    value = item["needle"]["value"] if "needle" in item else str(item["answer"])
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", answer_text or "") is not None
