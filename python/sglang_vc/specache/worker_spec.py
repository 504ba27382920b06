"""Speculative algorithm ``SPECACHE`` registered with SGLang's registry.

``--speculative-algorithm SPECACHE [--specache-kv-bits B --specache-topk K
--specache-residual R --specache-fetch {speculative,nonspeculative}]``. SpeCache forwards
two tokens per request per decode step (the output token and a speculative one) and
commits one: SGLang's speculative-decoding machinery (slots reserved past each request's
committed length, a chain-masked ``TARGET_VERIFY`` forward, a variable number of tokens
committed per iteration) is that shape, so SpeCache is one of its algorithms rather than
an attention-backend option.

Flags SGLang resolves for it (``handle_server_args``): two tokens per step, no overlap
schedule, ``--page-size 1``, the attention backend ``specache`` and the radix cache
``vc``. The device copy is the compressed-KV runtime's KIVI (``kivi`` at 2 bits, ``kivi1``
at 1, set as its default by the attention backend).
"""

from __future__ import annotations

from . import flags
from .names import ALGORITHM, ATTENTION_BACKEND


def register() -> None:
    from sglang_vc.speculative import register_algorithm

    register_algorithm(ALGORITHM, ATTENTION_BACKEND, _create_attention_backend, validate_server_args,
                       handle_server_args)


def _create_attention_backend(model_runner):
    from .attention import SpeCacheAttnBackend

    return SpeCacheAttnBackend(model_runner)


def _config_error(message: str):
    from sglang_vc.speculative import config_error

    return config_error(ALGORITHM, message)


def validate_server_args(server_args) -> None:
    from sglang_vc.config import parsed_config

    config = parsed_config()
    if config is not None and config.vc_compressor and config.vc_compressor not in ("kivi", "kivi1"):
        raise _config_error(f"the device copy is KIVI (--specache-kv-bits); --vc-compressor "
                            f"{config.vc_compressor} cannot be combined with it")
    from sglang_vc.speculative import check_raw_flags

    problem = check_raw_flags(server_args, ATTENTION_BACKEND)
    if problem:
        raise _config_error(problem)
    raw = getattr(server_args, "_raw_input", None) or {}
    x = raw.get("speculative_num_draft_tokens")
    if x not in (None, 2):
        raise _config_error(f"forwards 2 tokens per request per step; --speculative-num-draft-tokens {x} "
                            "cannot be honoured")


def handle_server_args(server_args) -> None:
    server_args.speculative_num_draft_tokens = 2
    server_args.speculative_num_steps = 1
    from sglang_vc.speculative import resolve_flags

    resolve_flags(server_args, ATTENTION_BACKEND)
    from sglang_vc.config import parsed_config

    config = parsed_config()
    if config is not None:
        cfg = flags.config_of(config.group(flags.GROUP))
        config.resolved["specache"] = {
            **cfg.describe(),
            "fetch": flags.Fetch.SPECULATIVE.value if cfg.speculative else flags.Fetch.NONSPECULATIVE.value,
            "device_copy": cfg.compressor_name,
            "attention_backend": ATTENTION_BACKEND,
            "radix_cache_backend": "vc",
            "host_kv_gb": (config.group(flags.GROUP) or {}).get("host_kv_gb"),
            "prefetch": "per layer on a copy thread, started when the step picked the rows",
        }
        config.enabled_mechanisms()
