"""What a SPECACHE request may choose through ``custom_params``: only to opt out
(``vc_compressor: "none"``, served with full KV). Any other compression would give the
request a KV layout (dropped rows, another KIVI split) SpeCache's attention does not
read, so it is refused with HTTP 400 (``hooks.py`` calls :func:`check_sampling_params`
after ``SamplingParams.verify``)."""

from __future__ import annotations

from typing import Any

from sglang_vc.kvruntime import REQUEST_KEYS

from .names import ALGORITHM


def _serving_specache() -> bool:
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # not in a server
        return False
    algo = getattr(server_args, "speculative_algorithm", None)
    return bool(algo) and str(algo).upper() == ALGORITHM


def check_custom_params(custom_params: Any) -> None:
    """``ValueError`` unless ``custom_params`` chooses nothing or full KV."""
    if not isinstance(custom_params, dict):
        return
    given = {k: custom_params[k] for k in REQUEST_KEYS if k in custom_params}
    if not given:
        return
    if set(given) == {"vc_compressor"} and str(given["vc_compressor"]).lower() in ("none", "full"):
        return
    raise ValueError(f"{given}: a --speculative-algorithm {ALGORITHM} server serves its own low-bit copy "
                     "(--specache-kv-bits); a request may only opt out with {'vc_compressor': 'none'}")


def check_sampling_params(sampling_params: Any) -> None:
    if _serving_specache():
        check_custom_params(getattr(sampling_params, "custom_params", None))
