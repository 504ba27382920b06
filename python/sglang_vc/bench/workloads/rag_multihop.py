"""Workload ``rag_multihop``: two-hop RAG questions where the chunks that are recomputed
decide the answer (SpecCache's setting: a bridge entity links two chunks).

Each item is ``chunks`` retrieved passages of about ``chunk_tokens`` tokens (512 as in the
SpecCache paper) of real text from the machine, with synthetic facts put between their
sentences:

* the **bridge** chunk: "Project P is maintained by the T team."
* the **answer** chunk: "The archive code of the T team is C."
* a **lure** chunk that mentions the same project with another team and that team's
  code: "Project P was reviewed by the T2 team. The archive code of the T2 team is C2."
  (a reader that links P to the wrong team answers C2);
* a **distractor** chunk that mentions the bridge team with another project: "Project P2
  is maintained by the T team. The T team moved to a new office in YEAR.";
* plain passages for any further chunks.

The question asks for the archive code of the team that maintains project P; the answer
C is stated verbatim in the answer chunk. Scored by exact match of the code
(:func:`~.scoring.score`) and token F1.

``hop`` sets how far apart the two facts are:

* ``far`` (default): chunks in a random order, each fact between two random sentences of
  its passage;
* ``near``: the easier variant (for a target that answers too few ``far`` items): the
  answer chunk follows the bridge chunk, the bridge fact ends its passage (appended after
  the passage's last line, which may stop mid-sentence) and the answer fact opens the
  next, so the second hop is the next sentence. The other chunks keep their shuffled
  order.
"""

from __future__ import annotations

from typing import Sequence

from .common import TokenCounter, _finish_item, _norm_space, _rng, _source_record
from .docs import _DOC_KINDS, _doc_pool
from .rag import _RAG_INTRO, _rag_code, _rag_insert, _rag_name

MULTIHOP_TASK = "rag_multihop"
ROLES = ("bridge", "answer", "lure", "distractor")
HOPS = ("far", "near")


def _build_rag_multihop(counter: TokenCounter, max_tokens: int, n: int | None, seed: int, *,
                        chunks: int = 4, chunk_tokens: int = 512, kinds: Sequence[str] = _DOC_KINDS,
                        min_prose: float = 0.3, hop: str = "far") -> tuple[list[dict], dict]:
    """``n`` items (default 24) of ``chunks`` passages (at least 4: bridge, answer, lure,
    distractor) of about ``chunk_tokens`` tokens each; ``chunks`` in an item are the
    passages as they appear in the prompt (``prompt == chunk_prefix + "".join(chunks) +
    question``), ``chunk_roles`` what each one holds, ``answer_chunks`` the bridge's and
    the answer's indices."""
    if chunks < len(ROLES):
        raise ValueError(f"rag_multihop: needs chunks >= {len(ROLES)} (bridge, answer, lure, distractor), got {chunks}")
    if chunk_tokens < 64:
        raise ValueError(f"rag_multihop: chunk_tokens must be >= 64, got {chunk_tokens}")
    if hop not in HOPS:
        raise ValueError(f"rag_multihop: hop must be one of {', '.join(HOPS)}, got {hop!r}")
    chunk_tokens = min(chunk_tokens, (max_tokens - 96) // chunks)  # clamped to the prompt budget
    if chunk_tokens < 64:
        raise ValueError(f"rag_multihop: {chunks} chunks do not fit max_tokens {max_tokens}")
    docs = [d for d in _doc_pool(tuple(kinds)) if d.prose >= min_prose]
    if not docs:
        raise RuntimeError(f"rag_multihop workload: no documents of kinds {list(kinds)} on this machine")
    n = 24 if n is None else n
    items = [_item(i, seed, chunks, chunk_tokens, docs, counter, hop) for i in range(n)]
    return items, {"chunks": chunks, "chunk_tokens": chunk_tokens, "kinds": list(kinds), "min_prose": min_prose,
                   "hop": hop}


def _passage(rng, docs, counter: TokenCounter, budget: int) -> tuple[str, dict]:
    """Consecutive lines of a random document filling ``budget`` tokens (within 10%):
    a start from which the rest of the document holds the budget."""
    for _attempt in range(100):
        doc = rng.choice(docs)
        counts = [c + 1 for c in doc.line_counts(counter)]
        rest, acc = [0.0] * (len(counts) + 1), 0.0
        for k in range(len(counts) - 1, -1, -1):
            acc += counts[k]
            rest[k] = acc
        starts = [k for k in range(len(counts)) if rest[k] >= 0.9 * budget]
        if not starts:
            continue
        start = rng.choice(starts)
        end, total = start, 0.0
        while end < len(counts) and total + counts[end] <= budget:
            total += counts[end]
            end += 1
        if total < 0.9 * budget:
            continue
        text = _norm_space(" ".join(doc.lines[start:end])).strip()
        if "<|" in text:  # special-token markup (chat tokens, SpecCache's chunk separator): not passage text
            continue
        return text, _source_record(doc.path, kind=doc.kind, title=doc.title, lines=[start + 1, end])
    raise RuntimeError(f"rag_multihop workload: no document holds a passage of {budget} tokens")


def _distinct(rng, make, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _item(i: int, seed: int, n_chunks: int, chunk_tokens: int, docs, counter: TokenCounter, hop: str) -> dict:
    rng = _rng(MULTIHOP_TASK, seed, i)
    project, other_project, team, lure_team = _distinct(rng, _rag_name, 4)
    code, lure_code = _distinct(rng, _rag_code, 2)
    facts = {
        "bridge": [f"Project {project} is maintained by the {team} team."],
        "answer": [f"The archive code of the {team} team is {code}."],
        "lure": [f"Project {project} was reviewed by the {lure_team} team.",
                 f"The archive code of the {lure_team} team is {lure_code}."],
        "distractor": [f"Project {other_project} is maintained by the {team} team.",
                       f"The {team} team moved to a new office in {rng.randrange(1990, 2024)}."],
    }
    roles = list(ROLES) + ["plain"] * (n_chunks - len(ROLES))
    rng.shuffle(roles)
    if hop == "near":  # the answer chunk right after the bridge chunk
        roles.remove("answer")
        roles.insert(roles.index("bridge") + 1, "answer")
    passages, sources = [], []
    for role in roles:
        text, src = _passage(rng, docs, counter, chunk_tokens - 24 * len(facts.get(role, [])))
        for fact in facts.get(role, []):
            if hop == "near" and role == "bridge":
                text = f"{text} {fact}"
            elif hop == "near" and role == "answer":
                text = f"{fact} {text}"
            else:
                text = _rag_insert(rng, text, fact)
        passages.append(text)
        sources.append(src)
    # the code only, repeated next to the question: 2k tokens after the intro, the 1.5B
    # model otherwise runs on into the next passage's words
    question = (f"\nQuestion: what is the archive code of the team that maintains project {project}? "
                "Reply with the code only.\nAnswer:")
    chunk_texts = [f"\nPassage {k + 1}: {p}\n" for k, p in enumerate(passages)]
    prompt = _RAG_INTRO + "".join(chunk_texts) + question
    return _finish_item(MULTIHOP_TASK, i, MULTIHOP_TASK, prompt, question, code, counter.count(prompt), None, 8,
                        {"documents": sources}, chunks=chunk_texts, chunk_prefix=_RAG_INTRO,
                        answer_chunks=[roles.index("bridge"), roles.index("answer")], chunk_roles=roles,
                        bridge_entity=team, lure_answer=lure_code)
