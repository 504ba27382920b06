"""Checks of a request's inputs that SGLang 0.5.23 leaves to the scheduler, made before the
request is queued, on every sglang-vc server (``hooks.py`` calls them from SGLang's own
validation, where a ``ValueError`` is the client's HTTP 400).

* Token ids: SGLang checks ``token_ids_logprob`` against the vocabulary but not the
  prompt's ids. An id outside ``[0, vocab_size)`` reaches the embedding lookup inside the
  scheduler, which raises (a device-side assert on a GPU) and takes the scheduler down:
  every later request of every client fails.
* ``custom_params``: SGLang's sampling parameters take any value there; sglang-vc reads
  its per-request options from it, so anything but a JSON object is refused rather than
  silently ignored.
"""

from __future__ import annotations

from typing import Any, Sequence


def check_token_ids(input_ids: Sequence[int] | None, vocab_size: int, what: str = "input_ids") -> None:
    """``ValueError`` naming the first id of ``input_ids`` that is not a token of the model."""
    if input_ids is None:
        return
    for i, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"{what}[{i}] = {token!r} is not a token id of this model: "
                             f"token ids are integers in [0, {vocab_size})")


def check_custom_params(custom_params: Any) -> None:
    if custom_params is not None and not isinstance(custom_params, dict):
        raise ValueError(f"sampling_params.custom_params must be a JSON object, got "
                         f"{type(custom_params).__name__} {custom_params!r:.80}")
