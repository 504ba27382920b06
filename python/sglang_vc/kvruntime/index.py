"""Per-request metadata of a compressed request: where its KV is.

The KV a compressed request attends to in every layer is, in order::

    [dequantized payload rows]  ++  pool rows ``comp_slots``  ++  pool rows of
    ``req_to_token[req_pool_idx, attend_from : seq_len]``

The first two parts are the compressed prefix: every query sees all of it (RoPE is
already applied to the keys, so row order and per-head position sets do not matter). The
last part is ordinary KV at row positions ``attend_from ..``, causal as usual. SGLang
keeps computing positions from ``seq_len``, so RoPE of new tokens stays the real one.

Ownership (what the radix cache frees when the request ends): ``comp_slots`` (always the
request's own) and the row ``[max(cache_protected_len, attend_from), end)``. Row positions
below ``attend_from`` were either freed at compression time or belong to the tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .plan import CompressionSpec


@dataclasses.dataclass
class QuantPayload:
    """KIVI payload of the quantized prefix, per layer (``QuantizedKV`` without residual)."""

    layers: dict[int, Any]  # layer_id -> QuantizedKV (residual tensors empty)
    num_tokens: int  # tokens quantized (positions [0, num_tokens))
    nbytes: int = 0


@dataclasses.dataclass
class CompressedKVIndex:
    rid: str
    req_pool_idx: int
    spec: CompressionSpec
    prompt_len: int  # tokens whose KV was compressed (the prefill length)
    prefix_len: int  # of which borrowed from the radix tree (cache_protected_len)
    comp_slots: torch.Tensor  # int64 [m]: pool slots holding compressed rows, owned
    attend_from: int  # row position where the ordinary (uncompressed) KV starts
    payload: Optional[QuantPayload] = None
    in_place: bool = False  # quantized values written back in full precision (no saving)
    quantized_tokens: int = 0  # tokens whose KV was replaced by quantized values
    slots_freed: int = 0  # pool slots given back so far (compression + online evictions)
    online_evicted: int = 0  # tokens evicted per head after the prefill (online methods)
    # Set by a user of the index that needs the rows after the compressed prefix to stay
    # full KV (VeriCache verifies against them): no online eviction, no tail quantization.
    keep_full_rows: bool = False

    @property
    def num_prefix_rows(self) -> int:
        """Rows of the compressed prefix (payload + comp_slots)."""
        q = self.payload.num_tokens if self.payload is not None else 0
        return q + int(self.comp_slots.numel())

    def summary(self) -> dict[str, Any]:
        """What ``meta_info`` reports for the request."""
        out = {
            **self.spec.describe(),
            "prompt_tokens": self.prompt_len,
            "cached_prefix_tokens": self.prefix_len,
            "slots_freed": self.slots_freed,
        }
        if self.spec.scenario == "token_dropping":
            out["tokens_kept"] = int(self.comp_slots.numel())
        else:
            out["tokens_quantized"] = self.quantized_tokens
            out["payload_bytes"] = self.payload.nbytes if self.payload else 0
            out["in_place"] = self.in_place
        if self.spec.mode == "online":
            out["online_evicted"] = self.online_evicted
        return out
