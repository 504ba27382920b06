"""The document pool the prose workloads draw from: license texts, Python's license,
installed packages' metadata and Debian ``copyright`` files found on this machine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .common import TokenCounter, _clean_text, _lines, _purelib_dir, _stdlib_dir, _units


# --------------------------------------------------------------- document pool


@dataclass
class _Doc:
    path: str
    title: str
    kind: str
    lines: list[str]
    prose: float  # fraction of non-blank lines that read like prose (see _prose)
    counts: dict = field(default_factory=dict)

    def line_counts(self, counter: TokenCounter) -> list[int]:
        c = self.counts.get(counter.key)
        if c is None:
            c = self.counts[counter.key] = counter.count_many(self.lines)
        return c

    def units(self, counter: TokenCounter) -> tuple[list[str], list[bool], list[int], list]:
        """Lines cut into units (:func:`_units`): texts, starts-a-line flags, line index, counts."""
        key = ("units", counter.key)
        u = self.counts.get(key)
        if u is None:
            texts, starts, idx = [], [], []
            for li, ln in enumerate(self.lines):
                for ui, piece in enumerate(_units(ln)):
                    texts.append(piece)
                    starts.append(ui == 0)
                    idx.append(li)
            u = self.counts[key] = (texts, starts, idx, counter.count_many(texts))
        return u


_DOC_KINDS = ("common-licenses", "python-license", "package-metadata", "debian-copyright")
_MIN_DOC_CHARS = 1500
_MAX_DOC_CHARS = 200_000


_LETTER = re.compile(r"[^\W\d_]")
_NOT_PROSE = re.compile(r"https?:|[<>{}|=_*\[\]`@#]")


def _prose(lines: Sequence[str]) -> float:
    """Fraction of non-blank lines with >= 5 words, >= 75% letters and no markup."""
    ls = [ln for ln in lines if ln.strip()]
    good = 0
    for ln in ls:
        t = ln.replace(" ", "").strip()
        if len(ln.split()) >= 5 and len(_LETTER.findall(t)) >= 0.75 * len(t) and not _NOT_PROSE.search(ln):
            good += 1
    return good / max(1, len(ls))


def _metadata_body(text: str) -> str:
    """The long description of a METADATA file (after the headers)."""
    parts = re.split(r"\n\s*\n", text.replace("\r\n", "\n"), maxsplit=1)
    return parts[1] if len(parts) == 2 else ""


@functools.lru_cache(maxsize=None)
def _doc_pool(kinds: tuple[str, ...]) -> tuple[_Doc, ...]:
    """Sorted, de-duplicated documents of the given kinds found on this machine."""
    found: list[tuple[str, str, str, str]] = []  # (kind, path, title, text)

    def read(p: str) -> str | None:
        try:
            return Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    if "common-licenses" in kinds:
        d = "/usr/share/common-licenses"
        if os.path.isdir(d):
            for fn in sorted(os.listdir(d)):
                p = os.path.join(d, fn)
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                t = read(p)
                if t:
                    found.append(("common-licenses", p, f"License text: {fn}", t))
    if "python-license" in kinds:
        p = os.path.join(_stdlib_dir(), "LICENSE.txt")
        t = read(p) if os.path.isfile(p) else None
        if t:
            found.append(("python-license", p, "Python license (LICENSE.txt)", t))
    if "package-metadata" in kinds:
        pure = _purelib_dir()
        if os.path.isdir(pure):
            for fn in sorted(os.listdir(pure)):
                if not fn.endswith(".dist-info"):
                    continue
                p = os.path.join(pure, fn, "METADATA")
                t = read(p) if os.path.isfile(p) else None
                if t:
                    name = fn[: -len(".dist-info")]
                    found.append(("package-metadata", p, f"Description of the Python package {name}", _metadata_body(t)))
    if "debian-copyright" in kinds:
        d = "/usr/share/doc"
        if os.path.isdir(d):
            for pkg in sorted(os.listdir(d)):
                p = os.path.join(d, pkg, "copyright")
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                t = read(p)
                if t:
                    found.append(("debian-copyright", p, f"Debian copyright file of {pkg}", t))
    docs, seen = [], set()
    for kind, p, title, t in found:
        t = _clean_text(t)
        if not (_MIN_DOC_CHARS <= len(t) <= _MAX_DOC_CHARS):
            continue
        h = hashlib.sha256(t.encode()).hexdigest()
        if h in seen:
            continue
        seen.add(h)
        ls = _lines(t)
        docs.append(_Doc(p, title, kind, ls, round(_prose(ls), 4)))
    return tuple(docs)
