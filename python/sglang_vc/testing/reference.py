"""Full-KV reference decoding with HF transformers, and the token-by-token comparison
that the project calls *identical output* (docs/architecture.md, "Definitions"): the same
tokens, the same length and the same finish reason.

A divergence from the reference is allowed only at a near-tie of the reference: the
top-2 logit gap at that step is below ``NEAR_TIE_REL`` of the top logit. It is counted
and reported, never hidden; comparison of that sequence stops there because the two
trajectories differ afterwards.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

NEAR_TIE_REL = 1e-4


@dataclasses.dataclass
class Reference:
    tokens: list[int]
    top2_gaps: list[float]  # logit(top1) - logit(top2) at each step
    top_logits: list[float]
    finish_reason: str = "length"  # decoded to max_new_tokens, EOS ignored (as the server is asked)

    def is_near_tie(self, step: int) -> bool:
        return self.top2_gaps[step] < NEAR_TIE_REL * abs(self.top_logits[step])


@dataclasses.dataclass
class Comparison:
    matched: int  # tokens equal before the first divergence (or all)
    compared: int
    near_tie_divergence: bool  # diverged, at a near-tie of the reference
    wrong_token_at: int | None  # diverged NOT at a near-tie: a real error
    length: tuple[int, int] = (0, 0)  # (reference, output) token counts
    finish_reason: tuple[str, str | None] = ("length", "length")  # (reference, output)

    @property
    def identical(self) -> bool:
        """Same tokens (up to a counted near-tie divergence), same length, same finish
        reason: a truncated or aborted output that is a prefix of the reference is not."""
        return (self.wrong_token_at is None and self.length[0] == self.length[1]
                and self.finish_reason[0] == self.finish_reason[1])


def finish_type(out: dict) -> str | None:
    """The finish reason's type (``length``, ``stop``, ``abort``) of a ``/generate`` reply."""
    reason = out.get("meta_info", {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


@lru_cache(maxsize=2)
def load_hf_model(model_dir: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


@torch.inference_mode()
def greedy_reference(model_dir: str, input_ids: list[int], max_new_tokens: int,
                     dtype: str = "float32") -> Reference:
    model = load_hf_model(model_dir, dtype)
    out = model.generate(
        torch.tensor([input_ids]),
        attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # the server is asked with ignore_eos too
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.eos_token_id,
    )
    tokens = out.sequences[0, len(input_ids):].tolist()
    gaps, tops = [], []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
        tops.append(float(top2[0]))
    return Reference(tokens, gaps, tops)


def compare(reference: Reference, tokens: list[int], finish_reason: str | None) -> Comparison:
    """``tokens`` (an output that finished with ``finish_reason``) against the reference."""
    n = min(len(reference.tokens), len(tokens))
    shape = {"length": (len(reference.tokens), len(tokens)), "finish_reason": (reference.finish_reason, finish_reason)}
    for i in range(n):
        if reference.tokens[i] != tokens[i]:
            near_tie = reference.is_near_tie(i)
            return Comparison(i, n, near_tie, None if near_tie else i, **shape)
    return Comparison(n, n, False, None, **shape)


@torch.inference_mode()
def penalised_step(model_dir: str, input_ids: list[int], output_prefix: list[int], params: dict,
                   stop_ids: tuple = (), dtype: str = "float32") -> tuple[int, bool]:
    """The reference's greedy token after ``output_prefix`` with SGLang's penalties in
    ``params`` (``frequency_penalty`` and ``presence_penalty`` subtracted, then
    ``repetition_penalty`` scaling, each over the output tokens only, as SGLang's
    penalizers count them; ``min_new_tokens`` holding back ``stop_ids``), and whether that
    step is a near-tie. For a divergence between two servers: the one whose token this
    is followed the reference there, the other left it."""
    model = load_hf_model(model_dir, dtype)
    logits = model(torch.tensor([input_ids + output_prefix])).logits[0, -1].double()
    counts = torch.bincount(torch.tensor(output_prefix, dtype=torch.long), minlength=logits.numel())[: logits.numel()]
    logits -= float(params.get("frequency_penalty", 0.0)) * counts.double()
    logits -= float(params.get("presence_penalty", 0.0)) * (counts > 0).double()
    rep, seen = float(params.get("repetition_penalty", 1.0)), counts > 0
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
    if len(output_prefix) < int(params.get("min_new_tokens", 0) or 0):
        logits[list(stop_ids)] = float("-inf")
    top2 = torch.topk(logits, 2)
    gap, top = float(top2.values[0] - top2.values[1]), float(top2.values[0])
    return int(top2.indices[0]), gap < NEAR_TIE_REL * abs(top)
