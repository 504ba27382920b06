"""What a SPECACHE request may choose through ``sampling_params.custom_params``,
checked at the HTTP layer (``hooks.py`` calls :func:`check_sampling_params` after
``SamplingParams.verify``; a ``ValueError`` is the client's 400):

* ``{"vc_compressor": "none"}``: opt out, served with full KV;
* ``{"vc_compressor": "kivi", "vc_kv_bits": 2}`` or ``{"vc_compressor": "kivi1",
  "vc_kv_bits": 1}``: the device copy's bits for this request (the server's residual and
  group size);
* ``{"specache_topk": K}``: rows prefetched per layer and KV head for this request.

Any other compression would give the request a KV layout SpeCache's attention does not
read (dropped rows, another KIVI split), so it is refused."""

from __future__ import annotations

from typing import Any

from sglang_vc.kvruntime import REQUEST_KEYS

from .names import ALGORITHM

TOPK_KEY = "specache_topk"
_COPIES = {("kivi", 2), ("kivi1", 1)}


def _serving_specache() -> bool:
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # not in a server
        return False
    algo = getattr(server_args, "speculative_algorithm", None)
    return bool(algo) and str(algo).upper() == ALGORITHM


def check_custom_params(custom_params: Any) -> None:
    """``ValueError`` unless ``custom_params`` chooses something SPECACHE serves exactly."""
    if not isinstance(custom_params, dict):
        return
    if TOPK_KEY in custom_params:
        k = custom_params[TOPK_KEY]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"{TOPK_KEY} must be an integer >= 0, got {k!r}")
    given = {k: custom_params[k] for k in REQUEST_KEYS if k in custom_params}
    if not given:
        return
    name = str(given.get("vc_compressor", "")).lower()
    if set(given) == {"vc_compressor"} and name in ("none", "full"):
        return
    if set(given) == {"vc_compressor", "vc_kv_bits"} and (name, given["vc_kv_bits"]) in _COPIES:
        return
    raise ValueError(f"{given}: a --speculative-algorithm {ALGORITHM} server keeps a KIVI copy on the device; "
                     "a request may choose {'vc_compressor': 'kivi', 'vc_kv_bits': 2}, {'vc_compressor': "
                     "'kivi1', 'vc_kv_bits': 1}, or opt out with {'vc_compressor': 'none'}")


def request_topk(custom_params: Any, default: int) -> int:
    """The request's top-k (validated at the HTTP layer)."""
    if isinstance(custom_params, dict) and TOPK_KEY in custom_params:
        return int(custom_params[TOPK_KEY])
    return default


def check_sampling_params(sampling_params: Any) -> None:
    if _serving_specache():
        check_custom_params(getattr(sampling_params, "custom_params", None))
