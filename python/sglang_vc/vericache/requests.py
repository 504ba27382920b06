"""What a VERICACHE request may ask for: honoured exactly, or refused with HTTP 400.

The verifier picks each committed token from the full-KV logits the way SGLang's own
sampler would in full-KV decoding (``spec_worker.ChainSpecWorker.targets_flat``):
temperature, ``top_k``, ``top_p``, ``min_p``, ``logit_bias``, under
``--enable-deterministic-inference`` the per-request ``sampling_seed``, and the
penalties (``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``) and
``min_new_tokens`` at each position of a verify window from the output before it, the
window's earlier drafts included (:mod:`sglang_vc.penalties`); a grammar
(``json_schema``, ``regex``, ``ebnf``, ``structural_tag``) masks each position after the
drafts before it (:mod:`sglang_vc.grammar_masks`); logprobs come from the same full-KV
logits.

Refused, because the verifier would silently produce something else than full-KV
decoding:

* on SPECACHE and VERICACHE_REMOTE servers, grammar constraints (``json_schema``,
  ``regex``, ``ebnf``, ``structural_tag``);
* ``watermark`` and custom logit processors (arbitrary per-step logits transforms);
* ``beam_width`` (beam search is another decoding algorithm);
* on SPECACHE and VERICACHE_REMOTE servers, ``return_logprob`` (``top_logprobs_num``,
  ``token_ids_logprob``): SpeCache's logits are its lossy attention's, and the remote
  verifier returns tokens only. (VERICACHE returns them from the verify's full-KV
  logits, ``spec_worker.ChainSpecWorker.committed_logprobs``.)

SGLang validates a request in the tokenizer manager, where a ``ValueError`` is the
client's HTTP 400; ``hooks.py`` calls :func:`check_sampling_params` after
``SamplingParams.verify`` and :func:`check_request` after ``_validate_one_request``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .names import ALGORITHM, REMOTE_ALGORITHM

__all__ = ["check_sampling_params", "check_request", "unsupported_sampling", "unsupported_request"]

# (parameter, is it set to something the verifier cannot honour)
_SAMPLING: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("json_schema", lambda sp: sp.json_schema is not None),
    ("regex", lambda sp: sp.regex is not None),
    ("ebnf", lambda sp: sp.ebnf is not None),
    ("structural_tag", lambda sp: sp.structural_tag is not None),
    ("watermark", lambda sp: getattr(sp, "watermark", None) is not None),
    ("beam_width", lambda sp: getattr(sp, "beam_width", None) is not None),
)

def _each(value) -> list:
    """A request option's values: batched fields hold one per prompt."""
    return value if isinstance(value, list) else [value]


# request-level options (GenerateReqInput fields); token_ids_logprob is a list of token
# ids, or one such list (or None) per prompt
_REQUEST: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("return_logprob", lambda v: any(bool(x) for x in _each(v))),
    ("top_logprobs_num", lambda v: any(bool(x) for x in _each(v))),
    ("token_ids_logprob", lambda v: bool(v) and any(x is not None and x != [] for x in v)),
    ("custom_logit_processor", lambda v: any(x is not None for x in _each(v))),
)


_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def unsupported_sampling(sampling_params: Any, algorithm: str = ALGORITHM) -> list[str]:
    """The parameters of a normalized ``SamplingParams`` ``algorithm`` cannot honour:
    VERICACHE masks each verify position with the request's grammar; SPECACHE and
    VERICACHE_REMOTE do not apply grammars."""
    return [name for name, is_set in _SAMPLING if is_set(sampling_params)
            and not (algorithm == ALGORITHM and name in _GRAMMARS)]


_LOGPROBS = ("return_logprob", "top_logprobs_num", "token_ids_logprob")


def unsupported_request(req: Any, algorithm: str = ALGORITHM) -> list[str]:
    """The request-level options (``GenerateReqInput``) ``algorithm`` cannot honour; a
    batched field (one value per prompt) counts when any of its values is set. VERICACHE
    returns logprobs from its verify's full-KV logits; SPECACHE (lossy logits) and
    VERICACHE_REMOTE (greedy tokens only) do not."""
    return [name for name, is_set in _REQUEST if is_set(getattr(req, name, None))
            and not (algorithm == ALGORITHM and name in _LOGPROBS)]


def _serving() -> Optional[str]:
    """The project's speculative algorithm this server runs (VERICACHE, or SPECACHE,
    whose worker picks each token with the same function), None for any other."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_vc.speculative import supported_algorithms

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!": not in a server
        return None
    algo: Optional[str] = getattr(server_args, "speculative_algorithm", None)
    algo = str(algo).upper() if algo else None
    return algo if algo in supported_algorithms() else None


def _refuse(names: list[str], algorithm: str = ALGORITHM) -> None:
    if names:
        raise ValueError(
            f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not supported with "
            f"--speculative-algorithm {algorithm}: its worker cannot apply "
            f"{'it' if len(names) == 1 else 'them'} exactly as full-KV decoding does "
            "(supported: temperature, top_k, top_p, min_p, logit_bias, sampling_seed, "
            "frequency_penalty, presence_penalty, repetition_penalty, min_new_tokens"
            f"{', logprobs, json_schema, regex, ebnf, structural_tag' if algorithm == ALGORITHM else ''})")


def check_sampling_params(sampling_params: Any) -> None:
    """``ValueError`` (HTTP 400) naming each sampling parameter a VERICACHE server
    cannot honour; nothing on any other server."""
    algorithm = _serving()
    if algorithm:
        _refuse(unsupported_sampling(sampling_params, algorithm), algorithm)
    if algorithm == REMOTE_ALGORITHM:
        _refuse_remote(sampling_params)


def _refuse_remote(sp: Any) -> None:
    """The remote verifier returns its greedy tokens only: sampling (and a logit bias or
    penalties, which it would not see) is not built for ``VERICACHE_REMOTE``."""
    from sglang_vc.penalties import has_penalties

    greedy = float(sp.temperature) == 0.0 or int(sp.top_k) == 1
    problems = ([] if greedy else ["sampling (temperature > 0 with top_k != 1)"]) + (
        ["logit_bias"] if getattr(sp, "logit_bias", None) else []) + (
        ["penalties and min_new_tokens"] if has_penalties(sp) else [])
    if problems:
        raise ValueError(f"{', '.join(problems)}: not built for --speculative-algorithm {REMOTE_ALGORITHM}, "
                         "whose verifier returns greedy tokens only (use temperature 0)")


def check_request(req: Any) -> None:
    """``ValueError`` (HTTP 400) naming each request option a VERICACHE server cannot
    honour; nothing on any other server."""
    algorithm = _serving()
    if algorithm:
        names = unsupported_request(req, algorithm)
        if algorithm == REMOTE_ALGORITHM and any(x is not None for x in _each(getattr(req, "cache_salt", None))):
            # a salted request's lossy copy is a device copy of its own; the full copy
            # replaces the context's unsalted one (remote/worker.py), so it is not built
            names.append("cache_salt")
        _refuse(names, algorithm)
