"""Workload ``rag``: real-text passages as retrieved chunks with one (or two linked)
synthetic facts inserted; the answer is a code.
"""

from __future__ import annotations

import re
from typing import Sequence

from .common import TokenCounter, _finish_item, _norm_space, _rng, _source_record
from .docs import _DOC_KINDS, _doc_pool


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
