"""Shared by the workloads: token counting (a tokenizer's, or the approximation), provenance
(paths, sizes, sha256, licenses of the files used), deterministic randomness, text and
length-fitting helpers, and the item record.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
import re
import sysconfig
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


WORKLOADS_VERSION = 1
MODEL_CONTEXT = 8192  # SmolLM2-135M(-Instruct)
DEFAULT_MAX_TOKENS = MODEL_CONTEXT - 256
LENGTH_TOLERANCE = 0.10  # prompts of a target length L have L*(1-tol) <= n_tokens <= L
MIN_TARGET = 128

APPROX_FACTOR = 1.3
# Without a tokenizer: tokens ~ 1.3 per word (letter run), per digit (current tokenizers split
# numbers into digits) and per punctuation run, 0.6 per non-ASCII character and per newline,
# 2.5 per run of 2+ spaces after text (alignment). Fitted by hand on SmolLM2's tokenizer
# over stdlib code and the documents used here: prose comes out at words*1.3 plus
# punctuation; on whole prompts of the default workloads SmolLM2's real count is 0.8x to
# 1.15x this estimate (the high end: code and text dense with numbers).
_APPROX_FEATURES = (
    (re.compile(r"[^\W\d_]+"), APPROX_FACTOR),
    (re.compile(r"\d"), APPROX_FACTOR),
    (re.compile(r"[^\w\s]+"), APPROX_FACTOR),
    (re.compile(r"[^\x00-\x7f]"), 0.6),
    (re.compile(r"\n"), 0.6),
    (re.compile(r"(?<=\S) {2,}"), 2.5),
)
APPROX_METHOD = ("approx: ceil(1.3 * (words + digits + punctuation runs) + 0.6 * (non-ASCII chars + newlines) "
                 "+ 2.5 * inner runs of spaces)")


def _approx_raw(text: str) -> float:
    return sum(w * len(r.findall(text)) for r, w in _APPROX_FEATURES)


def approx_tokens(text: str) -> int:
    """Token count estimate without a tokenizer (see ``_APPROX_FEATURES``)."""
    return math.ceil(_approx_raw(text))


# ============================================================================ tokens


class TokenCounter:
    """Counts tokens with a real tokenizer, or approximates them without one.

    ``tokenizer`` may be ``None`` (approximation), a path to a tokenizer directory or a
    ``tokenizer.json`` file, a built-in model name (``smollm2-135m``, resolved by
    ``sglang_vc.models``), or an object with ``encode`` (a ``transformers`` tokenizer or
    a ``tokenizers.Tokenizer``). Special tokens are never added to the count.
    """

    def __init__(self, tokenizer: Any = None):
        self.path: str | None = None
        self._tok: Any = None
        self._kind = "approx"
        if tokenizer is None:
            self.method = APPROX_METHOD
        elif isinstance(tokenizer, (str, os.PathLike)):
            self.path = _resolve_tokenizer_path(os.fspath(tokenizer))
            self._tok, self._kind, label = _load_tokenizer(self.path)
            self.method = f"{label} tokenizer from {self.path}"
        elif hasattr(tokenizer, "encode"):
            self._tok = tokenizer
            mod = type(tokenizer).__module__
            if mod.startswith("tokenizers"):
                self._tok = _untruncated(tokenizer)
                self._kind = "tokenizers"
            else:
                self._kind = "transformers"
            self.path = getattr(tokenizer, "name_or_path", None) or None
            self.method = f"{self._kind} tokenizer object {type(tokenizer).__name__}" + (
                f" ({self.path})" if self.path else ""
            )
        else:
            raise TypeError(f"tokenizer must be None, a path or a tokenizer object, got {type(tokenizer)!r}")
        self.key = self.method  # cache key for per-line counts

    @property
    def exact(self) -> bool:
        return self._kind != "approx"

    def describe(self) -> dict:
        d = {"method": self.method, "exact": self.exact, "tokenizer": self.path}
        if not self.exact:
            d["note"] = (
                "no tokenizer given: lengths are approximations (words*1.3 for prose); "
                "pass --tokenizer DIR for real token counts"
            )
        return d

    def count(self, text: str) -> int:
        if not text:
            return 0
        if self._kind == "approx":
            return approx_tokens(text)
        if self._kind == "tokenizers":
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        ids = self._tok.encode(text, add_special_tokens=False)
        return len(ids)

    def count_many(self, texts: Sequence[str]) -> list[float]:
        """Counts of several texts (for the approximation: unrounded, so that they add up)."""
        if self._kind == "approx":
            return [_approx_raw(t) for t in texts]
        if not texts:
            return []
        if self._kind == "tokenizers":
            return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        try:
            out = self._tok(list(texts), add_special_tokens=False)["input_ids"]
            return [len(x) for x in out]
        except Exception:  # slow tokenizers without batching
            return [self.count(t) for t in texts]


def _untruncated(tok):
    """A copy of a ``tokenizers.Tokenizer`` with truncation and padding switched off."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(tok.to_str())
    t.no_truncation()
    t.no_padding()
    return t


def _resolve_tokenizer_path(name: str) -> str:
    """A path as an absolute path; a bare name that is no path: a built-in model alias
    (``sglang_vc.models.resolve``, which prepares the model on first use)."""
    if os.path.exists(name) or os.sep in name:
        return os.path.abspath(name)
    try:
        from sglang_vc import models
    except ImportError:
        return os.path.abspath(name)
    try:
        return models.resolve(name)
    except ValueError:
        return os.path.abspath(name)


def _load_tokenizer(path: str):
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    tj = p if p.is_file() else p / "tokenizer.json"
    err = None
    if p.is_dir():
        try:
            try:  # the project's start-up shim (torchvision schemas) where it exists
                import sglang_vc._startup  # noqa: F401
            except ImportError:
                pass
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(p))
            tok.model_max_length = 1 << 30  # counting only: no "sequence too long" warnings
            return tok, "transformers", "transformers.AutoTokenizer"
        except Exception as e:  # transformers missing or not importable here
            err = e
    if tj.is_file():
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(tj))
        t.no_truncation()
        t.no_padding()
        return t, "tokenizers", "tokenizers.Tokenizer(tokenizer.json)"
    raise RuntimeError(f"cannot load a tokenizer from {path}: {err!r}")


@functools.lru_cache(maxsize=None)
def _counter_cached(key: str | None) -> TokenCounter:
    return TokenCounter(key)


def _get_counter(tokenizer: Any) -> TokenCounter:
    if isinstance(tokenizer, TokenCounter):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return _counter_cached(None if tokenizer is None else os.fspath(tokenizer))
    return TokenCounter(tokenizer)


# ============================================================================ sources


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _stdlib_dir() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _purelib_dir() -> str:
    return os.path.realpath(sysconfig.get_paths()["purelib"])


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict:
    try:
        from importlib.metadata import packages_distributions

        return packages_distributions()
    except Exception:
        return {}


def _dist_license(meta) -> str | None:
    lic = meta.get("License-Expression") or ""
    if not lic:
        raw = (meta.get("License") or "").strip()
        if raw and len(raw) <= 120 and "\n" not in raw:
            lic = raw
        elif raw:
            lic = raw.splitlines()[0][:100] + " ..."
    classifiers = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    if classifiers:
        lic = (lic + "; " if lic else "") + ", ".join(classifiers)
    return lic or None


@functools.lru_cache(maxsize=None)
def _license_for(path: str) -> str:
    """Best-effort license of a source file (what its package declares)."""
    std = _stdlib_dir()
    pure = _purelib_dir()
    if path.startswith(pure + os.sep):
        rel = os.path.relpath(path, pure)
        top = rel.split(os.sep)[0]
        try:
            from importlib.metadata import PathDistribution, distribution

            if top.endswith(".dist-info"):
                dist = PathDistribution(Path(pure) / top)
            else:
                name = top[:-3] if top.endswith(".py") else top
                dists = _packages_distributions().get(name) or []
                if not dists:
                    return "unknown (no distribution found)"
                dist = distribution(dists[0])
            lic = _dist_license(dist.metadata)
            return f"{lic} (declared by {dist.metadata['Name']} {dist.version})" if lic else "not declared"
        except Exception:
            return "unknown"
    if path.startswith(std + os.sep):
        return f"PSF-2.0 (Python standard library; see {os.path.join(std, 'LICENSE.txt')})"
    if path.startswith("/usr/share/common-licenses/"):
        return f"license text itself ({os.path.basename(path)})"
    m = re.match(r"/usr/share/doc/([^/]+)/copyright$", path)
    if m:
        return f"Debian copyright file of package {m.group(1)} (states that package's licenses)"
    return "unknown"


def _source_record(path: str, **extra) -> dict:
    size, sha = _file_digest(path)
    return {"path": path, "size": size, "sha256": sha, "license": _license_for(path), **extra}


def _clean_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n").expandtabs(8)
    lines = [ln.rstrip() for ln in text.split("\n")]
    out: list[str] = []
    blank = 0
    for ln in lines:
        blank = blank + 1 if not ln else 0
        if blank <= 1:
            out.append(ln)
    return "\n".join(out).strip("\n") + "\n"


def _rng(name: str, seed: int, i: int) -> random.Random:
    # str seeds are hashed with sha512 by random.seed: stable across processes and platforms
    return random.Random(f"sglang_vc.workloads/{name}/{seed}/{i}")


def _lines(text: str) -> list[str]:
    ls = text.splitlines(keepends=True)
    if ls and not ls[-1].endswith("\n"):
        ls[-1] += "\n"
    return ls


# ============================================================================ helpers


def _max_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest k in [lo, hi] with ok(k), assuming ok is monotone (True then False) and ok(lo)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fit_search(lo: int, guess: int, hi: int, ok: Callable[[int], bool], window: int = 16) -> int:
    """:func:`_max_true` on [lo, hi], probing near ``guess`` first (few tokenizer calls)."""
    guess = min(max(guess, lo), hi)
    a = max(lo, guess - window)
    if a > lo and not ok(a):
        a = lo
    b = min(hi, guess + window)
    if ok(b):
        return _max_true(b, hi, ok)
    return _max_true(a, b - 1, ok) if b - 1 >= a else a


def _prefix_fit(counts: Sequence[int], start: int, budget: int) -> int:
    """Number of lines from ``start`` whose summed counts fit ``budget``."""
    total, k = 0, 0
    for c in counts[start:]:
        if total + c > budget:
            break
        total += c
        k += 1
    return k


def _clamp_lengths(lengths: Iterable[int], max_tokens: int) -> list[int]:
    out = []
    for L in lengths:
        L = min(int(L), max_tokens)
        if L < MIN_TARGET:
            raise ValueError(f"target length {L} is below the minimum {MIN_TARGET}")
        if L not in out:
            out.append(L)
    return out


def _context_id(context: str) -> str:
    return hashlib.sha256(context.encode()).hexdigest()[:16]


def _finish_item(name: str, i: int, task: str, prompt: str, question: str, answer, n_tokens: int, target,
                 max_new_tokens: int, source: dict, **extra) -> dict:
    assert prompt.endswith(question)
    item = {
        "id": f"{name}-{i:04d}",
        "task": task,
        "prompt": prompt,
        "question": question,
        "answer": answer,
        "n_tokens": n_tokens,
        "target_tokens": target,
        "max_new_tokens": max_new_tokens,
        "context_id": _context_id(prompt[: len(prompt) - len(question)]),
        "source": source,
    }
    item.update(extra)
    return item


def _norm_space(text: str) -> str:
    return " " + " ".join(text.split()) + " "


def _units(line: str, width: int = 160) -> list[str]:
    """A line cut after spaces into pieces of at most about ``width`` characters (they join
    back to the line), so that short haystacks can be filled closely."""
    if len(line) <= width:
        return [line]
    out, start = [], 0
    while len(line) - start > width:
        cut = line.rfind(" ", start + width // 4, start + width * 3 // 4)
        if cut == -1:
            cut = line.find(" ", start + width * 3 // 4)
            if cut == -1 or cut >= len(line) - 2:
                break
        out.append(line[start : cut + 1])
        start = cut + 1
    out.append(line[start:])
    return out
