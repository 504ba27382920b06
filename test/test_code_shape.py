"""The shape #79 asks of the mechanisms' code, checked on the source: no function over
100 lines in ``vericache/`` and ``evicpress/`` (80 on the VERICACHE iteration's path), no
mixin classes there (parts are composed), and the attention backend reaches no worker
module (a forward's faults are its results, not calls back into the worker)."""

from __future__ import annotations

import ast
import pathlib

import sglang_vc

ROOT = pathlib.Path(sglang_vc.__file__).parent
MECHANISMS = ("vericache", "evicpress")
# the VERICACHE iteration: plan -> forward -> commit, and what it calls per request
ITERATION = ("staggered_round.py", "lockstep.py", "forward_layout.py", "request_modes.py",
             "verifier_staging.py", "restore.py", "iteration.py", "forward_plan.py", "overlapped.py")
# bases that are types, not behaviour (an enum of strings, a protocol)
NOT_MIXINS = {"str", "int", "Enum", "enum.Enum", "IntEnum", "enum.IntEnum", "Protocol", "Generic", "NamedTuple"}


def _modules():
    for name in MECHANISMS:
        yield from sorted((ROOT / name).rglob("*.py"))


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_over_100_lines_and_the_iteration_under_80():
    long = []
    for path in _modules():
        limit = 80 if path.parent.name == "vericache" and path.name in ITERATION else 100
        for fn in _functions(ast.parse(path.read_text())):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > limit:
                long.append(f"{path.relative_to(ROOT)}:{fn.name} {lines} > {limit}")
    assert not long, long


def test_no_mixin_classes():
    mixins = []
    for path in _modules():
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            behaviour = [ast.unparse(b) for b in cls.bases if ast.unparse(b) not in NOT_MIXINS]
            if len(behaviour) > 1:
                mixins.append(f"{path.relative_to(ROOT)}:{cls.name}({', '.join(behaviour)})")
    assert not mixins, mixins


def test_the_attention_backend_reaches_no_worker_module():
    """What a VERICACHE forward's attention calls (the backend, the staging, the reloads
    and their failure path) imports none of the worker's modules: nothing in a forward
    can call back into the worker."""
    worker_side = {"worker", "staggered_round", "lockstep", "overlapped", "request_modes", "verifier_staging"}
    for name in ("attention.py", "staging.py", "reload.py", "restore.py", "forward_plan.py", "view_rows.py"):
        tree = ast.parse((ROOT / "vericache" / name).read_text())
        imported = {(n.module or "").rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & worker_side, (name, imported & worker_side)
