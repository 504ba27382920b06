"""What a SPECACHE request may choose through ``sampling_params.custom_params``,
checked at the HTTP layer (``hooks.py`` calls :func:`check_sampling_params` after
``SamplingParams.verify``; a ``ValueError`` is the client's 400):

* ``{"vc_compressor": "none"}``: opt out, served with full KV;
* ``{"vc_compressor": "kivi", "vc_kv_bits": 2}`` or ``{"vc_compressor": "kivi1",
  "vc_kv_bits": 1}``: the device copy's bits for this request (the server's residual and
  group size);
* ``{"specache_topk": K}``: rows prefetched per layer and KV head for this request.

On a VERICACHE server, ``{"vc_compressor": "specache", "vc_kv_bits": B}`` makes SpeCache
the request's drafter and ``specache_topk`` its rows fetched per layer and KV head; any
other server refuses both (:func:`check_drafter_params`).

Any other compression would give the request a KV layout SpeCache's attention does not
read (dropped rows, another KIVI split), so it is refused."""

from __future__ import annotations

from typing import Any, Optional

from sglang_vc.kvruntime import REQUEST_KEYS
from sglang_vc.vericache.names import ALGORITHM as VERICACHE

from .config import MAX_TOPK
from .names import ALGORITHM

TOPK_KEY = "specache_topk"
_COPIES = {("kivi", 2), ("kivi1", 1)}


def _server() -> Optional[tuple[Optional[str], Optional[str]]]:
    """(the server's speculative algorithm, its ``--vc-compressor``); None outside a server."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_vc.config import get_vc_config

    try:
        server_args = get_server_args()
    except ValueError:  # not in a server
        return None
    algo = getattr(server_args, "speculative_algorithm", None)
    return (str(algo).upper() if algo else None), get_vc_config(server_args).vc_compressor


def _check_topk(k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOPK:
        raise ValueError(f"{TOPK_KEY} must be an integer in [0, {MAX_TOPK}], got {k!r}")


def check_custom_params(custom_params: Any) -> None:
    """``ValueError`` unless ``custom_params`` chooses something SPECACHE serves exactly."""
    if not isinstance(custom_params, dict):
        return
    if TOPK_KEY in custom_params:
        _check_topk(custom_params[TOPK_KEY])
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


def check_drafter_params(custom_params: Any, vericache: bool, default_compressor: Optional[str]) -> None:
    """``ValueError`` unless a request's ``specache`` compression (SpeCache as
    VERICACHE's drafter) and its ``specache_topk`` are served exactly: only a VERICACHE
    server drafts with SpeCache, and the top-k applies only to a request it compresses
    with ``specache`` (elsewhere it would be ignored)."""
    if not isinstance(custom_params, dict):
        return
    from sglang_vc.compress import SpeCacheCopy

    name = str(custom_params.get("vc_compressor", default_compressor or "")).lower()
    drafted = name == SpeCacheCopy.name
    if drafted and not vericache:
        raise ValueError(f"vc_compressor {SpeCacheCopy.name!r} is SpeCache as VERICACHE's drafter: only a "
                         f"--speculative-algorithm {VERICACHE} server serves it")
    if TOPK_KEY in custom_params:
        _check_topk(custom_params[TOPK_KEY])
        if not drafted:
            raise ValueError(f"{TOPK_KEY} applies to --speculative-algorithm {ALGORITHM}, or to a {VERICACHE} "
                             f"request compressed with {SpeCacheCopy.name!r}; this request would ignore it")


def check_sampling_params(sampling_params: Any) -> None:
    server = _server()
    if server is None:  # outside a server there is nothing to check against
        return
    algorithm, default_compressor = server
    custom = getattr(sampling_params, "custom_params", None)
    if algorithm == ALGORITHM:
        check_custom_params(custom)
    else:
        check_drafter_params(custom, algorithm == VERICACHE, default_compressor)
