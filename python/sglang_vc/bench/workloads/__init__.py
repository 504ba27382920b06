"""Benchmark and test workloads built from real text found on this machine.

No data set hub is used: the prompts are made from files that are already here (the
Python standard library, installed packages' metadata, ``/usr/share/common-licenses``,
Debian ``copyright`` files) plus synthetic tasks. One module per workload (as kvpress keeps one press a file), registered in
:mod:`.registry`; :mod:`.common` holds what they share. The workloads:

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
``rag``
    Real-text passages as retrieved chunks with one (or two linked) synthetic facts; the
    answer is a code.
``rag_multihop``
    Two-hop RAG over 512-token chunks: a bridge entity stated in one chunk, the answer in
    another, a lure and a distractor chunk mentioning the same entities.

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

from .common import DEFAULT_MAX_TOKENS, MODEL_CONTEXT, WORKLOADS_VERSION, TokenCounter, approx_tokens
from .json_calls import extract_json_call, json_call_score
from .needle import needle_found
from .rag_multihop import HOPS
from .registry import Workload, describe_workloads, list_workloads, load_workload, read_jsonl, write_workload
from .scoring import score, token_f1

__all__ = [
    "HOPS",
    "DEFAULT_MAX_TOKENS",
    "MODEL_CONTEXT",
    "WORKLOADS_VERSION",
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
