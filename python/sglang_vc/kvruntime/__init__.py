"""The compressed-KV runtime every mechanism shares: a request's (or a cached prefix's)
KV kept on the device in compressed form, and attention over it.

Lossy serving (``--vc-compressor NAME`` alone) is this runtime serving every request
from its compressed KV; VeriCache drafts from it; EvicPress serves token-dropped
contexts through it. Mechanisms use only the names exported here.

How it plugs into SGLang (registries only):

* attention backend ``vc_torch`` (:mod:`.backend`): SGLang's ``TorchNativeAttnBackend``
  plus, per layer, compression of a request's KV right after its prefill (the queries the
  backend receives are the ones SnapKV/H2O/KVzip score with), attention over the
  compressed rows and the request's later rows, and H2O's online eviction during decode.
  The attention math is in :mod:`.kernels` (pure torch).
* radix-cache backend ``vc`` (:mod:`.radix`): SGLang's Python ``RadixCache`` that never
  inserts a compressed request's KV, caps a lossy request's prefix match so that it owns
  the slots its compressed rows go to, and frees exactly the slots such a request owns.
* :class:`KVRuntime` (:mod:`.runtime`): the per-process state both share: request
  plans, the :class:`CompressedKVIndex` of each compressed request, compressor
  instances, the store for quantized payloads.

Selection (:mod:`.select`) happens in the launcher on any platform: ``--vc-compressor``
without a speculative algorithm adds ``--attention-backend vc_torch --radix-cache-backend
vc --page-size 1`` (and disables CUDA graphs, which ``vc_torch`` does not capture).

A request may choose its own compression through ``sampling_params.custom_params``:
``{"vc_compressor": "h2o", "vc_compression_ratio": 0.5}``, ``{"vc_compressor": "kivi",
"vc_kv_bits": 4}`` or ``{"vc_compressor": "none"}`` (full KV). Each response's
``meta_info["sglang_vc_compression"]`` is a one-element list with what was done; the
``compression`` counters of ``/server_info`` sum it up. An override the server cannot
honour exactly (invalid, or sent to a server without the ``vc`` radix cache) is refused
with HTTP 400 before it is queued (:mod:`.admission`).

Memory: a token-dropped prefix keeps ``n_keep`` rows in the request's own slots; the
row positions of its dropped tokens point at :data:`NULL_SLOT` (SGLang's reserved padding
slot 0, never allocated), which attention skips, and their slots go back to the pool
right after the prefill (H2O keeps freeing as it evicts). KIVI frees the slots of the
quantized tokens and keeps their packed payload in a contiguous run of pool slots leased
for it while the request lives (:mod:`.payload_store`; where the pool has no such run, the
dequantized values are written back in place and nothing is saved). Rows borrowed from a cached full prefix
stay with the tree.

What the methods score with (queries are the post-RoPE queries the backend receives
during the prefill's last chunk): SnapKV the last 32 prompt queries (its observation
window); H2O the last 512 prompt queries, then every decode query (online); KVzip has no
context-reconstruction pass here: the last 512 prompt queries stand in for the
reconstruction queries. KIVI quantizes the prompt, then the decode tail group by group.
``--page-size 1`` only; no hybrid (SWA/Mamba) models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .names import ATTENTION_BACKEND, META_INFO_KEY, NULL_SLOT, RADIX_CACHE_BACKEND, REQUEST_KEYS

if TYPE_CHECKING:  # the heavy modules load when SGLang builds a backend
    from .copy_stream import CopyStream
    from .index import CompressedKVIndex, QuantPayload
    from .plan import CompressionSpec, RequestPlan
    from .runtime import KVRuntime

__all__ = [
    "ATTENTION_BACKEND",
    "META_INFO_KEY",
    "NULL_SLOT",
    "RADIX_CACHE_BACKEND",
    "REQUEST_KEYS",
    "CompressedKVIndex",
    "CompressionSpec",
    "CopyStream",
    "KVRuntime",
    "QuantPayload",
    "RequestPlan",
    "current_runtime",
    "get_runtime",
    "make_spec",
    "register",
    "register_backends",
]

_LAZY = {
    "CopyStream": ".copy_stream",
    "CompressedKVIndex": ".index",
    "QuantPayload": ".index",
    "CompressionSpec": ".plan",
    "RequestPlan": ".plan",
    "make_spec": ".plan",
    "KVRuntime": ".runtime",
    "get_runtime": ".runtime",
    "current_runtime": ".runtime",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)


def register_backends(attention: str, attention_factory, radix: str, radix_factory) -> None:
    """Register an attention backend (also as a ``--attention-backend`` choice) and a
    radix-cache backend with SGLang's registries, unless already there."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if attention not in ATTENTION_BACKENDS:
        register_attention_backend(attention)(attention_factory)
    if attention not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([attention])
    if get_radix_cache_factory(radix) is None:
        register_radix_cache_backend(radix, radix_factory)


def register() -> None:
    """Register the attention and radix-cache backends with SGLang (once per process)."""
    register_backends(ATTENTION_BACKEND, _create_attention_backend, RADIX_CACHE_BACKEND, _create_radix_cache)


# The factories import the heavy modules only when SGLang builds the backend.
def _create_attention_backend(model_runner):
    from .backend import VCTorchAttnBackend

    return VCTorchAttnBackend(model_runner)


def _create_radix_cache(ctx):
    from .radix import create_lossy_radix_cache

    return create_lossy_radix_cache(ctx)
