"""The docs a newcomer reads first stay short and their commands stay runnable.

No server, no network: the tables and lines of README.md, docs/status.md and docs/flags.md
are measured, and every ``python -m sglang_vc.<module>`` / ``make <target>`` line in their
fenced code blocks is checked against the module (it exists, each ``--flag`` is in its
``--help``) or the Makefile (the target exists). docs/flags.md lists every project flag
the launcher's ``--help`` shows, and names no flag it does not accept.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS_MD = ROOT / "docs" / "flags.md"
DOCS = [ROOT / "README.md", ROOT / "docs" / "status.md", FLAGS_MD]
LAUNCHER = "sglang_vc.launch_server"
# The prefixes of the project's own server flags (sglang_vc.config.FLAG_PREFIXES): every
# flag the launcher's own parser adds begins with one of them (checked below)
PROJECT_FLAG_PREFIXES = ("--vc-", "--specache-", "--evicpress-", "--speccache-")

MAX_CELL_CHARS = 240   # a table cell, Markdown included
MAX_LINE_CHARS = 400   # a line of prose outside tables and code blocks
HELP_TIMEOUT_S = 300   # `python -m <module> --help` (launch_server imports SGLang)

MODULE_RE = re.compile(r"python[0-9.]*\s+-m\s+(sglang_vc(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
MAKE_RE = re.compile(r"(?:^|[\s;&|(])make\s+([A-Za-z0-9_.-]+)")
FLAG_RE = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9-]*")
# an option line of argparse's help ("  --flag METAVAR, --alias METAVAR   help..."): its names
OPTION_LINE_RE = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)", re.M)
# a whole --flag in text (not a wildcard such as --evicpress-*, nor a piece of a word)
NAMED_FLAG_RE = re.compile(r"(?<![\w-])--[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?![\w*-])")


def _split_blocks(text: str):
    """(prose_lines, code_blocks): lines outside fences, and each fenced block's lines."""
    prose, blocks, current = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
            continue
        if current is None:
            prose.append(line)
        else:
            current.append(line)
    return prose, blocks


def _cells(line: str):
    """A table row's cells; a `|` inside backticks or escaped is not a separator."""
    row = line.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    cells, buf, in_code, prev = [], [], False, ""
    for ch in row:
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code and prev != "\\":
            cells.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        prev = ch
    cells.append("".join(buf))
    return [c.strip() for c in cells]


def _commands(block):
    """Logical lines of a code block (backslash continuations joined), comments cut."""
    out, buf = [], ""
    for line in block:
        s = line.rstrip()
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        out.append(buf + s)
        buf = ""
    if buf:
        out.append(buf)
    return out


def _segments(command: str):
    """The shell pieces of a line (split at ;, &&, ||, |), its comment removed."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    segs, cur = [], []
    for tok in tokens:
        if tok and set(tok) <= set(";&|"):
            segs.append(cur)
            cur = []
        else:
            cur.append(tok)
    segs.append(cur)
    return [s for s in segs if s]


def _module_invocations(path: Path):
    """(module, flags, line) for each `python -m sglang_vc.X ...` in the file's code blocks."""
    _, blocks = _split_blocks(path.read_text())
    found = []
    for block in blocks:
        for line in _commands(block):
            for seg in _segments(line):
                for i, tok in enumerate(seg[:-2]):
                    if re.fullmatch(r"python[0-9.]*|\S*/python[0-9.]*", tok) and seg[i + 1] == "-m" \
                            and seg[i + 2].startswith("sglang_vc"):
                        flags = sorted({FLAG_RE.match(t).group(0) for t in seg[i + 3:] if FLAG_RE.match(t)})
                        found.append((seg[i + 2], flags, line.strip()))
    return found


def _make_targets_used(path: Path):
    _, blocks = _split_blocks(path.read_text())
    found = []
    for block in blocks:
        for line in _commands(block):
            for seg in _segments(line):
                if seg[0] == "make" and len(seg) > 1 and not seg[1].startswith("-") and "=" not in seg[1]:
                    found.append((seg[1], line.strip()))
    return found


def _makefile_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M))


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
    env = dict(os.environ)
    extra = [str(ROOT / "python"), str(ROOT / "sgl-kernel-ext" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, env=env, cwd=ROOT)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_table_cells_and_lines_are_short(path):
    prose, _ = _split_blocks(path.read_text())
    long_cells, long_lines = [], []
    for n, line in enumerate(prose, 1):
        if line.lstrip().startswith("|"):
            for cell in _cells(line):
                if len(cell) > MAX_CELL_CHARS:
                    long_cells.append(f"{len(cell)} chars: {cell[:80]}...")
        elif len(line) > MAX_LINE_CHARS:
            long_lines.append(f"{len(line)} chars: {line[:80]}...")
    assert not long_cells, f"{path.name}: cells over {MAX_CELL_CHARS} chars:\n" + "\n".join(long_cells)
    assert not long_lines, f"{path.name}: lines over {MAX_LINE_CHARS} chars:\n" + "\n".join(long_lines)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_make_targets_exist(path):
    targets = _makefile_targets()
    missing = [f"make {t}  ({line})" for t, line in _make_targets_used(path) if t not in targets]
    assert not missing, f"{path.name}: Makefile has no such target:\n" + "\n".join(missing)


def _invocations():
    seen = []
    for path in DOCS:
        for module, flags, line in _module_invocations(path):
            seen.append(pytest.param(module, flags, line, id=f"{path.name}:{module}"))
    return seen


@pytest.mark.parametrize("module,flags,line", _invocations() or [pytest.param(None, [], "", id="none")])
def test_documented_commands_run(module, flags, line):
    if module is None:
        pytest.skip("no sglang_vc command in the docs")
    sys.path[:0] = [p for p in (str(ROOT / "python"), str(ROOT / "sgl-kernel-ext" / "python")) if p not in sys.path]
    assert importlib.util.find_spec(module) is not None, f"no module {module}: {line}"
    if not flags:
        return
    text = _help(module)
    known = set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9-]*", text))
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{module} --help lists none of {unknown}: {line}\n(help tail: {text[-300:]})"


def _measured_paragraphs(text: str) -> list[str]:
    """README.md's "Measured..." paragraphs, each joined into one line."""
    out, current = [], None
    for line in text.splitlines() + [""]:
        if line.startswith("Measured"):
            current = [line]
        elif current is not None:
            if not line.strip():
                out.append(" ".join(current))
                current = None
            else:
                current.append(line)
    return out


@pytest.mark.parametrize("paragraph", _measured_paragraphs((ROOT / "README.md").read_text()),
                         ids=lambda p: p[:40])
def test_readme_figures_are_the_benchmark_pages(paragraph):
    """Each figure the README says was measured is one of benchmark/README.md's latest
    runs: a headline left behind by a newer run fails here."""
    page = (ROOT / "benchmark" / "README.md").read_text()
    text = paragraph.split("](")[0]  # (not the numbers in a link's target)
    figures = re.findall(r"\d+\.\d+", text)
    assert figures, paragraph
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", page)]
    assert not missing, f"{missing} of {paragraph!r} are not in benchmark/README.md"


def _option_names(help_text: str) -> set[str]:
    """The --flags an argparse help text defines (its option lines, aliases included)."""
    return {name for line in OPTION_LINE_RE.findall(help_text) for name in NAMED_FLAG_RE.findall(line)}


def _launcher_flags() -> tuple[set[str], set[str]]:
    """(own, known): the flags the launcher's own parser adds (the first part of its
    ``--help``, printed before SGLang's), and every flag its ``--help`` defines."""
    text = _help(LAUNCHER)
    parts = re.split(r"^usage: ", text, flags=re.M)
    assert len(parts) >= 3, f"{LAUNCHER} --help printed no two usages (its own, SGLang's):\n{text[-600:]}"
    return _option_names(parts[1]), _option_names(text)


def _flags_md_rows() -> list[list[str]]:
    prose, _ = _split_blocks(FLAGS_MD.read_text())
    return [_cells(line) for line in prose if line.lstrip().startswith("|")]


def test_flags_md_lists_every_project_flag():
    """Each project flag ``--help`` shows is the first cell of a docs/flags.md table row,
    as a code span; each --flag docs/flags.md names in a code span is one ``--help``
    accepts (no stale flag); and the launcher's own flags all carry a project prefix."""
    own, known = _launcher_flags()
    assert own, f"{LAUNCHER} --help shows no project flag"
    unprefixed = sorted(f for f in own if not f.startswith(PROJECT_FLAG_PREFIXES))
    assert not unprefixed, f"the launcher adds flags outside PROJECT_FLAG_PREFIXES: {unprefixed}"
    project = {f for f in known if f.startswith(PROJECT_FLAG_PREFIXES)}
    assert own <= project
    listed = {row[0][1:-1] for row in _flags_md_rows()
              if re.fullmatch(r"`--[A-Za-z0-9-]+`", row[0])}
    missing = sorted(project - listed)
    assert not missing, ("docs/flags.md has no table row for these flags of "
                         f"{LAUNCHER} --help (first cell `--flag`): {missing}")
    named = {flag for span in re.findall(r"`([^`]+)`", FLAGS_MD.read_text())
             for flag in NAMED_FLAG_RE.findall(span)}
    stale = sorted(named - known)
    assert not stale, f"docs/flags.md names flags {LAUNCHER} --help does not accept: {stale}"


@pytest.mark.parametrize("page, limit", [("README.md", 150), ("benchmark/README.md", 600)])
def test_the_first_pages_stay_short(page, limit):
    """The README is a quick start; the benchmark page is each benchmark's latest run (its
    history is git's)."""
    lines = (ROOT / page).read_text().count("\n")
    assert lines < limit, f"{page}: {lines} lines, the limit is {limit}"
