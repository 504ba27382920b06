"""Benchmark and test workloads built from real text found on this machine.

No data set hub is used: the prompts are made from files that are already here (the
Python standard library, installed packages' metadata, ``/usr/share/common-licenses``,
Debian ``copyright`` files) plus synthetic tasks. Four workloads:

``code``
    One or several real Python source files (the standard library by default; installed
    packages with ``roots=["stdlib", "site-packages"]``) + a question whose answer is derived from the
    file's AST: what a function returns, which function calls a name, which class defines
    a method, or "write the removed body of this function".
``reading``
    License texts and package documentation + a quote-completion ("continue the sentence
    that begins with ...") or a which-document question; the answer is in the text.
``needle``
    Needle in a haystack: real text of several target lengths with a passkey sentence
    inserted at several depths; scored by :func:`needle_found`.
``json_calls``
    A list of JSON tool schemas + a user request; the answer is one JSON call, scored by
    :func:`json_call_score` (tool name and arguments).

Every item is a JSON-serialisable dict with at least ``id``, ``prompt``, ``task``,
``answer`` (``None`` where no answer is known), ``question`` (the prompt ends with it, so
``prompt[:-len(question)]`` is the context), ``n_tokens``, ``max_new_tokens`` and
``source`` (paths, sha256 and line ranges of the text used). Items are deterministic given
the seed, the tokenizer and the files on the machine; :attr:`Workload.provenance` records
all three (paths, sizes, sha256, licenses, parameters).

Lengths are measured in tokens of the tokenizer passed as ``tokenizer`` (a directory,
loaded with ``transformers.AutoTokenizer``, falling back to ``tokenizers`` on its
``tokenizer.json``; or a tokenizer object). Without one they are *approximated*
(:func:`approx_tokens`: words * 1.3 for prose, plus digits, punctuation, non-ASCII
characters and space runs, which code and numbers have many of); the provenance says which
method was used, and runs against a model should pass its tokenizer. ``max_tokens`` is the prompt
budget: every prompt is at most that long, and target lengths above it are clamped to it.
The default (7936) leaves 256 tokens of SmolLM2's 8192 for the chat template and the
answer.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import math
import numbers
import os
import random
import re
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MODEL_CONTEXT",
    "TokenCounter",
    "approx_tokens",
    "Workload",
    "list_workloads",
    "describe_workloads",
    "load_workload",
    "read_jsonl",
    "write_workload",
    "needle_found",
    "json_call_score",
    "extract_json_call",
    "score",
    "token_f1",
]

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


# --------------------------------------------------------------- code file pool

_SKIP_DIRS = {"test", "tests", "__pycache__", "idle_test", "site-packages", "testing", "_vendor", "vendor"}


@functools.lru_cache(maxsize=None)
def _code_files(roots: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Sorted (path, label) of candidate Python files under the named roots."""
    out = []
    for root in roots:
        if root == "stdlib":
            base, label = _stdlib_dir(), "stdlib"
        elif root == "site-packages":
            base, label = _purelib_dir(), "site-packages"
        else:
            base, label = os.path.realpath(root), os.path.basename(os.path.realpath(root))
        if not os.path.isdir(base):
            continue
        for d, dirs, files in os.walk(base):
            dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith(".") and not x.endswith(".dist-info"))
            if base == _stdlib_dir() and d == base:
                dirs[:] = [x for x in dirs if not x.startswith("config-")]
            for fn in sorted(files):
                if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                    continue
                p = os.path.join(d, fn)
                try:
                    size = os.path.getsize(p)
                except OSError:
                    continue
                if 3_000 <= size <= 400_000:
                    out.append((p, label + "/" + os.path.relpath(p, base)))
    return tuple(out)


@dataclass
class _Func:
    name: str
    qualname: str
    cls: str | None  # class whose body defines it directly
    cls_start: int | None
    start: int  # first line incl. decorators
    lineno: int  # the def line
    end: int
    body_start: int  # first statement after the docstring
    sig_end: int
    doc_end: int | None
    n_body_stmts: int
    returns: list  # own Return nodes with a value


@dataclass
class _PyFile:
    path: str
    label: str
    text: str
    lines: list[str]
    funcs: list[_Func]
    calls: list[tuple[str, int, int]]  # (called name, line, index of innermost enclosing func or -1)
    defs: list[tuple[str, int]]  # function and class names with their def line
    top_starts: list[int]
    counts: dict = field(default_factory=dict)  # counter key -> per-line token counts

    def line_counts(self, counter: TokenCounter) -> list[int]:
        c = self.counts.get(counter.key)
        if c is None:
            c = self.counts[counter.key] = counter.count_many(self.lines)
        return c


class _Visitor(ast.NodeVisitor):
    def __init__(self):
        self.funcs: list[_Func] = []
        self.calls: list[tuple[str, int, int]] = []
        self.defs: list[tuple[str, int]] = []
        self.stack: list[tuple[str, Any, int]] = []  # (kind, node, func index)

    def _func_index(self) -> int:
        for kind, _, idx in reversed(self.stack):
            if kind == "func":
                return idx
        return -1

    def visit_ClassDef(self, node):
        self.defs.append((node.name, node.lineno))
        self.stack.append(("class", node, -1))
        self.generic_visit(node)
        self.stack.pop()

    def _visit_func(self, node):
        self.defs.append((node.name, node.lineno))
        parent = self.stack[-1] if self.stack else None
        cls = parent[1] if parent and parent[0] == "class" else None
        quals = [n.name for k, n, _ in self.stack] + [node.name]
        body = node.body
        doc_end = None
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            doc_end = body[0].end_lineno
            rest = body[1:]
        else:
            rest = body
        sig_parts = [node.lineno]
        for a in ast.walk(node.args):
            if hasattr(a, "end_lineno") and a.end_lineno:
                sig_parts.append(a.end_lineno)
        if node.returns is not None:
            sig_parts.append(node.returns.end_lineno)
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        f = _Func(
            name=node.name,
            qualname=".".join(quals),
            cls=cls.name if cls else None,
            cls_start=min([cls.lineno] + [d.lineno for d in cls.decorator_list]) if cls else None,
            start=start,
            lineno=node.lineno,
            end=node.end_lineno,
            body_start=rest[0].lineno if rest else node.end_lineno + 1,
            sig_end=max(sig_parts),
            doc_end=doc_end,
            n_body_stmts=len(rest),
            returns=_own_returns(node),
        )
        self.funcs.append(f)
        self.stack.append(("func", node, len(self.funcs) - 1))
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = _visit_func
    visit_AsyncFunctionDef = _visit_func

    def visit_Call(self, node):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
        if name:
            self.calls.append((name, node.lineno, self._func_index()))
        self.generic_visit(node)


def _own_returns(fn) -> list:
    out = []
    todo = list(fn.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(n, ast.Return):
            out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    return out


@functools.lru_cache(maxsize=512)
def _py_file(path: str, label: str) -> _PyFile | None:
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\t" in text or "\r" in text or "\f" in text:
        return None  # keep line/char offsets trivially equal to the file's
    lines = _lines(text)
    if len(lines) < 40 or max(len(ln) for ln in lines) > 200:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    v = _Visitor()
    v.visit(tree)
    if len(v.funcs) < 3:
        return None
    top = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) for n in tree.body]
    return _PyFile(path, label, text, lines, v.funcs, v.calls, v.defs, top)


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


# ============================================================================ code


_CODE_INTRO = "Below are Python source files. Read them, then answer the question that follows them.\n\n"
_CODE_TASKS = ("function_return", "caller", "class_of_method", "complete_body")
_BODY_MARKER = "...  # <BODY REMOVED>"


@dataclass
class _CodeQ:
    task: str
    func: _Func
    question: str
    answer: str
    aliases: list[str]
    span: tuple[int, int]  # lines that must be in the excerpt
    callee: str | None = None
    hole: tuple[int, int] | None = None  # lines replaced by the marker (complete_body)
    max_new_tokens: int = 32


def _code_candidates(P: _PyFile, task: str, label: str) -> list[_CodeQ]:
    out: list[_CodeQ] = []
    if task == "function_return":
        for f in P.funcs:
            if len(f.returns) != 1 or f.name.startswith("__"):
                continue
            v = f.returns[0].value
            if v is None or v.lineno != v.end_lineno:
                continue
            if isinstance(v, ast.Constant) and (v.value is None or isinstance(v.value, bool)):
                continue
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            seg = P.lines[v.lineno - 1].encode()[v.col_offset : v.end_col_offset].decode("utf-8", "replace")
            if not (2 <= len(seg) <= 80):
                continue
            who = f"method `{f.cls}.{f.name}`" if f.cls else f"function `{f.name}`"
            q = f"What does the {who} return? Answer with the returned expression exactly as it is written in the code."
            aliases = [ast.unparse(v)] if ast.unparse(v) != seg else []
            out.append(_CodeQ(task, f, q, seg, aliases, (f.cls_start or f.start, f.end), max_new_tokens=48))
    elif task == "caller":
        by_name: dict[str, set[int]] = {}
        for name, _line, fi in P.calls:
            by_name.setdefault(name, set()).add(fi)
        defined = {n for n, _ in P.defs}
        for name in sorted(by_name):
            fis = by_name[name]
            if len(fis) != 1 or -1 in fis or len(name) < 4 or name.startswith("__"):
                continue
            f = P.funcs[next(iter(fis))]
            if f.name == name or f.name.startswith("__") and f.name != "__init__":
                continue
            q = f"Which function or method in the code above calls `{name}`? Answer with its name only."
            aliases = [f.qualname] if f.qualname != f.name else []
            cq = _CodeQ(task, f, q, f.name, aliases, (f.start, f.end), callee=name, max_new_tokens=24)
            cq.defined_here = name in defined  # type: ignore[attr-defined]
            out.append(cq)
    elif task == "class_of_method":
        for f in P.funcs:
            if f.cls is None or f.name.startswith("__"):
                continue
            q = f"Which class defines the method `{f.name}`? Answer with the class name only."
            out.append(_CodeQ(task, f, q, f.cls, [], (f.cls_start, f.end), max_new_tokens=24))
    elif task == "complete_body":
        for f in P.funcs:
            s, e = f.body_start, f.end
            if f.n_body_stmts < 2 or s <= f.sig_end or (f.doc_end and s <= f.doc_end):
                continue
            if not (3 <= e - s + 1 <= 30):
                continue
            body = "".join(P.lines[s - 1 : e])
            indent = re.match(r"[ ]*", P.lines[s - 1]).group(0)
            if not indent:
                continue
            who = f"method `{f.cls}.{f.name}`" if f.cls else f"function `{f.name}`"
            q = (
                f"In the file {label}, the body of the {who} was removed and replaced by the line "
                f"`{_BODY_MARKER}`. Write the missing code, with its original indentation, and nothing else."
            )
            out.append(_CodeQ(task, f, q, body, [], (f.cls_start or f.start, f.end), hole=(s, e), max_new_tokens=0))
    else:
        raise ValueError(f"unknown code task {task!r}")
    return out


@dataclass
class _CodeSeg:
    f: _PyFile
    a: int  # first line (1-based)
    b: int  # last line (inclusive)
    hole: tuple[int, int] | None = None

    @property
    def partial(self) -> bool:
        return self.a > 1 or self.b < len(self.f.lines)

    def header(self) -> str:
        return f"### File: {self.f.label}{' (excerpt)' if self.partial else ''}\n```python\n"

    def body(self) -> str:
        ls = self.f.lines
        if self.hole:
            s, e = self.hole
            indent = re.match(r"[ ]*", ls[s - 1]).group(0)
            return "".join(ls[self.a - 1 : s - 1]) + indent + _BODY_MARKER + "\n" + "".join(ls[e : self.b])
        return "".join(ls[self.a - 1 : self.b])

    def render(self) -> str:
        return self.header() + self.body() + "```\n\n"

    def cost(self, counter: TokenCounter) -> int:
        c = self.f.line_counts(counter)
        n = sum(c[self.a - 1 : self.b])
        if self.hole:
            s, e = self.hole
            n -= sum(c[s - 1 : e])
            n += counter.count(_BODY_MARKER + "\n") + 2
        return n + counter.count(self.header()) + counter.count("```\n\n") + 2

    def visible(self, line: int) -> bool:
        if not (self.a <= line <= self.b):
            return False
        return not (self.hole and self.hole[0] <= line <= self.hole[1])


def _code_valid(q: _CodeQ, segs: list[_CodeSeg], primary: _PyFile) -> bool:
    """The question has exactly one answer in the text the segments show."""
    n_defs = 0
    callers: set[tuple[str, int]] = set()
    for s in segs:
        for name, line in s.f.defs:
            if name == q.func.name and s.visible(line):
                n_defs += 1
        if q.callee:
            for name, line, fi in s.f.calls:
                if name == q.callee and s.visible(line):
                    callers.add((s.f.path, fi))
    if n_defs != 1:
        return False
    if q.callee:
        return callers == {(primary.path, primary.funcs.index(q.func))}
    return True


def _code_prompt(segs: list[_CodeSeg], question: str) -> str:
    return _CODE_INTRO + "".join(s.render() for s in segs) + "Question: " + question


def _build_code(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                lengths: Sequence[int] = (1024, 2048, 4096, 8192), tasks: Sequence[str] = _CODE_TASKS,
                roots: Sequence[str] = ("stdlib",)) -> tuple[list[dict], dict]:
    tasks = list(tasks)
    for t in tasks:
        if t not in _CODE_TASKS:
            raise ValueError(f"unknown code task {t!r}; known: {list(_CODE_TASKS)}")
    lengths = _clamp_lengths(lengths, max_tokens)
    files = _code_files(tuple(roots))
    if not files:
        raise RuntimeError(f"no Python source files found under roots {list(roots)}")
    n = len(tasks) * len(lengths) if n is None else n
    items = [_code_item(i, seed, tasks[i % len(tasks)], lengths[(i // len(tasks)) % len(lengths)], files, counter)
             for i in range(n)]
    params = {"lengths": lengths, "tasks": tasks, "roots": list(roots), "candidate_files": len(files)}
    return items, params


def _code_item(i: int, seed: int, task: str, target: int, files, counter: TokenCounter) -> dict:
    rng = _rng("code", seed, i)
    for _attempt in range(60):
        path, label = files[rng.randrange(len(files))]
        P = _py_file(path, label)
        if P is None:
            continue
        cands = _code_candidates(P, task, label)
        if not cands:
            continue
        rng.shuffle(cands)
        if task == "caller":  # prefer callees that the file itself defines
            cands.sort(key=lambda c: not getattr(c, "defined_here", False))
        for q in cands[:3]:
            item = _code_try(i, rng, P, q, target, files, counter)
            if item is not None:
                return item
    raise RuntimeError(f"code workload: could not build item {i} (task {task}, {target} tokens)")


def _code_try(i, rng, P: _PyFile, q: _CodeQ, target: int, files, counter: TokenCounter) -> dict | None:
    qtext = "Question: " + q.question
    fixed = counter.count(_CODE_INTRO) + counter.count(qtext) + 2
    avail = target - fixed
    counts = P.line_counts(counter)
    seg = _CodeSeg(P, 1, len(P.lines), q.hole)
    if seg.cost(counter) > avail:
        # an excerpt: start at the top of the file or at a top-level statement, and reach q.span
        excerpt = _CodeSeg(P, 1, 1)  # any partial segment: for its header's cost
        over = counter.count(excerpt.header()) + counter.count("```\n\n") + 2
        budget = avail - over
        if q.hole:
            s, e = q.hole
            budget += sum(counts[s - 1 : e]) - counter.count(_BODY_MARKER + "\n") - 2  # the hole costs its marker
        starts = sorted({1, *[s for s in P.top_starts if s <= q.span[0]], q.span[0]})
        for a in starts:
            k = _prefix_fit(counts, a - 1, budget)
            if a + k - 1 >= q.span[1]:
                seg = _CodeSeg(P, a, a + k - 1, q.hole)
                break
        else:
            return None
        if seg.cost(counter) > avail:
            return None
    segs = [seg]
    if not _code_valid(q, segs, P):
        return None
    rem = avail - seg.cost(counter)
    slack = max(24, int(0.03 * target))
    used = {P.path}
    tries = 0
    while rem > slack and tries < 16:
        path, label = files[rng.randrange(len(files))]
        if path in used:
            tries += 1
            continue
        F = _py_file(path, label)
        if F is None:
            tries += 1
            continue
        fs = _CodeSeg(F, 1, len(F.lines))
        if fs.cost(counter) > rem:
            over = _CodeSeg(F, 1, 1).cost(counter) - F.line_counts(counter)[0]  # excerpt header
            k = _prefix_fit(F.line_counts(counter), 0, rem - over)
            if k < 8:
                tries += 1
                continue
            fs = _CodeSeg(F, 1, k)
        if not _code_valid(q, segs + [fs], P):
            tries += 1
            continue
        segs.append(fs)
        used.add(path)
        rem -= fs.cost(counter)
    adjustable = segs[-1]
    order = segs[1:]
    order.insert(rng.randrange(len(order) + 1), segs[0])

    def fits(b: int) -> bool:
        old = adjustable.b
        adjustable.b = b
        try:
            return counter.count(_code_prompt(order, q.question)) <= target
        finally:
            adjustable.b = old

    lo = q.span[1] if adjustable is segs[0] else adjustable.a + 4
    lo = max(lo, adjustable.a)
    if not fits(lo):
        return None
    planned = adjustable.b
    adjustable.b = _fit_search(lo, planned, len(adjustable.f.lines), fits)
    if not _code_valid(q, segs, P):
        adjustable.b = _max_true(lo, max(lo, min(planned, len(adjustable.f.lines))), fits)
        if not _code_valid(q, segs, P):
            return None
    prompt = _code_prompt(order, q.question)
    nt = counter.count(prompt)
    if nt > target or nt < math.ceil(target * (1 - LENGTH_TOLERANCE)):
        return None
    answer = q.answer
    mnt = q.max_new_tokens or min(768, int(counter.count(answer) * 1.5) + 16)
    source = {
        "files": [
            _source_record(s.f.path, label=s.f.label, lines=[s.a, s.b], total_lines=len(s.f.lines), primary=s is segs[0])
            for s in order
        ],
        "primary": P.path,
        "function": {"name": q.func.name, "qualname": q.func.qualname, "lines": [q.func.start, q.func.end]},
    }
    if q.callee:
        source["callee"] = q.callee
    if q.hole:
        source["removed_lines"] = list(q.hole)
    return _finish_item("code", i, q.task, prompt, "Question: " + q.question, answer, nt, target, mnt, source,
                        answer_aliases=q.aliases)


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


def _norm_space(text: str) -> str:
    return " " + " ".join(text.split()) + " "


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


def needle_found(answer_text: str, item: dict) -> bool:
    """True if the model's answer contains the needle's value (digits not glued to others)."""
    value = item["needle"]["value"] if "needle" in item else str(item["answer"])
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", answer_text or "") is not None


# ============================================================================ json_calls


_CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Berlin", "Cairo",
           "Seoul", "Madrid", "Denver", "Hanoi", "Lisbon", "Reykjavik", "Montreal", "Santiago", "Istanbul", "Dublin"]
_CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "INR", "BRL", "KRW", "SEK", "MXN"]
_PEOPLE = ["Alice Moreau", "Bilal Haddad", "Chen Wei", "Dara O'Neill", "Emeka Obi", "Freya Lund", "Gita Rao",
           "Hugo Silva", "Ines Costa", "Jonas Berg", "Keiko Sato", "Luis Ortega"]
_LANGS = {"English": "en", "French": "fr", "German": "de", "Spanish": "es", "Italian": "it", "Japanese": "ja",
          "Chinese": "zh", "Portuguese": "pt"}
_PHRASES = ["Where is the train station?", "I would like a cup of tea.", "The meeting is postponed until Friday.",
            "Thank you for your help.", "Please close the window.", "How much does this cost?",
            "The museum opens at nine.", "My flight was cancelled."]
_TICKERS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOGL", "IBM", "ORCL", "SAP", "SONY"]
_TOPICS = ["technology", "sports", "science", "business", "health", "politics"]
_COUNTRIES = {"France": "FR", "Japan": "JP", "Kenya": "KE", "Peru": "PE", "Norway": "NO", "Canada": "CA",
              "India": "IN", "Brazil": "BR"}
_TZS = ["Europe/Paris", "Asia/Tokyo", "America/New_York", "Africa/Nairobi", "Australia/Sydney", "America/Lima"]
_ROOMS = ["kitchen", "living_room", "bedroom", "bathroom", "office", "garage"]
_SONGS = [("Clair de Lune", "Claude Debussy"), ("Bohemian Rhapsody", "Queen"), ("So What", "Miles Davis"),
          ("Hey Jude", "The Beatles"), ("Hallelujah", "Leonard Cohen"), ("Dancing Queen", "ABBA")]
_TASKS_TODO = ["renew the passport", "call the plumber", "submit the quarterly report", "buy a birthday gift",
               "book a dentist appointment", "water the plants"]
_PKGS = ["numpy", "requests", "left-pad", "serde", "express", "pandas", "tokio", "lodash"]


def _date(rng) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng) -> str:
    return f"{rng.randint(7, 21):02d}:{rng.choice(['00', '15', '30', '45'])}"


def _S(desc, **kw):
    return {"type": "string", "description": desc, **kw}


def _I(desc, **kw):
    return {"type": "integer", "description": desc, **kw}


def _N(desc, **kw):
    return {"type": "number", "description": desc, **kw}


def _B(desc, **kw):
    return {"type": "boolean", "description": desc, **kw}


def _tool(name, desc, props, required):
    return {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}


def _g_weather(rng):
    city = rng.choice(_CITIES)
    if rng.random() < 0.5:
        unit = rng.choice(["celsius", "fahrenheit"])
        return {"location": city, "unit": unit}, f"What's the weather like in {city} right now? Give me the temperature in {unit}."
    return {"location": city}, f"Is it raining in {city} at the moment?"


def _g_currency(rng):
    a, b = rng.sample(_CURRENCIES, 2)
    amt = rng.choice([25, 120, 999.5, 1500, 42.75, 10000])
    return {"amount": amt, "from_currency": a, "to_currency": b}, f"How much is {amt} {a} in {b}?"


def _g_flight(rng):
    o, d = rng.sample(_CITIES, 2)
    date = _date(rng)
    args = {"origin": o, "destination": d, "date": date}
    req = f"Book me a flight from {o} to {d} on {date}"
    if rng.random() < 0.5:
        p = rng.randint(2, 5)
        args["passengers"] = p
        req += f" for {p} passengers"
    if rng.random() < 0.5:
        c = rng.choice(["premium_economy", "business", "first"])
        args["cabin"] = c
        req += f", {c.replace('_', ' ')} class"
    return args, req + "."


def _g_timer(rng):
    m = rng.choice([3, 5, 10, 12, 25, 45, 90])
    if rng.random() < 0.5:
        lab = rng.choice(["pasta", "laundry", "tea", "workout", "bread"])
        return {"minutes": m, "label": lab}, f"Set a {m} minute timer called \"{lab}\"."
    return {"minutes": m}, f"Start a timer for {m} minutes, please."


def _g_email(rng):
    who = rng.choice(_PEOPLE)
    addr = who.lower().replace(" ", ".").replace("'", "") + "@example.com"
    subj = rng.choice(["Quarterly numbers", "Lunch on Thursday", "Draft contract", "Travel plans"])
    body = rng.choice(["Please see the attached file.", "Are you free at noon?", "Let me know what you think.",
                       "I will be late tomorrow."])
    return ({"to": addr, "subject": subj, "body": body},
            f"Send an email to {addr} with the subject \"{subj}\" and the text \"{body}\"")


def _g_search(rng):
    qq = rng.choice(["history of the printing press", "best hiking trails in Patagonia", "how do vaccines work",
                     "python asyncio tutorial", "recipes with lentils"])
    if rng.random() < 0.5:
        k = rng.choice([3, 10, 20])
        return {"query": qq, "max_results": k}, f"Search the web for \"{qq}\" and show me the top {k} results."
    return {"query": qq}, f"Look up \"{qq}\" on the web."


def _g_event(rng):
    title = rng.choice(["Team sync", "Dentist", "Project review", "Yoga class", "Parent-teacher meeting"])
    date, t, dur = _date(rng), _time(rng), rng.choice([30, 45, 60, 90])
    return ({"title": title, "date": date, "start_time": t, "duration_minutes": dur},
            f"Put \"{title}\" in my calendar on {date} at {t} for {dur} minutes.")


def _g_translate(rng):
    lang = rng.choice(sorted(_LANGS))
    text = rng.choice(_PHRASES)
    return {"text": text, "target_language": _LANGS[lang]}, f"Translate \"{text}\" into {lang}."


def _g_stock(rng):
    t = rng.choice(_TICKERS)
    return {"ticker": t}, f"What is the current share price of {t}?"


def _g_tip(rng):
    bill = rng.choice([48.6, 120, 75.25, 33, 210.4])
    pct = rng.choice([10, 15, 18, 20, 22])
    return {"bill_amount": bill, "tip_percent": pct}, f"Our bill is {bill}. How much is a {pct}% tip?"


def _g_restaurants(rng):
    city = rng.choice(_CITIES)
    cuisine = rng.choice(["italian", "japanese", "mexican", "indian", "vegan", "ethiopian"])
    args = {"city": city, "cuisine": cuisine}
    req = f"Find {cuisine} restaurants in {city}"
    if rng.random() < 0.5:
        lvl = rng.randint(1, 4)
        args["max_price_level"] = lvl
        req += f" with a price level of at most {lvl}"
    return args, req + "."


def _g_music(rng):
    song, artist = rng.choice(_SONGS)
    if rng.random() < 0.5:
        return {"song": song, "artist": artist}, f"Play \"{song}\" by {artist}."
    return {"song": song}, f"Put on the song \"{song}\"."


def _g_lights(rng):
    room = rng.choice(_ROOMS)
    if rng.random() < 0.5:
        br = rng.choice([10, 30, 50, 75, 100])
        return {"room": room, "brightness": br}, f"Turn on the {room.replace('_', ' ')} lights at {br}% brightness."
    return {"room": room}, f"Switch on the lights in the {room.replace('_', ' ')}."


def _g_thermostat(rng):
    if rng.random() < 0.5:
        t = rng.choice([19, 20.5, 21, 22, 23.5])
        return {"temperature": t, "unit": "celsius"}, f"Set the thermostat to {t} degrees celsius."
    t = rng.choice([64, 68, 70, 72, 75])
    return {"temperature": t, "unit": "fahrenheit"}, f"Set the heating to {t} degrees fahrenheit."


def _g_directions(rng):
    o, d = rng.sample(["the central station", "the airport", "the city museum", "the harbour", "the university",
                       "the old town square"], 2)
    mode = rng.choice(["driving", "walking", "transit", "cycling"])
    verb = {"driving": "drive", "walking": "walk", "transit": "take public transit", "cycling": "cycle"}[mode]
    return {"origin": o, "destination": d, "mode": mode}, f"How do I {verb} from {o} to {d}?"


def _g_todo(rng):
    task = rng.choice(_TASKS_TODO)
    due = _date(rng)
    args = {"task": task, "due_date": due}
    req = f"Add \"{task}\" to my to-do list, due {due}"
    if rng.random() < 0.6:
        pr = rng.choice(["low", "high"])
        args["priority"] = pr
        req += f", {pr} priority"
    return args, req + "."


def _g_word(rng):
    w = rng.choice(["serendipity", "ephemeral", "quixotic", "ubiquitous", "sonder", "petrichor"])
    return {"word": w}, f"What does the word \"{w}\" mean?"


def _g_time(rng):
    tz = rng.choice(_TZS)
    return {"timezone": tz}, f"What time is it now in the {tz} time zone?"


def _g_pizza(rng):
    size = rng.choice(["small", "medium", "large"])
    tops = rng.sample(["mushrooms", "olives", "basil", "pepperoni", "onions", "peppers"], rng.randint(1, 3))
    deliv = rng.random() < 0.5
    how = "delivered to my home" if deliv else "for pickup"
    return ({"size": size, "toppings": tops, "delivery": deliv},
            f"Order a {size} pizza with {', '.join(tops)}, {how}.")


def _g_bmi(rng):
    w, h = rng.choice([58, 64.5, 72, 80, 95]), rng.choice([160, 168, 175, 182, 190])
    return {"weight_kg": w, "height_cm": h}, f"Compute the BMI of someone who weighs {w} kg and is {h} cm tall."


def _g_table(rng):
    r = rng.choice(["Chez Marie", "The Blue Door", "Sakura House", "La Trattoria", "Spice Route"])
    date, t, p = _date(rng), _time(rng), rng.randint(2, 8)
    return ({"restaurant": r, "date": date, "time": t, "party_size": p},
            f"Reserve a table for {p} at {r} on {date} at {t}.")


def _g_news(rng):
    topic = rng.choice(_TOPICS)
    country = rng.choice(sorted(_COUNTRIES))
    return {"topic": topic, "country": _COUNTRIES[country]}, f"Show me the latest {topic} news from {country}."


def _g_units(rng):
    v, a, b = rng.choice([(5, "miles", "kilometers"), (12, "inches", "centimeters"), (3.5, "liters", "gallons"),
                          (150, "pounds", "kilograms"), (2, "hours", "seconds")])
    return {"value": v, "from_unit": a, "to_unit": b}, f"Convert {v} {a} to {b}."


def _g_files(rng):
    d = rng.choice(["/home/me/projects", "/var/log", "/data/reports", "/srv/www"])
    pat = rng.choice(["*.py", "*.log", "*.csv", "*.md"])
    if rng.random() < 0.5:
        return {"directory": d, "pattern": pat, "recursive": True}, f"Find all {pat} files in {d} and its subfolders."
    return {"directory": d, "pattern": pat}, f"List the {pat} files in {d}."


def _g_sql(rng):
    db = rng.choice(["sales", "inventory", "hr"])
    q = rng.choice(["SELECT COUNT(*) FROM orders", "SELECT name FROM employees WHERE age > 40",
                    "SELECT SUM(amount) FROM invoices"])
    return {"database": db, "query": q}, f"Run the query `{q}` on the {db} database."


def _g_pkg(rng):
    pkg = rng.choice(_PKGS)
    reg = {"numpy": "pypi", "requests": "pypi", "pandas": "pypi", "left-pad": "npm", "express": "npm",
           "lodash": "npm", "serde": "crates", "tokio": "crates"}[pkg]
    name = {"pypi": "PyPI", "npm": "npm", "crates": "crates.io"}[reg]
    return {"package_name": pkg, "registry": reg}, f"What is the latest version of {pkg} on {name}?"


def _g_reminder(rng):
    msg = rng.choice(["take the medication", "call mom", "move the car", "join the webinar"])
    dt = f"{_date(rng)}T{_time(rng)}:00"
    return {"message": msg, "datetime": dt}, f"Remind me to {msg} at {dt}."


def _g_flight_status(rng):
    fl = rng.choice(["LH", "AF", "BA", "JL", "QF"]) + str(rng.randint(100, 999))
    return {"flight_number": fl}, f"Is flight {fl} on time?"


def _g_resize(rng):
    p = rng.choice(["photos/beach.jpg", "img/logo.png", "scans/page1.tiff"])
    w, h = rng.choice([(800, 600), (1024, 768), (256, 256), (1920, 1080)])
    return {"path": p, "width": w, "height": h}, f"Resize {p} to {w} by {h} pixels."


def _g_population(rng):
    c = rng.choice(sorted(_COUNTRIES))
    y = rng.choice([1950, 1990, 2000, 2020])
    return {"country": c, "year": y}, f"What was the population of {c} in {y}?"


_TOOLS: list[tuple[dict, Callable]] = [
    (_tool("get_weather", "Get the current weather for a location.",
           {"location": _S("City name, e.g. 'Paris'"),
            "unit": _S("Temperature unit", enum=["celsius", "fahrenheit"], default="celsius")}, ["location"]), _g_weather),
    (_tool("convert_currency", "Convert an amount of money from one currency to another.",
           {"amount": _N("Amount to convert"), "from_currency": _S("ISO 4217 code of the source currency"),
            "to_currency": _S("ISO 4217 code of the target currency")}, ["amount", "from_currency", "to_currency"]), _g_currency),
    (_tool("book_flight", "Book a one-way flight.",
           {"origin": _S("Departure city"), "destination": _S("Arrival city"), "date": _S("Date, YYYY-MM-DD"),
            "passengers": _I("Number of passengers", default=1),
            "cabin": _S("Cabin class", enum=["economy", "premium_economy", "business", "first"], default="economy")},
           ["origin", "destination", "date"]), _g_flight),
    (_tool("set_timer", "Start a countdown timer.",
           {"minutes": _I("Duration in minutes"), "label": _S("Optional name of the timer")}, ["minutes"]), _g_timer),
    (_tool("send_email", "Send an email.",
           {"to": _S("Recipient email address"), "subject": _S("Subject line"), "body": _S("Message text")},
           ["to", "subject", "body"]), _g_email),
    (_tool("search_web", "Search the web and return result snippets.",
           {"query": _S("Search query"), "max_results": _I("How many results to return", default=5)}, ["query"]), _g_search),
    (_tool("create_calendar_event", "Create an event in the user's calendar.",
           {"title": _S("Event title"), "date": _S("Date, YYYY-MM-DD"), "start_time": _S("Start time, HH:MM (24h)"),
            "duration_minutes": _I("Length of the event in minutes")}, ["title", "date", "start_time", "duration_minutes"]), _g_event),
    (_tool("translate_text", "Translate text into another language.",
           {"text": _S("Text to translate"),
            "target_language": _S("ISO 639-1 code of the target language", enum=sorted(_LANGS.values()))},
           ["text", "target_language"]), _g_translate),
    (_tool("get_stock_price", "Get the latest price of a stock.", {"ticker": _S("Stock ticker symbol")}, ["ticker"]), _g_stock),
    (_tool("calculate_tip", "Calculate the tip for a restaurant bill.",
           {"bill_amount": _N("Total of the bill"), "tip_percent": _N("Tip percentage, e.g. 15")},
           ["bill_amount", "tip_percent"]), _g_tip),
    (_tool("find_restaurants", "Find restaurants in a city.",
           {"city": _S("City name"), "cuisine": _S("Kind of food", enum=["italian", "japanese", "mexican", "indian", "vegan", "ethiopian"]),
            "max_price_level": _I("Highest price level, 1 (cheap) to 4 (expensive)", minimum=1, maximum=4)},
           ["city", "cuisine"]), _g_restaurants),
    (_tool("play_music", "Play a song on the user's speakers.",
           {"song": _S("Song title"), "artist": _S("Artist name")}, ["song"]), _g_music),
    (_tool("turn_on_lights", "Turn on the smart lights of a room.",
           {"room": _S("Room", enum=_ROOMS), "brightness": _I("Brightness in percent", minimum=0, maximum=100, default=100)},
           ["room"]), _g_lights),
    (_tool("set_thermostat", "Set the target temperature of the thermostat.",
           {"temperature": _N("Target temperature"), "unit": _S("Unit", enum=["celsius", "fahrenheit"])},
           ["temperature", "unit"]), _g_thermostat),
    (_tool("get_directions", "Get directions between two places.",
           {"origin": _S("Start"), "destination": _S("Goal"), "mode": _S("Travel mode", enum=["driving", "walking", "transit", "cycling"])},
           ["origin", "destination", "mode"]), _g_directions),
    (_tool("create_todo", "Add an item to the to-do list.",
           {"task": _S("What to do"), "due_date": _S("Due date, YYYY-MM-DD"),
            "priority": _S("Priority", enum=["low", "medium", "high"], default="medium")}, ["task", "due_date"]), _g_todo),
    (_tool("lookup_word", "Look up the definition of an English word.", {"word": _S("The word")}, ["word"]), _g_word),
    (_tool("get_time_in_timezone", "Get the current local time in a time zone.",
           {"timezone": _S("IANA time zone name, e.g. Europe/Paris")}, ["timezone"]), _g_time),
    (_tool("order_pizza", "Order a pizza.",
           {"size": _S("Pizza size", enum=["small", "medium", "large"]),
            "toppings": {"type": "array", "items": {"type": "string"}, "description": "Toppings"},
            "delivery": _B("Deliver (true) or pick up (false)")}, ["size", "toppings", "delivery"]), _g_pizza),
    (_tool("compute_bmi", "Compute the body mass index.",
           {"weight_kg": _N("Weight in kilograms"), "height_cm": _N("Height in centimeters")}, ["weight_kg", "height_cm"]), _g_bmi),
    (_tool("reserve_table", "Reserve a table at a restaurant.",
           {"restaurant": _S("Restaurant name"), "date": _S("Date, YYYY-MM-DD"), "time": _S("Time, HH:MM (24h)"),
            "party_size": _I("Number of guests")}, ["restaurant", "date", "time", "party_size"]), _g_table),
    (_tool("get_news", "Get the latest news headlines.",
           {"topic": _S("Topic", enum=_TOPICS), "country": _S("ISO 3166-1 alpha-2 country code")}, ["topic", "country"]), _g_news),
    (_tool("convert_units", "Convert a value between units of measurement.",
           {"value": _N("Value to convert"), "from_unit": _S("Unit of the value"), "to_unit": _S("Unit to convert to")},
           ["value", "from_unit", "to_unit"]), _g_units),
    (_tool("search_files", "Find files matching a glob pattern.",
           {"directory": _S("Directory to search"), "pattern": _S("Glob pattern, e.g. *.txt"),
            "recursive": _B("Also search subdirectories", default=False)}, ["directory", "pattern"]), _g_files),
    (_tool("run_sql_query", "Run a read-only SQL query.",
           {"database": _S("Database name", enum=["sales", "inventory", "hr"]), "query": _S("SQL query")},
           ["database", "query"]), _g_sql),
    (_tool("get_package_info", "Get information about a software package.",
           {"package_name": _S("Package name"), "registry": _S("Package registry", enum=["pypi", "npm", "crates"])},
           ["package_name", "registry"]), _g_pkg),
    (_tool("schedule_reminder", "Schedule a reminder notification.",
           {"message": _S("Reminder text"), "datetime": _S("When, ISO 8601 YYYY-MM-DDTHH:MM:SS")}, ["message", "datetime"]), _g_reminder),
    (_tool("check_flight_status", "Check the status of a flight.", {"flight_number": _S("Flight number, e.g. LH123")},
           ["flight_number"]), _g_flight_status),
    (_tool("resize_image", "Resize an image file.",
           {"path": _S("Image path"), "width": _I("New width in pixels"), "height": _I("New height in pixels")},
           ["path", "width", "height"]), _g_resize),
    (_tool("get_population", "Get the population of a country in a given year.",
           {"country": _S("Country name"), "year": _I("Year")}, ["country", "year"]), _g_population),
]

_JSON_INTRO = "You are a function-calling assistant. You can use the following tools, described as JSON schemas:\n"
_JSON_RULES = (
    "\nTo use a tool, reply with exactly one JSON object of the form "
    '{"name": <tool name>, "arguments": {<argument>: <value>, ...}} and nothing else. '
    "Include every required argument; include optional arguments only if the request gives them.\n\n"
)


def _build_json_calls(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                      tool_counts: Sequence[int] = (4, 8, 16, 30)) -> tuple[list[dict], dict]:
    tool_counts = [int(c) for c in tool_counts]
    if any(not (1 <= c <= len(_TOOLS)) for c in tool_counts):
        raise ValueError(f"tool_counts must be in [1, {len(_TOOLS)}], got {tool_counts}")
    n = 2 * len(_TOOLS) if n is None else n
    items = [_json_item(i, seed, tool_counts[i % len(tool_counts)], max_tokens, counter) for i in range(n)]
    return items, {"tool_counts": tool_counts, "library_size": len(_TOOLS), "generator": "synthetic tool library"}


def _json_item(i: int, seed: int, n_tools: int, max_tokens: int, counter: TokenCounter) -> dict:
    rng = _rng("json_calls", seed, i)
    ti = i % len(_TOOLS) if i < 2 * len(_TOOLS) else rng.randrange(len(_TOOLS))  # every tool is a target
    schema, gen = _TOOLS[ti]
    args, request = gen(rng)
    others = [j for j in range(len(_TOOLS)) if j != ti]
    chosen = rng.sample(others, n_tools - 1) + [ti]
    rng.shuffle(chosen)
    question = "User request: " + request
    while True:
        tools = [_TOOLS[j][0] for j in chosen]
        prompt = _JSON_INTRO + json.dumps(tools, indent=1) + _JSON_RULES + question
        nt = counter.count(prompt)
        if nt <= max_tokens:
            break
        if len(chosen) == 1:
            raise ValueError(f"json_calls: max_tokens {max_tokens} is too small for one tool ({nt} tokens)")
        chosen.remove(next(j for j in chosen if j != ti))
    call = {"name": schema["name"], "arguments": args}
    source = {"generator": "sglang_vc.bench.workloads synthetic tool library", "tools": [t["name"] for t in tools],
              "target_tool": schema["name"]}
    return _finish_item("json_calls", i, "json_call", prompt, question, json.dumps(call), nt, None, 96, source,
                        call=call, tools=tools)


def extract_json_call(text: str) -> dict | None:
    """The first JSON object in ``text`` that looks like a tool call, normalised to
    ``{"name": str, "arguments": dict}`` (accepts ``parameters`` for ``arguments``, an
    OpenAI-style ``{"function": {...}}`` wrapper and arguments given as a JSON string)."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text or ""):
        try:
            obj, _ = dec.raw_decode(text, m.start())
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "function" in obj and isinstance(obj["function"], dict):
            obj = obj["function"]
        if not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if not isinstance(args, dict):
            continue
        return {"name": obj["name"], "arguments": args}
    return None


def _same_value(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(b, str) and str(a).lower() == b.strip().lower())
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, (int, float)) and isinstance(b, str):
        try:
            return math.isclose(float(a), float(b.strip()), rel_tol=1e-9, abs_tol=1e-9)
        except ValueError:
            return False
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().rstrip(".").casefold() == b.strip().rstrip(".").casefold()
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(str, a)) == sorted(map(str, b)) if len(a) == len(b) else False
    return a == b


def json_call_score(answer_text: str, item: dict) -> dict:
    """Parse the model's call and compare it with the expected one.

    Returns ``{"parsed", "name_ok", "args_ok", "score", "call"}``: ``args_ok`` requires every
    expected argument with an equal value (numbers by value, strings case-insensitively,
    lists as multisets) and no other argument unless it equals the schema's default.
    ``score`` is 1.0 for name and arguments right, 0.5 for the name only, else 0.0.
    """
    expected = item.get("call") or json.loads(item["answer"])
    call = extract_json_call(answer_text)
    if call is None:
        return {"parsed": False, "name_ok": False, "args_ok": False, "score": 0.0, "call": None}
    name_ok = call["name"] == expected["name"]
    args_ok = False
    if name_ok:
        props = {}
        for t in item.get("tools") or [s for s, _ in _TOOLS]:
            if t["name"] == expected["name"]:
                props = t["parameters"]["properties"]
        got, exp = call["arguments"], expected["arguments"]
        args_ok = all(k in got and _same_value(v, got[k]) for k, v in exp.items())
        for k, v in got.items():
            if k not in exp and not ("default" in props.get(k, {}) and _same_value(props[k]["default"], v)):
                args_ok = False
    return {"parsed": True, "name_ok": name_ok, "args_ok": args_ok,
            "score": 1.0 if name_ok and args_ok else 0.5 if name_ok else 0.0, "call": call}


# ============================================================================ scoring


def _norm_words(text: str) -> list[str]:
    return re.findall(r"[\w']+", (text or "").casefold())


def _quote_score(output: str, answer: str) -> float:
    a = _norm_words(answer)
    o = _norm_words(output)
    if not a:
        return 0.0
    best = 0
    for s in range(len(o)):
        k = 0
        while k < len(a) and s + k < len(o) and o[s + k] == a[k]:
            k += 1
        best = max(best, k)
    return best / len(a)


def score(item: dict, output: str) -> float:
    """Task metric in [0, 1] for one model output, or NaN where the item has no answer metric.

    needle: needle found; json_call: :func:`json_call_score`; code name/expression tasks and
    which_document: exact answer (or alias) present; quote_completion: longest run of the
    expected continuation's words found in order, as a fraction; complete_body: a
    character-level similarity ratio to the removed body (difflib).
    """
    task = item["task"]
    if task == "passkey":
        return float(needle_found(output, item))
    if task == "json_call":
        return json_call_score(output, item)["score"]
    if task in _RAG_TASKS:  # exact match: the code is the first word of the answer
        words = re.findall(r"[A-Z]\d{4}", output or "")
        return float(bool(words) and words[0] == item["answer"])
    if item.get("answer") is None:
        return float("nan")
    answers = [item["answer"], *item.get("answer_aliases", [])]
    out = output or ""
    if task in ("caller", "class_of_method"):
        return float(any(re.search(rf"(?<![\w.]){re.escape(a)}(?!\w)", out) for a in answers))
    if task == "function_return":
        o = re.sub(r"\s+", "", out.replace("`", ""))
        return float(any(re.sub(r"\s+", "", a) in o for a in answers))
    if task == "which_document":
        m = re.search(r"\d+", out)
        return float(bool(m) and m.group(0) == item["answer"])
    if task == "quote_completion":
        return _quote_score(out, item["answer"])
    if task == "complete_body":
        import difflib

        return difflib.SequenceMatcher(None, out.strip("\n"), item["answer"].strip("\n"), autojunk=False).ratio()
    raise ValueError(f"no scorer for task {task!r}")


# ============================================================================ rag


_RAG_INTRO = "Answer the question from the passages below. Reply with the code only.\n"
_RAG_TASKS = ("rag_fact", "rag_two_hop")
_RAG_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
              "kestrel", "lumen", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sierra", "tundra")


def _rag_name(rng) -> str:
    return rng.choice(_RAG_WORDS).capitalize() + rng.choice(_RAG_WORDS) + f"-{rng.randrange(10, 99)}"


def _rag_code(rng) -> str:
    return f"{rng.choice('BCDFGHKMNPRSTVXZ')}{rng.randrange(1000, 9999)}"


def _build_rag(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
               chunks: int = 4, chunk_tokens: int = 256, tasks: Sequence[str] = _RAG_TASKS,
               kinds: Sequence[str] = _DOC_KINDS, min_prose: float = 0.3) -> tuple[list[dict], dict]:
    """RAG QA: ``chunks`` retrieved passages of about ``chunk_tokens`` tokens of real
    text (consecutive lines of a document), a synthetic fact inserted into one passage
    (``rag_fact``) or two linked facts into two (``rag_two_hop``), the others being
    distractors; the answer is a code. ``chunks`` in the item are the passages exactly as
    they appear in the prompt (``prompt == chunk_prefix + "".join(chunks) + question``)."""
    tasks = list(tasks)
    for t in tasks:
        if t not in _RAG_TASKS:
            raise ValueError(f"unknown rag task {t!r}; known: {list(_RAG_TASKS)}")
    if chunks < 2 or chunk_tokens < 32:
        raise ValueError(f"rag: need chunks >= 2 and chunk_tokens >= 32, got {chunks}, {chunk_tokens}")
    chunk_tokens = min(chunk_tokens, (max_tokens - 64) // chunks)  # clamped to the prompt budget
    if chunk_tokens < 32:
        raise ValueError(f"rag: {chunks} chunks do not fit max_tokens {max_tokens}")
    docs = [d for d in _doc_pool(tuple(kinds)) if d.prose >= min_prose]
    if not docs:
        raise RuntimeError(f"rag workload: no documents of kinds {list(kinds)} on this machine")
    n = 2 * len(tasks) if n is None else n
    items = [_rag_item(i, seed, tasks[i % len(tasks)], chunks, chunk_tokens, docs, counter) for i in range(n)]
    return items, {"chunks": chunks, "chunk_tokens": chunk_tokens, "tasks": tasks, "kinds": list(kinds),
                   "min_prose": min_prose}


def _rag_passage(rng, docs, counter: TokenCounter, budget: int) -> tuple[str, dict]:
    """Consecutive lines of a random document, as many as fit ``budget`` tokens."""
    for _attempt in range(50):
        doc = rng.choice(docs)
        counts = doc.line_counts(counter)
        start = rng.randrange(len(doc.lines))
        end, total = start, 0.0
        while end < len(doc.lines) and total + counts[end] + 1 <= budget:
            total += counts[end] + 1
            end += 1
        text = _norm_space(" ".join(doc.lines[start:end])).strip()
        if len(text.split()) >= 12:
            return text, _source_record(doc.path, kind=doc.kind, title=doc.title, lines=[start + 1, end])
    raise RuntimeError("rag workload: no passage of enough words found")


def _rag_insert(rng, text: str, fact: str) -> str:
    """``fact`` put between two sentences of ``text`` (or at its end)."""
    cuts = [m.end() for m in re.finditer(r"[.;:!?] ", text)]
    at = rng.choice(cuts) if cuts else len(text)
    return (text[:at] + fact + " " + text[at:]).strip()


def _rag_item(i: int, seed: int, task: str, n_chunks: int, chunk_tokens: int, docs, counter: TokenCounter) -> dict:
    rng = _rng("rag", seed, i)
    name, team, code = _rag_name(rng), _rag_name(rng), _rag_code(rng)
    passages, sources = [], []
    for _ in range(n_chunks):
        text, src = _rag_passage(rng, docs, counter, chunk_tokens - 24)
        passages.append(text)
        sources.append(src)
    where = rng.sample(range(n_chunks), 2)
    if task == "rag_fact":
        passages[where[0]] = _rag_insert(rng, passages[where[0]], f"The archive code of project {name} is {code}.")
        question = f"\nQuestion: what is the archive code of project {name}?\nAnswer:"
        hops = [where[0]]
    else:
        passages[where[0]] = _rag_insert(rng, passages[where[0]], f"Project {name} is maintained by the {team} team.")
        passages[where[1]] = _rag_insert(rng, passages[where[1]], f"The archive code of the {team} team is {code}.")
        question = f"\nQuestion: what is the archive code of the team that maintains project {name}?\nAnswer:"
        hops = where
    chunk_texts = [f"\nPassage {k + 1}: {p}\n" for k, p in enumerate(passages)]
    prompt = _RAG_INTRO + "".join(chunk_texts) + question
    # not a length-targeted workload: chunk_tokens bounds each passage
    return _finish_item("rag", i, task, prompt, question, code, counter.count(prompt), None, 8, {"documents": sources}, chunks=chunk_texts, chunk_prefix=_RAG_INTRO, answer_chunks=hops)


def token_f1(output: str, answer: str) -> float:
    """SQuAD-style token F1 between the first line of ``output`` and ``answer``."""
    import collections

    first = (output or "").strip().split("\n")[0]
    pred = re.findall(r"\w+", first.lower())
    gold = re.findall(r"\w+", answer.lower())
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if not pred or not gold or not common:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


# ============================================================================ registry


class Workload(list):
    """The items of a workload (a list of dicts) with ``name`` and ``provenance``."""

    def __init__(self, name: str, items: Iterable[dict], provenance: dict):
        super().__init__(items)
        self.name = name
        self.provenance = provenance


_BUILDERS: dict[str, tuple[Callable, str]] = {
    "code": (_build_code, "real Python files (stdlib) + AST-derived questions (return value, caller, class of method, removed body)"),
    "reading": (_build_reading, "license texts and package documentation + quote completion / which-document questions"),
    "needle": (_build_needle, "passkey needle in a real-text haystack at several lengths and depths"),
    "json_calls": (_build_json_calls, "JSON tool schemas + a user request; answer is one JSON call"),
    "rag": (_build_rag, "RAG QA: real-text passages as retrieved chunks, one (or two linked) synthetic facts; answer is a code"),
}


def list_workloads() -> list[str]:
    """Names accepted by :func:`load_workload`."""
    return list(_BUILDERS)


def describe_workloads() -> dict[str, str]:
    return {k: v[1] for k, v in _BUILDERS.items()}


def _items_sha256(items: Iterable[dict]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def _collect_sources(items: Sequence[dict]) -> list[dict]:
    seen: dict[str, dict] = {}
    for it in items:
        src = it.get("source", {})
        for key in ("files", "documents", "haystack"):
            for rec in src.get(key, []):
                r = seen.get(rec["path"])
                if r is None:
                    r = seen[rec["path"]] = {k: rec[k] for k in ("path", "size", "sha256", "license")}
                    for k in ("kind", "title", "label"):
                        if k in rec:
                            r[k] = rec[k]
                    r["used_by_items"] = 0
                r["used_by_items"] += 1
    return sorted(seen.values(), key=lambda r: r["path"])


def load_workload(name: str, tokenizer: Any = None, max_tokens: int = DEFAULT_MAX_TOKENS, n: int | None = None,
                  seed: int = 0, **params) -> Workload:
    """Build (or read) a workload.

    ``name``: one of :func:`list_workloads`, or the path of a JSONL file written by
    :func:`write_workload` / ``benchmark/workloads/build.py`` (then read as is; ``n``
    keeps the first n items). ``tokenizer``: ``None`` (approximate token counts), a
    tokenizer directory or a tokenizer object. ``max_tokens``: prompt budget in tokens.
    ``n``: number of items (default: one pass over the workload's grid). ``params``:
    workload-specific options (``lengths``, ``depths``, ``tasks``, ``roots``, ``kinds``,
    ``tool_counts``, ``digits``); unknown ones raise ``TypeError``.
    """
    if isinstance(name, (str, os.PathLike)) and str(name).endswith(".jsonl") and os.path.exists(name):
        items = read_jsonl(name)
        prov_path = str(name)[: -len(".jsonl")] + ".provenance.json"
        prov = json.loads(Path(prov_path).read_text()) if os.path.exists(prov_path) else {}
        return Workload(prov.get("workload", Path(name).stem), items[:n] if n is not None else items, prov)
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(list_workloads())}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < MIN_TARGET:
        raise ValueError(f"max_tokens must be an integer >= {MIN_TARGET}, got {max_tokens!r}")
    max_tokens = int(max_tokens)
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        n = int(n)
    counter = _get_counter(tokenizer)
    builder = _BUILDERS[name][0]
    items, resolved = builder(counter, max_tokens, n, int(seed), **params)
    over = [it["id"] for it in items if it["n_tokens"] > max_tokens]
    assert not over, f"prompts over max_tokens: {over}"
    prov = {
        "workload": name,
        "description": _BUILDERS[name][1],
        "version": WORKLOADS_VERSION,
        "generator": "sglang_vc.bench.workloads",
        "seed": int(seed),
        "n": len(items),
        "max_tokens": max_tokens,
        "params": resolved,
        "token_count": counter.describe(),
        "length_tolerance": LENGTH_TOLERANCE,
        "python": sys.version.split()[0],
        "sources": _collect_sources(items),
        "items_sha256": _items_sha256(items),
        "n_tokens": _stats([it["n_tokens"] for it in items]),
    }
    return Workload(name, items, prov)


def _stats(xs: Sequence[int]) -> dict:
    if not xs:
        return {}
    return {"min": min(xs), "max": max(xs), "mean": round(sum(xs) / len(xs), 1), "total": sum(xs)}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def write_workload(wl: Workload, out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``<name>.jsonl`` and ``<name>.provenance.json`` into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp = out / f"{wl.name}.jsonl"
    buf = io.StringIO()
    for it in wl:
        buf.write(json.dumps(it, ensure_ascii=False) + "\n")
    jp.write_text(buf.getvalue(), encoding="utf-8")
    size, sha = len(buf.getvalue().encode()), hashlib.sha256(buf.getvalue().encode()).hexdigest()
    prov = dict(wl.provenance, output={"path": str(jp), "size": size, "sha256": sha})
    pp = out / f"{wl.name}.provenance.json"
    pp.write_text(json.dumps(prov, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"jsonl": str(jp), "provenance": str(pp)}
