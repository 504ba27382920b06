"""What SGLang's overlap scheduler asks of a project worker that runs under it (VERICACHE).

Under ``event_loop_overlap`` iteration ``k`` is launched before the result of ``k - 1`` is
processed, so the scheduler cannot read a spec worker's committed lengths or last tokens
from its requests: the worker publishes each forward's new lengths (``on_publish``) and
hands its requests' last committed tokens to SGLang's future map (``bonus_tokens`` on the
draft input), which the next forward's batch gets back on the device
(``FutureMap.resolve_seq_lens_cpu`` / ``_resolve_spec_extras``). Everything here is device
tensor work: no host read.

A forward whose iteration the scheduler ran synchronously (the worker asked for it:
``VeriCacheWorker.needs_sync``) processed ``k - 1`` before the forward, after the batch
was built: requests that finished at ``k - 1`` are still in it, released. The worker
forwards only the others and widens its result back to the batch (:func:`widen`);
SGLang's output path skips finished requests.
"""

from __future__ import annotations

from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.speculative.ngram_info import NgramVerifyInput


def on(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``: as it is where it is there already (an overlapped iteration's
    tokens), else a non-blocking copy of the small host tensor (``to_device``)."""
    return t if t.device == torch.device(device) else to_device(t, device)


class RelayInput(NgramVerifyInput):
    """The draft input a project worker returns: SGLang's chain-verify input (its
    ``filter_batch``/``merge_batch`` follow the batch, by ``future_indices`` under the
    overlap scheduler) plus the fields the future map's relay reads: ``bonus_tokens``
    (each request's last committed token, on the device), no top-k, no hidden states."""

    def __init__(self, *, bonus_tokens: Optional[torch.Tensor] = None, **kwargs):
        super().__init__(**kwargs)
        self.bonus_tokens = bonus_tokens
        self.topk_p = self.topk_index = self.hidden_states = None
        self.dsa_topk_indices = None
        self.future_dsa_topk_indices_available = False


def last_tokens(tokens: torch.Tensor, lens: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Each request's last committed token after an iteration: the last of the ``lens[i]``
    tokens it committed (``tokens [bs * stride]``), else its ``previous`` last token."""
    bs = lens.shape[0]
    per_req = tokens.view(bs, -1).to(torch.int64)
    last = per_req.gather(1, (lens.to(torch.int64) - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where(lens > 0, last, previous.to(torch.int64))


def relay(result, batch, on_publish) -> None:
    """Publish ``result``'s new lengths and give its draft input the requests' last
    committed tokens (the prefill's sampled one; at decode, from the batch's relayed
    ones where a request committed nothing)."""
    if on_publish is None:
        return
    previous = getattr(batch.spec_info, "bonus_tokens", None)
    if batch.forward_mode.is_decode() and previous is not None:
        bonus = last_tokens(result.next_token_ids, result.accept_lens, previous)
    else:
        bonus = result.next_token_ids.view(len(batch.reqs), -1)[:, 0].to(torch.int64)
    result.next_draft_input.bonus_tokens = bonus
    on_publish(result.new_seq_lens)


def finished_rows(batch) -> list[int]:
    """The batch's requests that its previous result finished or released before this
    forward (a synchronous iteration under the overlap scheduler)."""
    return [i for i, r in enumerate(batch.reqs) if r.finished() or r.kv.req_pool_idx is None]


def widen(result, live: list[int], batch):
    """``result`` of the ``live`` requests of ``batch`` (at least one) as the whole
    batch's: the others commit nothing (SGLang's output path skips them, finished);
    every per-request output, ``[n, ...]`` or ``[n * stride, ...]``, is scattered back
    into batch order."""
    bs, n = len(batch.reqs), len(live)
    index = torch.tensor(live, dtype=torch.int64)

    def scatter(value):
        per = len(value) // n
        rows = [i * per + j for i in live for j in range(per)]
        if isinstance(value, torch.Tensor):
            out = value.new_zeros((bs * per, *value.shape[1:]))
            out[on(torch.tensor(rows), value.device)] = value
            return out
        out = [value[0]] * (bs * per)  # (never read: the output path skips finished requests)
        for j, i in enumerate(rows):
            out[i] = value[j]
        return out

    result.next_token_ids = scatter(result.next_token_ids)
    result.accept_lens = scatter(result.accept_lens)
    seq_lens = batch.seq_lens.clone()
    seq_lens[on(index, seq_lens.device)] = result.new_seq_lens.to(seq_lens.dtype)
    result.new_seq_lens = seq_lens
    out = result.logits_output
    for name in ("next_token_logprobs", "next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                 "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx"):
        value = getattr(out, name, None)
        if value is not None and len(value):
            setattr(out, name, scatter(value))
    if getattr(batch, "return_logprob", False) and out.next_token_logprobs is None:
        # only finished requests asked for logprobs: SGLang reads the field, not their rows
        out.next_token_logprobs = torch.zeros(bs, len(result.next_token_ids) // bs)
    draft = result.next_draft_input
    draft.new_seq_lens, draft.accept_tokens, draft.accept_lens = seq_lens, result.next_token_ids, result.accept_lens
    return result
