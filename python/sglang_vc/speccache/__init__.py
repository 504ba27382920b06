"""SpecCache: RAG chunk KV reused at any position, with the tokens to recompute chosen
by a small speculative model ("SpecCache: Speculative KV Cache Reuse for Efficient RAG
Serving").

The selection math (:mod:`.spans`), the cross-tokenizer alignment (:mod:`.align`), the
token selectors behind one interface (:mod:`.selectors`: ``speccache``, ``cacheblend``,
``epic``, ``random``, ``full-reuse``, ``full-recompute``) and positional recovery
(:mod:`.rope`) are shared by the lab (``python -m sglang_vc.bench.speccache``, HF
transformers) and the server.

The server path (any ``--speccache-*`` flag):

* :mod:`.frontend` (tokenizer manager): a prompt marked with the separator is split and
  tokenized piece by piece (:mod:`.layout`), its chunks fetched onto the device
  (:mod:`.fetch`: through SGLang's request path, from the device tree, HiCache's host
  pool or storage backend, or computed alone the first time) while its recomputed
  tokens are selected (:mod:`.spec_model` for ``speccache``);
* :mod:`.radix` (radix cache ``speccache``, SGLang's unified radix cache): finds and
  locks each chunk's KV on the device;
* :mod:`.attention` (attention backend ``vc_speccache``) and :mod:`.store`: fill the
  reused rows (re-rotated to their positions), compute only the recomputed tokens;
  ``cacheblend`` selects there, from a first pass through the target's layer 0.
"""

from .names import ATTENTION_BACKEND, RADIX_CACHE_BACKEND


def register() -> None:
    """Register the ``vc_speccache`` attention backend and the ``speccache`` radix cache."""
    from sglang_vc.kvruntime import register_backends

    register_backends(ATTENTION_BACKEND, _create_attention_backend, RADIX_CACHE_BACKEND, _create_radix_cache)


def _create_attention_backend(model_runner):
    from .attention import SpecCacheAttnBackend

    return SpecCacheAttnBackend(model_runner)


def _create_radix_cache(ctx):
    from .radix import create_chunk_radix_cache

    return create_chunk_radix_cache(ctx)
