"""Lossy serving: decode directly from the compressed KV cache.

``python -m sglang_vc.launch_server --vc-compressor NAME --vc-compression-ratio C`` (token
dropping, C = fraction of the KV kept) or ``--vc-compressor kivi --vc-kv-bits B`` serves
every request from its compressed KV: the baseline VeriCache is compared against.

How it plugs into SGLang (registries only):

* attention backend ``vc_torch`` (:mod:`.backend`): SGLang's ``TorchNativeAttnBackend``
  plus, per layer, compression of a request's KV right after its prefill (the queries the
  backend receives are the ones SnapKV/H2O/KVzip score with), attention over
  ``[compressed rows] ++ [KV of later tokens]`` and H2O's online eviction during decode.
  The attention math is in :mod:`.kernels` (pure torch; a GPU version replaces that
  module behind the same calls).
* radix-cache backend ``vc`` (:mod:`.radix`): SGLang's Python ``RadixCache`` that never
  inserts a compressed request's KV, caps a lossy request's prefix match so that it owns
  the slots its compressed rows go to, and frees exactly the slots such a request still
  owns.
* :mod:`.runtime`: the per-process state both share (request plans, the
  :class:`~.index.CompressedKVIndex` of each compressed request, compressor instances,
  the store for quantized payloads).

A request may choose its own compression through ``sampling_params.custom_params``:
``{"vc_compressor": "h2o", "vc_compression_ratio": 0.5}``, ``{"vc_compressor": "kivi",
"vc_kv_bits": 4}`` or ``{"vc_compressor": "none"}`` (full KV). Each response's
``meta_info["sglang_vc_compression"]`` is a one-element list with what was done; the
``compression`` counters of ``/server_info`` sum it up.

Memory: token dropping frees ``n - n_keep`` pool slots per request right after its
prefill (H2O keeps freeing as it evicts); KIVI frees the slots of the quantized tokens and
keeps their packed payload in a side store (bounded, ``runtime.PAYLOAD_STORE_FRACTION`` of
the pool's bytes; when full, the dequantized values are written back in place and nothing
is saved). Rows borrowed from a cached full prefix stay with the tree.

What the methods score with (queries are the post-RoPE queries the backend receives
during the prefill's last chunk): SnapKV the last 32 prompt queries (its observation
window); H2O the last 512 prompt queries, then every decode query (online); KVzip has no
context-reconstruction pass here: the last 512 prompt queries stand in for the
reconstruction queries (scored as if they followed the context, as the library does).
KIVI quantizes the prompt once; generated tokens stay in full precision. ``--page-size 1``
only; no speculative decoding, HiCache or hybrid (SWA/Mamba) models in this mode.
"""

ATTENTION_BACKEND = "vc_torch"
RADIX_CACHE_BACKEND = "vc"
REQUEST_KEYS = ("vc_compressor", "vc_compression_ratio", "vc_kv_bits")
META_INFO_KEY = "sglang_vc_compression"


def register() -> None:
    """Register the attention and radix-cache backends with SGLang (once per process)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if ATTENTION_BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(ATTENTION_BACKEND)(_create_attention_backend)
    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])
    if get_radix_cache_factory(RADIX_CACHE_BACKEND) is None:
        register_radix_cache_backend(RADIX_CACHE_BACKEND, _create_radix_cache)


# The factories import the heavy modules only when SGLang builds the backend.
def _create_attention_backend(model_runner):
    from .backend import VCTorchAttnBackend

    return VCTorchAttnBackend(model_runner)


def _create_radix_cache(ctx):
    from .radix import create_lossy_radix_cache

    return create_lossy_radix_cache(ctx)
