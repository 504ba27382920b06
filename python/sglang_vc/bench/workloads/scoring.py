"""Scoring a model's answer against an item: :func:`score` (by task) and :func:`token_f1`.
"""

from __future__ import annotations

import re

from .json_calls import json_call_score
from .needle import needle_found
from .rag import _RAG_TASKS
from .rag_multihop import MULTIHOP_TASK


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
    if task in _RAG_TASKS or task == MULTIHOP_TASK:  # exact match: the code is the first word of the answer
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
