"""The speculative model of the server's ``speccache`` selector: a small built-in model
(HF transformers, in the server's front-end process) whose per-token importance (eq. 1:
mean L2 norm of its hidden states over the last third of its layers) ranks the prompt's
tokens. It reads the prompt's text with its own tokenizer; the character offsets of its
tokens align them with the target's (:mod:`.align`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from . import spans


@dataclass(frozen=True)
class SpecScores:
    importance: Tensor  # [n] float32, one per speculative token
    offsets: list[tuple[int, int]]  # character span of each speculative token


class SpecModel:
    def __init__(self, name: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sglang_vc import models

        path = models.resolve(name)
        self.name = name
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
        self._lock = threading.Lock()  # one forward at a time (called from worker threads)

    @torch.no_grad()
    def score(self, text: str) -> SpecScores:
        enc = self.tokenizer(text, return_offsets_mapping=True)
        ids = torch.tensor([enc["input_ids"]], device=self.device)
        with self._lock:  # the decoder alone: eq. 1 needs hidden states, not the LM head's logits
            out = self.model.get_decoder()(ids, output_hidden_states=True)
        importance = spans.importance([h[0] for h in out.hidden_states[1:]]).float().cpu()
        return SpecScores(importance, [tuple(o) for o in enc["offset_mapping"]])
