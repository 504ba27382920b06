"""Where a benchmark row's output differs from the full-KV row's: a near-tie or a wrong
token, decided by a float32 reference (HF transformers) at the first token they differ.

Two servers of the same model and dtype can part at a position where the model's top two
tokens are within float error of each other (different batch shapes sum in a different
order). The definition of *identical output* allows exactly that: a divergence at a
near-tie of the float32 reference (top-2 logit gap below ``NEAR_TIE_REL`` of the top
logit), counted. Anything else is a wrong token, which fails the row, unless the row's
token is the reference's own choice (then it is the full-KV row that left the reference).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sglang_vc.testing.reference import NEAR_TIE_REL, load_hf_model

CHUNK = 1024  # prompt tokens per reference forward (bounds the attention scores' memory)


@dataclasses.dataclass(frozen=True)
class Divergence:
    request: int
    position: int  # output tokens equal before it
    kind: str  # near-tie | wrong-token | baseline-off | length
    gap: Optional[float] = None  # the reference's top-2 logit gap there
    reference_token: Optional[int] = None
    row_token: Optional[int] = None
    baseline_token: Optional[int] = None

    @property
    def fails(self) -> bool:
        return self.kind in ("wrong-token", "length")


@torch.inference_mode()
def last_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    """The float32 reference's logits after ``ids`` (a chunked prefill through HF's cache)."""
    from transformers import DynamicCache

    model = load_hf_model(model_dir, "float32")
    cache, out = DynamicCache(), None
    for start in range(0, len(ids), CHUNK):
        chunk = torch.tensor([ids[start : start + CHUNK]])
        out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return out.logits[0, -1].float()


def classify(model_dir: str, prompts: list[list[int]], baseline: list[list[int]],
             outputs: list[list[int]]) -> list[Divergence]:
    """Every request whose output differs from the baseline's, classified."""
    found = []
    for i, (prompt, base, out) in enumerate(zip(prompts, baseline, outputs)):
        if out == base:
            continue
        j = next((k for k, (a, b) in enumerate(zip(base, out)) if a != b), None)
        if j is None:  # one is a prefix of the other
            found.append(Divergence(i, min(len(base), len(out)), "length"))
            continue
        logits = last_logits(model_dir, prompt + base[:j])
        top2 = torch.topk(logits, 2)
        gap, top = float(top2.values[0] - top2.values[1]), int(top2.indices[0])
        if gap < NEAR_TIE_REL * abs(float(top2.values[0])):
            kind = "near-tie"
        elif out[j] == top:
            kind = "baseline-off"
        else:
            kind = "wrong-token"
        found.append(Divergence(i, j, kind, gap, top, out[j], base[j]))
    return found
