"""Speculative algorithm ``VERICACHE_REMOTE`` registered with SGLang's registry: the
*remote* server of VeriCache's remote prefix caching (paper section 5.3, appendix B.2
path P1)::

    python -m sglang_vc.launch_server --speculative-algorithm VERICACHE_REMOTE \\
        --vc-remote-verifier http://LOCAL:PORT --speculative-num-draft-tokens 8 \\
        --radix-cache-backend evicpress --evicpress-load-copy kivi@4b \\
        --enable-hierarchical-cache --hicache-storage-backend seaweedfs ...

EvicPress loads the compressed storage copy of a stored prefix (``--evicpress-load-copy``)
over this server's link to the store; the worker (:mod:`.worker`) drafts from it
and sends every round to the local server for verification (:mod:`.verify`).
Requests whose prefix is not a lossy copy decode as usual, X tokens per iteration.

With ``--vc-remote-path tiering`` there is no verifier elsewhere: the same server drafts
from the compressed copy while the context's full copy loads from its own storage, and
verifies the drafts against it (:mod:`.tiering`, lossless tiering inside one server).

Flags resolved for it: no overlap schedule (the worker is synchronous), one chain,
``speculative_num_steps = X``. SGLang's own attention backend and the EvicPress radix
cache are kept: the drafts are ordinary decode forwards over the loaded copy.
"""

from __future__ import annotations

from .. import flags
from ..names import CHAIN_BACKEND, DEFAULT_REMOTE_DRAFT_TOKENS, REMOTE_ALGORITHM


def register() -> None:
    from sglang_vc.speculative import register_algorithm

    # vc_chain: the CPU's attention backend for a tiering verify (see handle_server_args)
    register_algorithm(REMOTE_ALGORITHM, CHAIN_BACKEND, _create_chain_backend, validate_server_args,
                       handle_server_args)


def _create_chain_backend(model_runner):
    from ..chain_attention import create

    return create(model_runner)


def _error(message: str):
    from sglang_vc.speculative import config_error

    return config_error(REMOTE_ALGORITHM, message)


def validate_server_args(server_args) -> None:
    from sglang_vc.config import get_vc_config

    from .stream import RemotePath

    settings = get_vc_config(server_args).group(flags.GROUP)
    tiering = flags.remote_path(settings) is RemotePath.TIERING
    if tiering and flags.remote_verifier(settings):
        raise _error("--vc-remote-path tiering verifies against this server's own full copy: "
                     "drop --vc-remote-verifier")
    if not tiering and not flags.remote_verifier(settings):
        raise _error("needs --vc-remote-verifier URL (the server near the store that verifies), "
                     "or --vc-remote-path tiering (lossless tiering inside this server)")
    if getattr(server_args, "radix_cache_backend", None) != "evicpress":
        raise _error("needs --radix-cache-backend evicpress (it loads the compressed copy of a "
                     "stored prefix, --evicpress-load-copy)")
    x = getattr(server_args, "speculative_num_draft_tokens", None)
    if x is not None and int(x) < 1:
        raise _error(f"--speculative-num-draft-tokens must be >= 1, got {x}")
    if (getattr(server_args, "speculative_eagle_topk", None) or 1) != 1:
        raise _error("forwards a single chain: --speculative-eagle-topk must be 1")


def handle_server_args(server_args) -> None:
    from sglang_vc.notices import switched_off

    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = DEFAULT_REMOTE_DRAFT_TOKENS
    server_args.speculative_num_steps = int(server_args.speculative_num_draft_tokens)
    algorithm = f"--speculative-algorithm {REMOTE_ALGORITHM}"
    if not server_args.disable_overlap_schedule:
        switched_off("the overlap scheduler", algorithm,
                     "its worker drafts, then waits for the remote verify, synchronously")
    if server_args.enable_mixed_chunk:
        switched_off("mixed chunks (--enable-mixed-chunk)", algorithm,
                     "its decode iterations are draft rounds, not mixable with a prefill chunk")
    server_args.speculative_eagle_topk = 1
    server_args.disable_overlap_schedule = True
    server_args.enable_mixed_chunk = False
    from sglang_vc.config import get_vc_config

    from .stream import RemotePath

    tiering = flags.remote_path(get_vc_config(server_args).group(flags.GROUP)) is RemotePath.TIERING
    if tiering and str(getattr(server_args, "device", "") or "").startswith("cpu") and \
            server_args.attention_backend in (None, "torch_native", "vc_torch"):
        # a tiering verify is a chain TARGET_VERIFY forward, which SGLang's torch_native
        # backend does not run (FlashInfer on a GPU does): vc_torch plus that forward
        server_args.attention_backend = CHAIN_BACKEND
