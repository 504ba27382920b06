"""Choose SGLang's backends for the compressed-KV runtime, on any platform.

The launcher turns the project's flags into SGLang flags *before* SGLang resolves its
arguments, so the choice does not depend on which platform's defaults run (the CPU
platform here, SGLang's CUDA platform on a GPU):

* ``--vc-compressor`` without a speculative algorithm is lossy serving: the
  ``vc_torch`` attention backend and the ``vc`` radix cache;
* mechanisms ask for the same attention backend through :class:`BackendChoice`
  (EvicPress serving token-dropped contexts, VERICACHE's ``vc_verify``).

Each choice also sets ``--page-size 1`` and turns prefill CUDA graphs off (a prefill
compresses layer by layer in Python). Decode CUDA graphs stay on where the backend
delegates full-KV batches to SGLang's own backend (``vc_torch``: lossy serving,
EvicPress): SGLang's can-run gate skips them only for batches holding a compressed
request (``VCTorchAttnBackend.holds_compressed``). The speculative mechanisms'
backends turn decode graphs off too. Each switch is a warning users see
(:mod:`sglang_vc.notices`). An explicit SGLang flag that contradicts the choice is a
usage error, not silently replaced.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from sglang_vc.config import ConfigError, VCConfig

from .names import ATTENTION_BACKEND, RADIX_CACHE_BACKEND, REQUEST_KEYS

logger = logging.getLogger(__name__)

ATTENTION_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")
DECODE_GRAPH_FLAG = "--cuda-graph-backend-decode"
PREFILL_GRAPH_FLAG = "--cuda-graph-backend-prefill"


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """SGLang backends a mechanism needs: ``radix_cache_backend`` None keeps the user's."""

    attention_backend: str
    radix_cache_backend: Optional[str]
    reason: str  # what needs it, for messages
    # Decode CUDA graphs for batches without compressed requests (the backend delegates
    # them to SGLang's own): lossy serving and EvicPress; not the speculative workers,
    # which forward their own batches.
    decode_graphs: bool = False
    # with decode_graphs: which forwards still run eagerly and why (the warning users see)
    eager_forwards: tuple[str, str] = (
        "decode CUDA graphs for batches holding a compressed request",
        "they attend over compressed rows outside SGLang's backend; batches without one replay SGLang's graphs")


def flag_value(argv: list[str], *names: str) -> tuple[int, Optional[str]]:
    """Index and value of the last ``--name VALUE``/``--name=VALUE`` in argv, or (-1, None)."""
    found: tuple[int, Optional[str]] = (-1, None)
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                found = (i, argv[i + 1])
            elif arg.startswith(name + "="):
                found = (i, arg.split("=", 1)[1])
    return found


def without_flag(argv: list[str], name: str) -> list[str]:
    """``argv`` without any ``--name VALUE`` / ``--name=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def lossy_choice(config: VCConfig, argv: list[str]) -> Optional[BackendChoice]:
    """Lossy serving: a compressor and no speculative algorithm (which then owns it)."""
    if not config.vc_compressor or flag_value(argv, "--speculative-algorithm")[1]:
        return None
    config.resolved["lossy_serving"] = {
        "compressor": config.vc_compressor,
        "compression_ratio": config.vc_compression_ratio,
        "kv_bits": config.vc_kv_bits,
        "attention_backend": ATTENTION_BACKEND,
        "radix_cache_backend": RADIX_CACHE_BACKEND,
        "per_request_keys": list(REQUEST_KEYS),  # in sampling_params.custom_params
    }
    return BackendChoice(ATTENTION_BACKEND, RADIX_CACHE_BACKEND, "--vc-compressor (lossy serving)",
                         decode_graphs=True)


def sglang_flags(choice: BackendChoice, argv: list[str]) -> list[str]:
    """The SGLang flags to append to ``argv`` for ``choice``; :class:`ConfigError` when
    an explicit flag contradicts it."""
    extra: list[str] = []
    for flag in ATTENTION_FLAGS:
        value = flag_value(argv, flag)[1]
        if value not in (None, choice.attention_backend):
            raise ConfigError(f"{choice.reason} attends with the {choice.attention_backend} "
                              f"attention backend; got {flag} {value}")
    if flag_value(argv, "--attention-backend")[1] is None:
        extra += ["--attention-backend", choice.attention_backend]
    if choice.radix_cache_backend is not None:
        value = flag_value(argv, "--radix-cache-backend")[1]
        if value not in (None, choice.radix_cache_backend):
            raise ConfigError(f"{choice.reason} needs --radix-cache-backend "
                              f"{choice.radix_cache_backend} (got {value})")
        if value is None:
            extra += ["--radix-cache-backend", choice.radix_cache_backend]
    page = flag_value(argv, "--page-size")[1]
    if page not in (None, "1"):
        raise ConfigError(f"{choice.reason} needs --page-size 1 (compressed rows are token slots)")
    if page is None:
        extra += ["--page-size", "1"]
    if choice.decode_graphs and "--enable-dp-attention" in argv:
        # SGLang votes on decode graphs across DP ranks; the gate that keeps compressed
        # batches eager decides per rank, so the ranks would disagree
        raise ConfigError(f"{choice.reason}: --enable-dp-attention is not supported (the "
                          f"{choice.attention_backend} backend decides per rank which batches replay CUDA graphs)")
    graph_flags = [PREFILL_GRAPH_FLAG] if choice.decode_graphs else [DECODE_GRAPH_FLAG, PREFILL_GRAPH_FLAG]
    for flag in graph_flags:
        value = flag_value(argv, flag)[1]
        if value not in (None, "disabled"):
            raise ConfigError(f"{choice.reason}: the {choice.attention_backend} attention backend "
                              f"does not capture these CUDA graphs; got {flag} {value}")
        if value is None:
            extra += [flag, "disabled"]
    logger.info("%s: attention backend %s%s, page size 1", choice.reason, choice.attention_backend,
                f", radix cache {choice.radix_cache_backend}" if choice.radix_cache_backend else "")
    from sglang_vc.notices import switched_off

    if flag_value(argv, PREFILL_GRAPH_FLAG)[1] is None:
        switched_off("prefill CUDA graphs", choice.reason,
                     f"the {choice.attention_backend} attention backend compresses the prefill's KV "
                     "layer by layer")
    if choice.decode_graphs:
        switched_off(choice.eager_forwards[0], choice.reason, choice.eager_forwards[1])
    elif flag_value(argv, DECODE_GRAPH_FLAG)[1] is None:
        switched_off("decode CUDA graphs", choice.reason,
                     "its full-KV attention is SGLang's torch_native backend (--vc-full-kv-attention-backend), "
                     "which captures no graphs" if choice.attention_backend == ATTENTION_BACKEND else
                     f"the {choice.attention_backend} attention backend forwards the mechanism's own "
                     "batches (drafts, verifies, speculative steps) and does not capture graphs")
    return extra
