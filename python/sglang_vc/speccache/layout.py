"""A RAG prompt's layout: where its retrieved chunks are, in characters and tokens.

A client marks the chunks with a separator: ``prefix SEP chunk 1 SEP ... SEP chunk c SEP
query`` (at least one chunk). Each piece is tokenized on its own (special tokens only
with the prefix), so a chunk's tokens are the same in every prompt that carries it: its
token ids are the key of its KV in the radix tree. The pieces joined without the
separators are the text the speculative model reads; ``offsets`` map each target token
to its characters there (for the cross-tokenizer alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .selectors.base import Chunks


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in ``text``
    text: str  # the pieces joined, without separators
    chunks: Chunks
    chunk_ids: list[list[int]]


MAX_CHUNKS = 64  # chunks per prompt: each one the front end fetches is an internal prefill


def split(text: str, separator: str) -> tuple[str, list[str], str]:
    """(prefix, chunks, query) of a prompt marked with ``separator``; ``ValueError``
    when it does not have the shape ``prefix SEP chunk SEP ... SEP query``."""
    pieces = text.split(separator)
    if len(pieces) < 3:
        raise ValueError(f"a SpecCache prompt is 'prefix{separator}chunk{separator}...{separator}query': "
                         f"found {len(pieces) - 1} separator(s), need at least 2")
    chunks = pieces[1:-1]
    if len(chunks) > MAX_CHUNKS:
        raise ValueError(f"a SpecCache prompt has at most {MAX_CHUNKS} chunks (each is a prefill of its own), "
                         f"got {len(chunks)}")
    empty = [i for i, c in enumerate(chunks) if not c.strip()]
    if empty:
        raise ValueError(f"SpecCache chunk {empty[0]} is empty (two separators in a row?)")
    return pieces[0], chunks, pieces[-1]


def tokenize(tokenizer, prefix: str, chunks: Sequence[str], query: str) -> Prompt:
    """The prompt's tokens, piece by piece (special tokens only before the prefix)."""
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    starts, ends, chunk_ids = [], [], []
    text = ""
    for k, piece in enumerate([prefix, *chunks, query]):
        enc = tokenizer(piece, add_special_tokens=(k == 0), return_offsets_mapping=True)
        base = len(text)
        is_chunk = 1 <= k <= len(chunks)
        if is_chunk:
            starts.append(len(ids))
            chunk_ids.append(list(enc["input_ids"]))
        ids += enc["input_ids"]
        offsets += [(a + base, b + base) if b > a else (base + a, base + a) for a, b in enc["offset_mapping"]]
        if is_chunk:
            ends.append(len(ids))
        text += piece
    return Prompt(ids, offsets, text, Chunks(tuple(starts), tuple(ends), len(ids)), chunk_ids)
