"""Workload ``code``: real Python source files (the standard library by default) and a
question derived from a file's AST (what a function returns, which function calls a name,
which class defines a method, or the removed body of a function).
"""

from __future__ import annotations

import ast
import functools
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .common import (
    LENGTH_TOLERANCE, TokenCounter, _clamp_lengths, _finish_item, _fit_search, _lines, _max_true,
    _prefix_fit, _purelib_dir, _rng, _source_record, _stdlib_dir,
)


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
