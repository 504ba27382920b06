"""``cacheblend`` ("CacheBlend: Fast Large Language Model Serving for RAG with Cached
Knowledge Fusion"): the chunk tokens whose first-layer KV deviates most between the
reused (precomputed) and the recomputed values. The runtime computes the target's first
layer over the whole prompt and passes the per-token deviation."""

from __future__ import annotations

from torch import Tensor

from .base import Need, SelectionInput, Selector, top_chunk_tokens


class CacheBlend(Selector):
    name = "cacheblend"
    needs = Need.FIRST_LAYER_DEVIATION

    def select(self, inp: SelectionInput, ratio: float) -> Tensor:
        if inp.first_layer_deviation is None:
            raise ValueError("cacheblend needs the first layer's KV deviation")
        return top_chunk_tokens(inp.first_layer_deviation, inp.chunks, inp.chunks.budget(ratio))
