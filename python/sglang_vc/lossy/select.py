"""Choose the lossy-serving backends while SGLang resolves the server args.

``--vc-compressor`` without a speculative algorithm means lossy serving: the attention
backend defaults to ``vc_torch`` and the radix cache to ``vc``. Called from the CPU
platform's ``apply_server_args_defaults`` / ``get_default_attention_backend`` in the
launcher process, where the project's config is ``config.parsed_config()``.
Without ``--vc-compressor``, EvicPress may ask for ``vc_torch`` too (token-dropped
contexts, see ``evicpress.flags.apply_attention_default``).
"""

from __future__ import annotations

from typing import Any, Optional

from sglang_vc.config import VCConfig, parsed_config

from . import ATTENTION_BACKEND, RADIX_CACHE_BACKEND


def lossy_config(server_args: Any = None) -> Optional[VCConfig]:
    """The parsed config if it asks for lossy serving (a compressor, no speculation)."""
    config = parsed_config()
    if config is None or not config.vc_compressor:
        return None
    if server_args is not None and getattr(server_args, "speculative_algorithm", None):
        return None
    return config


def apply_lossy_defaults(server_args: Any) -> None:
    config = lossy_config(server_args)
    if config is None:
        # EvicPress serves token-dropped contexts with the same attention backend.
        from sglang_vc.evicpress.flags import apply_attention_default

        apply_attention_default(server_args)
        return
    # What the user asked for (SGLang's CPU handlers have already put their own default
    # attention backend in place by now, which lossy serving replaces).
    raw = getattr(server_args, "_raw_input", None) or {}
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = raw.get(field)
        if value not in (None, ATTENTION_BACKEND):
            raise ValueError(
                f"--vc-compressor serves from the compressed KV with the {ATTENTION_BACKEND} "
                f"attention backend; got {field}={value}"
            )
    server_args.attention_backend = ATTENTION_BACKEND
    backend = raw.get("radix_cache_backend")
    if backend not in (None, RADIX_CACHE_BACKEND):
        raise ValueError(
            f"--vc-compressor needs --radix-cache-backend {RADIX_CACHE_BACKEND} (got {backend})"
        )
    server_args.radix_cache_backend = RADIX_CACHE_BACKEND
    if raw.get("page_size") not in (None, 1):
        raise ValueError("--vc-compressor (lossy serving) needs --page-size 1")
    config.lossy_serving = True
    config.enabled_mechanisms()  # refresh the live dict /server_info shows
