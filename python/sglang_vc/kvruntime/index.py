"""Per-request metadata of a compressed request: where its KV is.

A request's KV lives where SGLang puts every request's KV, its row of ``req_to_token``
(position -> pool slot), with two additions:

* a row position may point at :data:`~.names.NULL_SLOT`: the token was dropped (its slot
  went back to the pool) and attention skips it. A token-dropped prefix of ``n`` tokens
  keeps ``n_keep`` rows: positions ``[a, a + n_keep)`` hold the kept rows (per layer and
  KV head, the j-th kept row of that head: keys carry their own RoPE, so every later
  query sees them whatever their order) and ``[a + n_keep, a + n)`` are null;
* a quantized prefix (KIVI) is a payload of packed rows kept beside the pool, standing
  for positions ``[0, payload.num_tokens)``, visible to every later query.

The KV a request attends to in every layer is therefore::

    [dequantized payload rows]  ++  non-null pool rows of req_to_token[row, row_start : seq_len]

with the causal mask by row position (every compressed row sits before every later
query). ``attend_from`` is where the request's ordinary (uncompressed, own) rows begin.

Ownership (what the radix cache frees when the request ends): the non-null slots of row
positions ``>= prefix_len``; positions below ``prefix_len`` belong to the radix tree, and
the null ones were freed at compression time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .plan import CompressionSpec


@dataclasses.dataclass
class QuantPayload:
    """KIVI payload of the quantized prefix, per layer (``QuantizedKV`` without residual)."""

    layers: dict[int, Any]  # layer_id -> QuantizedKV (residual tensors empty)
    num_tokens: int  # tokens quantized (positions [0, num_tokens))
    nbytes: int = 0
    # [L, 6] int64 addresses of each layer's tensors (built on first use by
    # .payload_table; a payload is replaced, never changed in place)
    addresses: Any = None
    home: Any = None  # the pool slots leased for it (.payload_store.PayloadHome)


@dataclasses.dataclass
class CompressedKVIndex:
    rid: str
    req_pool_idx: int
    spec: CompressionSpec
    prompt_len: int  # tokens whose KV was compressed (the prefill length)
    prefix_len: int  # of which borrowed from the radix tree (cache_protected_len)
    row_start: int  # first row position read from the pool (the payload covers the rest)
    attend_from: int  # row position where the request's ordinary (uncompressed) rows start
    tokens_kept: int = 0  # token dropping: rows kept of the compressed prefix
    payload: Optional[QuantPayload] = None
    in_place: bool = False  # quantized values written back in full precision (no saving)
    quantized_tokens: int = 0  # tokens whose KV was replaced by quantized values
    slots_freed: int = 0  # pool slots given back so far (compression + online evictions)
    online_evicted: int = 0  # tokens evicted per head after the prefill (online methods)
    # Set by a user of the index that needs the rows after the compressed prefix to stay
    # full KV (VeriCache verifies against them): no online eviction, no tail quantization.
    keep_full_rows: bool = False

    @property
    def num_payload_rows(self) -> int:
        """Rows of the quantized payload (visible to every query)."""
        return self.payload.num_tokens if self.payload is not None else 0

    def summary(self) -> dict[str, Any]:
        """What ``meta_info`` reports for the request."""
        out = {
            **self.spec.describe(),
            "prompt_tokens": self.prompt_len,
            "cached_prefix_tokens": self.prefix_len,
            "slots_freed": self.slots_freed,
        }
        if self.spec.scenario == "token_dropping":
            out["tokens_kept"] = self.tokens_kept
        else:
            out["tokens_quantized"] = self.quantized_tokens
            out["payload_bytes"] = self.payload.nbytes if self.payload else 0
            # pool slots leased to hold it (taken from SGLang's free list while it lives)
            out["payload_slots"] = self.payload.home.lease.size if self.payload and self.payload.home else 0
            out["in_place"] = self.in_place
        if self.spec.mode == "online":
            out["online_evicted"] = self.online_evicted
        return out
