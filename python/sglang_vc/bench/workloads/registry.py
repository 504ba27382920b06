"""The workload registry: :func:`load_workload` (build one, or read a JSONL file back),
:func:`list_workloads`, :func:`describe_workloads`, :func:`write_workload`.
"""

from __future__ import annotations

import hashlib
import io
import json
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .code import _build_code
from .common import DEFAULT_MAX_TOKENS, LENGTH_TOLERANCE, MIN_TARGET, WORKLOADS_VERSION, _get_counter
from .json_calls import _build_json_calls
from .needle import _build_needle
from .rag import _build_rag
from .rag_multihop import _build_rag_multihop
from .reading import _build_reading


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
    "rag_multihop": (_build_rag_multihop, "two-hop RAG over 512-token real-text chunks: a bridge entity in one chunk, "
                     "the answer in another, a lure and a distractor chunk on the same entities; answer is a code"),
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
