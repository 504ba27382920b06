"""Speculative algorithm ``VERICACHE`` registered with SGLang's registry.

``--speculative-algorithm VERICACHE --speculative-num-draft-tokens X --vc-compressor NAME
--vc-compression-ratio C`` (or ``--vc-kv-bits B`` for a quantizer): drafts ``X`` tokens
per round from the compressed KV and verifies them in one forward against the full KV
(:mod:`.worker`). Registration is cheap (no torch model code is imported); the worker
class is imported only when SGLang builds it.

Flags SGLang resolves for the algorithm (``handle_server_args``): SGLang's overlap
schedule stays on (iterations in which nothing drafts overlap; :mod:`.overlapped`),
``topk=1`` chains, ``--page-size 1``, the attention
backend ``vc_verify`` (:class:`.worker.VeriCacheAttnBackend`, the lossy backend plus
TARGET_VERIFY over the full KV) and the lossy radix cache ``vc``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

from . import flags
from .names import ALGORITHM, ATTENTION_BACKEND, AUTO_MAX_DRAFT_TOKENS, DEFAULT_DRAFT_TOKENS
# Online compressors evict rows of the request's own row during decode (they compact
# into the slots of committed tokens), which would overwrite the full KV the verifier
# reads; VeriCache needs the committed tokens' KV untouched.
UNSUPPORTED_MODES = ("online",)


def register() -> None:
    """Register ``VERICACHE`` and the ``vc_verify`` attention backend (once per process)."""
    from sglang_vc.speculative import register_algorithm

    register_algorithm(ALGORITHM, ATTENTION_BACKEND, _create_attention_backend, validate_server_args,
                       handle_server_args, supports_overlap=True,
                       grammar_overlap=True)


def _create_attention_backend(model_runner):
    from .attention import VeriCacheAttnBackend

    return VeriCacheAttnBackend(model_runner)


def _config_error(message: str):
    from sglang_vc.speculative import config_error

    return config_error(ALGORITHM, message)


def validate_server_args(server_args) -> None:
    """Reject a VERICACHE launch without a usable compressor (the launcher turns the
    :class:`~sglang_vc.config.ConfigError` into a usage error, exit 2)."""
    from sglang_vc.compress import get_compressor
    from sglang_vc.config import parsed_config

    config = parsed_config()
    if config is None or not config.vc_compressor:
        # only outside the project's launcher, which picks the default drafter
        raise _config_error(
            "needs sglang-vc's launcher (python -m sglang_vc.launch_server), which sets its drafter: "
            "SpeCache 2-bit by default, or --vc-compressor NAME with --vc-compression-ratio C or --vc-kv-bits B"
        )
    compressor = get_compressor(config.vc_compressor)
    if compressor.mode in UNSUPPORTED_MODES:
        raise _config_error(
            f"--vc-compressor {config.vc_compressor} is an online method (it evicts rows during "
            "decode); use an offline token-dropping method or a quantizer"
        )
    x = getattr(server_args, "speculative_num_draft_tokens", None)
    if x is not None and int(x) < 1:
        raise _config_error(f"--speculative-num-draft-tokens must be >= 1, got {x}")
    if x is None and flags.schedule(config.group(flags.GROUP)) is flags.Schedule.LOCKSTEP:
        raise _config_error("--vc-schedule lockstep drafts one fixed X for the whole batch: give "
                            "--speculative-num-draft-tokens X (the staggered schedule chooses X from data)")
    from sglang_vc.speculative import check_raw_flags

    problem = check_raw_flags(server_args, ATTENTION_BACKEND)
    if problem:
        raise _config_error(problem)


def _carried_resolution(server_args) -> dict:
    """VERICACHE's part of the project config carried on ``server_args`` to the scheduler
    process (mutated in place: SGLang resolves after the launcher attached it)."""
    from sglang_vc.config import SERVER_ARGS_ATTR

    raw = getattr(server_args, SERVER_ARGS_ATTR, None)
    if raw is None:
        raw = {}
        setattr(server_args, SERVER_ARGS_ATTR, raw)
    return raw.setdefault("resolved", {}).setdefault("vericache", {})


def handle_server_args(server_args) -> None:
    """Resolve the flags VERICACHE needs (runs on SGLang's resolution stand-in).

    ``--speculative-num-draft-tokens X`` counts VERICACHE's drafts per verify; SGLang's
    field is set to the verify width ``X + 1`` (NGRAM's convention: the draft-token count
    is the tokens each request verifies, the committed token first), because SGLang reads
    it as that width everywhere: the shared logits buffer the verify graphs write
    (``ModelRunner.max_decode_logits_rows``), FA3's ``TARGET_VERIFY`` metadata and graph
    buffers, the verify graph runner's width check. The project reads X with
    :func:`draft_tokens_of`."""
    carried = _carried_resolution(server_args)
    if "drafts" not in carried:  # the first resolution reads the user's X
        x = server_args.speculative_num_draft_tokens
        carried["draft_len_auto"] = x is None
        # without the flag X is chosen from data in 1 .. AUTO_MAX_DRAFT_TOKENS (draft_length.py)
        carried["drafts"] = int(AUTO_MAX_DRAFT_TOKENS if x is None else x)
    # SGLang may resolve the flags again (the width set by then): what was decided first stands
    x, auto = carried["drafts"], bool(carried["draft_len_auto"])
    server_args.speculative_num_draft_tokens = x + 1
    # Draft steps = X, one chain. SGLang reserves 2 * (X + 1) slots past each request's
    # committed length per decode round (the staggered schedule asks fewer: decode_slots.py)
    server_args.speculative_num_steps = x
    from sglang_vc.speculative import resolve_flags

    resolve_flags(server_args, ATTENTION_BACKEND, overlap=True)
    from sglang_vc.config import parsed_config

    config = parsed_config()
    if config is not None:
        config.resolved["vericache"] = {
            "draft_tokens": int(x),
            "verify_width": int(x) + 1,  # SGLang's speculative_num_draft_tokens
            "draft_len_auto": auto,
            "draft_len": (f"chosen from data in 1..{x} (starts at {DEFAULT_DRAFT_TOKENS})" if auto
                          else f"fixed at {x} (--speculative-num-draft-tokens)"),
            "compressor": config.vc_compressor,
            "compression_ratio": config.vc_compression_ratio,
            "kv_bits": config.vc_kv_bits,
            "attention_backend": ATTENTION_BACKEND,
            "radix_cache_backend": "vc",
            "schedule": flags.schedule(config.group(flags.GROUP)).value,
            "window": 2 * int(x),
            "reload": "layer-wise from the host store on a copy thread (staggered: the whole "
                      "request from its reserved window on; lockstep: 2 layers ahead)",
            "host_kv_gb": (config.group("vericache") or {}).get("host_kv_gb"),
        }
        config.enabled_mechanisms()


def draft_tokens_of(spec) -> int:
    """VERICACHE's X, the most drafts per verify, from SGLang's resolved speculative
    settings (``get_spec()``), whose draft-token count is the verify width X + 1."""
    return int(spec.speculative_num_draft_tokens) - 1
