"""Refusing, at the HTTP layer, a per-request compression the server cannot honour.

SGLang validates a request's sampling parameters in the tokenizer manager, where a
``ValueError`` becomes the client's HTTP 400. The scheduler, where the compressed-KV
runtime plans a request, cannot reject one any more; so ``custom_params`` keys
(``vc_compressor``, ``vc_compression_ratio``, ``vc_kv_bits``) are checked here, against
the server's own settings, before the request is queued (``hooks.py`` calls
:func:`check_sampling_params` after SGLang's ``SamplingParams.verify``).
"""

from __future__ import annotations

from typing import Any, Optional

from .names import RADIX_CACHE_BACKEND
from .plan import CompressionSpec, check_request, make_spec

__all__ = ["check_sampling_params"]


_policy: dict[int, tuple[Optional[CompressionSpec], bool]] = {}  # id(server_args) ->


def _server_policy(server_args: Any) -> tuple[Optional[CompressionSpec], bool]:
    """(the server's default spec, whether its cache applies per-request compression);
    computed once per ``ServerArgs`` (which is not hashable)."""
    from sglang_vc.config import get_vc_config

    if id(server_args) not in _policy:
        vc = get_vc_config(server_args)
        default = make_spec(vc.vc_compressor, vc.vc_compression_ratio, vc.vc_kv_bits) if vc.vc_compressor else None
        _policy.clear()  # one server per process
        _policy[id(server_args)] = (default, getattr(server_args, "radix_cache_backend", None) == RADIX_CACHE_BACKEND)
    return _policy[id(server_args)]


def check_sampling_params(sampling_params: Any) -> None:
    """``ValueError`` when ``sampling_params.custom_params`` asks for a compression this
    server cannot serve exactly. Outside a server (no published server args) there is
    nothing to check against."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!": not in a server
        return
    default, serves = _server_policy(server_args)
    check_request(getattr(sampling_params, "custom_params", None), default, serves)
