"""Whose KV a context is: EvicPress reuses a context's KV only between requests of one
tenant, as SGLang's radix tree keeps them apart.

SGLang keys its tree by a request's ``extra_key`` (with the LoRA id appended) and its
``cache_salt``: a request never reuses rows that another salt computed, so that one
tenant cannot learn what another sent from what is cached. A context (registered, or a
long prompt EvicPress made one of) belongs to the tenant that computed it, and its
namespace -- in the registry, in every storage key, and for its rows put back in the tree
-- carries all three. A context with no salt and no LoRA keeps its ``extra_key`` as it
is; otherwise they are joined unambiguously (a plain ``extra_key`` that starts with the
mark is encoded too, so that no key can pose as a salted one).

SGLang appends the LoRA id to ``extra_key`` without a separator, so in its own tree
``extra_key`` "a" with adapter "b" and ``extra_key`` "ab" without one share rows; a
namespace keeps the LoRA id as its own field, so EvicPress's contexts and storage keys
never do (the tree key it gives back is SGLang's, joined as SGLang joins it).
"""

from __future__ import annotations

import json
from typing import Optional

MARK = "\x1e"  # starts an encoded (extra_key, cache_salt) namespace


def namespace(extra_key: Optional[str], cache_salt: Optional[str],
              lora_id: Optional[str] = None) -> Optional[str]:
    """A tenant's context namespace. ``extra_key`` is SGLang's tree key (a request's
    ``extra_key``, with ``lora_id`` appended when the request has one)."""
    if not cache_salt and not lora_id and not (extra_key or "").startswith(MARK):
        return extra_key
    if lora_id:
        if not (extra_key or "").endswith(lora_id):
            raise ValueError(f"extra_key {extra_key!r} does not end with its LoRA id {lora_id!r}")
        return MARK + json.dumps([extra_key[: len(extra_key) - len(lora_id)] or None, cache_salt or None, lora_id])
    return MARK + json.dumps([extra_key, cache_salt or None])


def tree_key(ns: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """The (``extra_key``, ``cache_salt``) of SGLang's tree keys in namespace ``ns``."""
    if ns is None or not ns.startswith(MARK):
        return ns, None
    extra_key, cache_salt, *lora = json.loads(ns[len(MARK):])
    if lora:  # joined as SGLang's Req joins them
        extra_key = (extra_key or "") + lora[0]
    return extra_key, cache_salt


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_digest(model_path: str) -> str:
    """xxh3-128 of the model's weight files (names, sizes, bytes), the model part of every
    storage key: two fine-tunes served under one name never read each other's KV. Kept in
    ``$SGLANG_VC_HOME/weight_digests.json`` by path, size and modification time, so a
    restart does not read the weights again. A path that is not a folder (a hub name
    SGLang resolves itself) is digested by name."""
    import logging
    import os
    import time
    from pathlib import Path

    import xxhash

    from sglang_vc.models.registry import home

    folder = Path(model_path)
    if not folder.is_dir():
        return "name:" + model_path
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    stamp = [[str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cache_file = home() / "weight_digests.json"
    key = str(folder.resolve())
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    if cached.get(key, {}).get("files") == stamp:
        return cached[key]["digest"]
    t0, h = time.perf_counter(), xxhash.xxh3_128()
    for p, (name, size, _) in zip(files, stamp):
        h.update(f"{name}\0{size}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    logging.getLogger(__name__).info("EvicPress: the weights of %s digest to %s (%d files, %.1f s)", model_path,
                                     digest[:16], len(files), time.perf_counter() - t0)
    try:
        cached[key] = {"files": stamp, "digest": digest}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached))
        tmp.replace(cache_file)
    except OSError:
        pass  # a read-only home: digested again next start
    return digest
